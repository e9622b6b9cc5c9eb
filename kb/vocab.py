"""One vocabulary for metrics and hyperparameters: canonical names and the aliases sources use.

The same quantity arrives as `val/loss`, `val_loss`, `eval/loss`, `eval_loss` or llm.c's
`tel`; a learning rate as `lr`, `learning_rate`, `opt_base_learning_rate` or
`train/learning_rate`. A run keeps its keys exactly as logged; this module says which
canonical name each one answers to, so runs from two sources can be compared:

    metric_name("eval_loss")            -> "val/loss"
    hparam_name("learning_rate")        -> "lr"
    canonical_hparams({"optim": {"lr": 3e-4}})   -> {"lr": (("optim", "lr"), 3e-4)}
    column_target("params_N")           -> "scale.params"     (table columns)
    column_target("loss")               -> "summary.loss"

Names are compared after folding case and separators (`Eval-Loss`, `eval_loss` and
`eval/loss` are one spelling), so each alias is listed once.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# canonical metric -> aliases (folded); a metric's own canonical spelling is always an alias
METRICS: dict[str, tuple[str, ...]] = {
    "train/loss": ("loss", "train loss", "training loss", "trl", "lm loss", "train lm loss",
                   "train/lm loss", "tr loss", "train nll"),
    "val/loss": ("val loss", "valid loss", "validation loss", "eval loss", "dev loss", "tel",
                 "val lm loss", "validation lm loss", "lm loss value", "eval/lm loss", "val nll",
                 "validation/loss", "valid/loss"),
    "train/ppl": ("ppl", "train ppl", "train perplexity", "perplexity"),
    "val/ppl": ("val ppl", "eval ppl", "validation ppl", "val perplexity", "eval perplexity",
                "validation perplexity"),
    "lr": ("lr", "learning rate", "train/learning rate", "train/lr", "opt base learning rate",
           "optimizer/lr", "lr-adamw", "lr/group0"),
    "grad_norm": ("grad norm", "norm", "gradient norm", "gnorm", "total norm", "grad l2 norm",
                  "train/grad norm", "grad-norm"),
    "tokens_per_sec": ("tokens per sec", "tok/s", "tokens/s", "tokens per second", "throughput",
                       "train/tokens per second", "tps"),
    "mfu": ("mfu", "train/mfu", "model flops utilization"),
    "train/accuracy": ("accuracy", "train accuracy", "acc", "train acc"),
    "val/accuracy": ("val accuracy", "eval accuracy", "validation accuracy", "val acc", "eval acc"),
}

# canonical hyperparameter -> aliases, searched in config breadth-first, first alias first
HPARAMS: dict[str, tuple[str, ...]] = {
    "lr": ("lr", "learning rate", "max lr", "peak lr", "base lr", "opt base learning rate",
           "lr max", "adam lr"),
    "batch_size": ("global batch size", "batch size", "global batch", "train batch size",
                   "total batch size", "gbs", "opt base batch size"),
    "micro_batch_size": ("micro batch size", "per device train batch size", "mbs", "device batch size"),
    "seq_len": ("seq len", "block size", "sequence length", "max seq len", "context length",
                "seq length", "n ctx", "max sequence length", "train seq len"),
    "n_layer": ("n layer", "num layers", "n layers", "num hidden layers", "depth", "layers"),
    "d_model": ("d model", "n embd", "hidden size", "dim", "model dim", "embed dim", "width"),
    "n_head": ("n head", "num heads", "num attention heads", "n heads", "heads"),
    "vocab_size": ("vocab size", "n vocab", "padded vocab size"),
    "weight_decay": ("weight decay", "wd", "opt weight decay"),
    "warmup_steps": ("warmup steps", "warmup iters", "num warmup steps", "lr warmup iters",
                     "warmup", "opt learning rate warmup steps"),
    "max_steps": ("max steps", "max iters", "num iterations", "train iters", "total steps",
                  "num train steps", "iterations"),
    "dropout": ("dropout", "hidden dropout", "resid pdrop"),
    "grad_clip": ("grad clip", "max grad norm", "clip grad", "gradient clipping", "clip grad norm"),
    "beta1": ("beta1", "adam beta1", "b1"),
    "beta2": ("beta2", "adam beta2", "b2"),
    "seed": ("seed", "random seed"),
}

# canonical scale quantity -> aliases (what tables and trackers call model size, data, compute)
SCALE: dict[str, tuple[str, ...]] = {
    "params": ("params", "n params", "num params", "parameters", "params n", "model size",
               "num parameters", "n parameters", "model params", "nparams", "non embedding params"),
    "tokens": ("tokens", "tokens d", "num tokens", "train tokens", "n tokens", "training tokens",
               "dataset size", "tokens seen", "total tokens", "data size"),
    "flops": ("flops", "compute", "compute c", "train flops", "training flops", "total flops",
              "training compute"),
    "gpus": ("gpus", "num gpus", "n gpus", "world size"),
    "gpu_hours": ("gpu hours", "gpu hrs"),
}
# single letters are the scaling-law convention only for table columns, never inside a config
TABLE_ONLY = {"n": "scale.params", "d": "scale.tokens", "c": "scale.flops"}

SEPARATORS = re.compile(r"[\s_\-./:]+")


@lru_cache(maxsize=1 << 14)      # every run's config and summary keys pass through here
def fold(name: str) -> str:
    """One spelling for comparing names: lowercase, any run of separators becomes one space."""
    return SEPARATORS.sub(" ", str(name).lower()).strip()


def _index(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for canon, aliases in table.items():
        for alias in (canon, *aliases):
            out.setdefault(fold(alias), canon)
    return out


_METRIC = _index(METRICS)
_HPARAM = _index(HPARAMS)
_SCALE = _index(SCALE)
PREFIXES = ("train", "eval", "val", "valid", "validation", "test", "dev")


@lru_cache(maxsize=8192)      # a source repeats a handful of names
def metric_name(key: str) -> str | None:
    """The canonical metric a logged key answers to, or None when the vocabulary has no entry."""
    f = fold(key)
    if f in _METRIC:
        return _METRIC[f]
    # a tracker's section prefix on a known name: train/lr, charts/val_loss, eval/lm_loss
    head, _, rest = f.partition(" ")
    if rest and head not in PREFIXES and rest in _METRIC:
        return _METRIC[rest]
    return None


@lru_cache(maxsize=8192)
def hparam_name(key: str) -> str | None:
    """The canonical hyperparameter a config key (its last segment) answers to, or None."""
    return _HPARAM.get(fold(key))


def scale_name(key: str) -> str | None:
    return _SCALE.get(fold(key))


def canonical_hparams(config: dict) -> dict[str, tuple[tuple[str, ...], Any]]:
    """{canonical: (path, value)} for every vocabulary hyperparameter found in a config.

    Breadth-first, so `optim.lr` beats `scheduler.warmup.lr`; within one depth the alias
    listed first wins (`global_batch_size` over a per-device `batch_size`). Only numbers
    count (an `lr: "auto"` is not a learning rate)."""
    found: dict[str, tuple[tuple[str, ...], Any]] = {}
    frontier: list[tuple[tuple[str, ...], dict]] = [((), config)]
    while frontier:
        level: dict[str, tuple[int, tuple[str, ...], Any]] = {}
        nxt = []
        for prefix, node in frontier:
            for key, value in node.items():
                path = prefix + (str(key),)
                if isinstance(value, dict):
                    nxt.append((path, value))
                    continue
                canon = hparam_name(key) if _is_number(value) else None
                if canon is None or canon in found:
                    continue
                rank = _alias_rank(canon, key)
                if canon not in level or rank < level[canon][0]:
                    level[canon] = (rank, path, value)
        found.update({c: (path, v) for c, (_, path, v) in level.items()})
        frontier = nxt
    return found


def canonical_metrics(keys) -> dict[str, str]:
    """{canonical: logged key} for logged metric/summary keys; a key already spelled canonically
    wins over an alias of it (a run logging both `val/loss` and `eval_loss` answers with val/loss)."""
    out: dict[str, str] = {}
    for key in keys:
        canon = metric_name(key)
        if canon is None:
            continue
        if canon not in out or key == canon:
            out[canon] = key
    return out


def with_canonical(namespaces: dict[str, Any], hp: dict[str, tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """The namespaces a run is queried by, with its canonical names added beside the logged ones.

    `summary` and `stats` also answer to each metric's canonical name (an `eval_loss` curve is
    found by `summary.val/loss`), and `hparams` holds the canonical hyperparameters found in the
    config (`hparams.lr`, `hparams.seq_len`). What was logged is untouched: this is only what
    queries see."""
    out = dict(namespaces)
    for ns in ("summary", "stats"):
        logged = namespaces.get(ns) or {}
        extra = {canon: logged[key] for canon, key in canonical_metrics(logged).items() if canon not in logged}
        if extra:
            out[ns] = {**logged, **extra}
    out["hparams"] = {name: value for name, (_, value) in hp.items()}
    return out


def canonical_view(config: dict, summary: dict) -> dict[str, dict]:
    """{canonical name: {"key": where the run logged it, "value": ...}}, hyperparameters then
    metrics: what `kb show` prints beside the run as logged."""
    view = {name: {"key": "config." + ".".join(path), "value": value}
            for name, (path, value) in canonical_hparams(config).items()}
    for canon, key in canonical_metrics(summary).items():
        view.setdefault(canon, {"key": f"summary.{key}", "value": summary[key]})
    return view


def column_target(column: str) -> str | None:
    """Where a table column goes: `scale.params`, `summary.<column>`, `config.<column>`, or None.

    Scale quantities take their canonical name (scale has a fixed shape); a metric or a
    hyperparameter keeps the column's own name, and answers to its canonical name in
    queries like any logged key. Scale is tried first (a `tokens` column is data seen, not
    a throughput), then metrics (a final value per row is a summary), then hyperparameters.
    None: the vocabulary does not know the column."""
    f = fold(column)
    if f in TABLE_ONLY:
        return TABLE_ONLY[f]
    if (s := _SCALE.get(f)) is not None:
        return f"scale.{s}"
    if (m := metric_name(column)) is not None and m != "lr":
        return f"summary.{column}"
    if hparam_name(column) is not None:
        return f"config.{column}"
    return None


@lru_cache(maxsize=1 << 14)
def _alias_rank(canon: str, key: str) -> int:
    f = fold(key)
    aliases = [fold(a) for a in HPARAMS[canon]]       # in order of preference
    return aliases.index(f) if f in aliases else len(aliases)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
