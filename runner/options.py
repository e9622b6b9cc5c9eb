"""The options the proxy runner accepts: the one list of them (the runner's issue owns it).

Their names are the canonical hyperparameter names of kb.vocab (`lr`, `batch_size`, ...), so
a hypothesis may change `lr` on a baseline whose config spells it `optim.learning_rate`, and a
key the baseline lacks is still something the runner knows how to set. A hypothesis's change
keys must each be a key of its baseline's config or one of these (agents.proposal_checks).
"""
from __future__ import annotations

RUNNER_OPTIONS: dict[str, str] = {
    "lr": "peak learning rate",
    "min_lr": "final learning rate of the decay",
    "warmup_steps": "linear warmup length in steps",
    "max_steps": "optimizer steps",
    "batch_size": "sequences per optimizer step",
    "seq_len": "context length in tokens",
    "n_layer": "transformer blocks (the size dial: width, heads derive from it)",
    "d_model": "residual width",
    "n_head": "attention heads",
    "weight_decay": "AdamW weight decay",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "global gradient-norm clip (0: none)",
    "dropout": "dropout probability",
    "seed": "random seed",
    "norm": "layernorm | rmsnorm",
    "data.mixture": "data mixture: {source: weight}, weights summing to 1",
}


def is_runner_option(key: str) -> bool:
    """A change key the runner can apply without it being in the baseline's config: an option,
    or one source's weight in the data mixture (`data.mixture.web`)."""
    return key in RUNNER_OPTIONS or key.startswith("data.mixture.")
