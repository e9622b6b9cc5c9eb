"""The options the proxy runner accepts: the one list of them (the runner's issue owns it).

Their names are the canonical hyperparameter names of kb.vocab (`lr`, `batch_size`, ...), so
a hypothesis may change `lr` on a baseline whose config spells it `optim.learning_rate`, and a
key the baseline lacks is still something the runner knows how to set. A hypothesis's change
keys must each be a key of its baseline's config or one of these (agents.proposal_checks).

runner.train.TrainConfig has one field per option (dots become underscores: `data.mixture` is
`data_mixture`); a run's resolved config stores them under these names, the data options
nested (`{"data": {"mixture": {...}, "sources": {...}}}`) so `data.mixture.web` is a path in it.
RUNTIME_OPTIONS change how fast a run goes, not what it computes: they go with the run's
meta, not its config, so two runs that differ only there are the same experiment.
"""
from __future__ import annotations

RUNNER_OPTIONS: dict[str, str] = {
    # model
    "n_layer": "transformer blocks (the size dial: width, heads and lr derive from it)",
    "d_model": "residual width (default 64 x n_layer)",
    "n_head": "attention heads (default d_model / 64)",
    "n_kv_head": "key/value heads, grouped-query attention (default n_head; 1 is multi-query)",
    "vocab_size": "vocabulary size (default: the tokenizer's, 256 for bytes)",
    "pos": "positional scheme: learned | rope",
    "norm": "layernorm | rmsnorm",
    "norm_position": "pre | post (norm before each sublayer, or after the residual sum)",
    "activation": "MLP activation: gelu | swiglu | relu2",
    "qk_norm": "RMS-normalise queries and keys per head before attention",
    "tie_embeddings": "share the input embedding with the output projection",
    "dropout": "dropout probability",
    # optimisation
    "optimizer": "adamw | muon (Muon on hidden matrices, AdamW on embeddings, head and gains)",
    "lr": "peak learning rate (default scales as 1/sqrt(d_model))",
    "min_lr": "final learning rate of the decay (default lr / 10)",
    "warmup_steps": "linear warmup length in steps",
    "schedule": "decay after warmup: cosine | linear | wsd (constant, then linear to min_lr)",
    "decay_frac": "wsd: the final fraction of steps spent decaying",
    "weight_decay": "decoupled weight decay on matrices (not on gains, biases or embeddings)",
    "beta1": "AdamW beta1 (Muon's momentum)",
    "beta2": "AdamW beta2",
    "grad_clip": "global gradient-norm clip (0: none)",
    "batch_size": "sequences per optimizer step",
    "micro_batch_size": "sequences per forward pass (gradient accumulation; default batch_size)",
    "seq_len": "context length in tokens",
    "max_steps": "optimizer steps (the schedule's length)",
    "max_tokens": "token budget: stop once this many tokens were trained on (0: none)",
    "max_seconds": "time budget: seconds of the training loop, evaluations and resumes included (0: none)",
    "seed": "random seed (initialisation, batches, dropout)",
    # evaluation and failure
    "eval_interval": "steps between validation evaluations",
    "eval_batches": "batches per source in each validation",
    "divergence_factor": "a train loss above this many times the first one is a divergence",
    # data
    "data.mixture": "data mixture: {source: weight}, weights summing to 1",
    "data.sources": "{source: path, glob or list of .bin shards}; builtin: prose, code",
}

RUNTIME_OPTIONS: dict[str, str] = {
    "device": "auto | cpu | cuda | cuda:N",
    "compile": "torch.compile the model (default: on a GPU)",
    "threads": "CPU threads for torch (default: all cores)",
    "checkpoint_interval": "steps between checkpoints (0: only at the end)",
}


def is_runner_option(key: str) -> bool:
    """A change key the runner can apply without it being in the baseline's config: an option,
    or one source's weight in the data mixture (`data.mixture.web`)."""
    return key in RUNNER_OPTIONS or key.startswith("data.mixture.")
