"""TrainConfig: everything a proxy training needs, read from a spec's config and resolved.

    cfg = TrainConfig.from_dict({"n_layer": 4, "optim": {"learning_rate": 1e-3},
                                 "data": {"mixture": {"prose": 0.7, "code": 0.3}}})
    cfg = cfg.resolved()            # derived values filled in: d_model 256, n_head 4, lr, min_lr, ...
    cfg.to_config()                 # the run record's config: canonical keys, data nested

Keys are the options of runner/options.py. A nested config reads like a flat one (`optim.lr`
and `lr` are the same option: the last segment names it) and a key a tracker spells otherwise
answers to its kb.vocab name (`learning_rate`, `n_embd`, `block_size`). `data.mixture.web`
and `{"data": {"mixture": {"web": ...}}}` are one weight. An unknown key or a value out of
range is an InvalidRecord naming the key.

One dial sizes the model (nanochat's depth): d_model = 64 x n_layer, one head per 64
channels, and a peak lr that falls as 1/sqrt(d_model) from LR_REF at D_REF (the width
scaling AdamW needs when nothing else, such as muP, absorbs it).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kb.errors import InvalidRecord
from kb.vocab import hparam_name
from runner.model import GPTConfig
from runner.options import RUNNER_OPTIONS, RUNTIME_OPTIONS

LR_REF, D_REF = 2e-3, 256       # near the best of a sweep at depth 2 on the built-in corpus (1e-3 .. 1.6e-2)
DEFAULT_MIXTURE = {"prose": 0.5, "code": 0.5}
CHOICES = {
    "pos": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"), "norm_position": ("pre", "post"),
    "activation": ("gelu", "swiglu", "relu2"), "optimizer": ("adamw", "muon"),
    "schedule": ("cosine", "linear", "wsd"),
}
RECORD_KEYS = ("project", "name")
MIXTURE_TOLERANCE = 0.01      # as kb.mixture reads weights: two decimals (0.33 x 3) sum to 1


@dataclass(frozen=True)
class TrainConfig:
    # model: the size dial and the architecture options
    n_layer: int = 4
    d_model: int = 0                       # 0: derived from n_layer
    n_head: int = 0
    n_kv_head: int = 0
    vocab_size: int = 256
    pos: str = "learned"
    norm: str = "layernorm"
    norm_position: str = "pre"
    activation: str = "gelu"
    qk_norm: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    # optimisation
    optimizer: str = "adamw"
    lr: float | None = None                # None: derived from d_model
    min_lr: float | None = None            # None: lr / 10
    warmup_steps: int | None = None        # None: a tenth of max_steps, at most 100
    schedule: str = "cosine"
    decay_frac: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    batch_size: int = 32
    micro_batch_size: int | None = None
    seq_len: int = 256
    max_steps: int = 200
    max_tokens: int = 0
    max_seconds: float = 0.0
    seed: int = 0
    # evaluation and failure
    eval_interval: int = 50
    eval_batches: int = 4
    divergence_factor: float = 3.0
    # data
    data_mixture: dict = field(default_factory=dict)      # empty: DEFAULT_MIXTURE or uniform
    data_sources: dict = field(default_factory=dict)
    # runtime (meta, not config)
    device: str = "auto"
    compile: bool | None = None
    threads: int = 0
    checkpoint_interval: int = 100
    # the record
    project: str = "proxy"
    name: str | None = None

    # ---- reading ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict, *, ignore_unknown: bool = False) -> "TrainConfig":
        """A config from a spec (flat or nested); unknown keys are an error unless ignore_unknown."""
        if not isinstance(data, dict):
            raise InvalidRecord(f"a training config is an object of options, not {type(data).__name__}",
                                field="config")
        values: dict[str, tuple[str, Any]] = {}
        mixture: dict[str, Any] = {}
        sources: dict[str, Any] = {}

        def put(option: str, where: str, value: Any) -> None:
            if option in values and values[option][1] != value:
                raise InvalidRecord(f"set twice, to {values[option][1]!r} at {values[option][0]} and "
                                    f"{value!r}", field=where)
            values[option] = (where, value)

        def visit(prefix: tuple[str, ...], node: dict) -> None:
            for key, value in node.items():
                path = prefix + tuple(str(key).split("."))
                dotted = ".".join(path)
                if dotted in ("data.mixture", "data.sources"):
                    if not isinstance(value, dict):
                        raise InvalidRecord(f"an object of {{source: ...}}, not {value!r}", field=dotted)
                    (mixture if dotted == "data.mixture" else sources).update(value)
                elif dotted.startswith("data.mixture."):
                    mixture[dotted[len("data.mixture."):]] = value
                elif dotted.startswith("data.sources."):
                    sources[dotted[len("data.sources."):]] = value
                elif isinstance(value, dict):
                    visit(path, value)
                else:
                    option = _option(path)
                    if option:
                        put(option, dotted, value)
                    elif not ignore_unknown:
                        known = sorted({*RUNNER_OPTIONS, *RUNTIME_OPTIONS, *RECORD_KEYS})
                        raise InvalidRecord(f"unknown option; the runner knows {', '.join(known)}",
                                            field=dotted)

        visit((), data)
        kwargs = {name: _checked(name, where, value) for name, (where, value) in values.items()}
        if mixture:
            kwargs["data_mixture"] = _checked_mixture(mixture)
        if sources:
            kwargs["data_sources"] = dict(sources)
        return cls(**kwargs)

    # ---- resolving ----------------------------------------------------------------------------

    def model_config(self) -> GPTConfig:
        try:
            return GPTConfig(n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head,
                             n_kv_head=self.n_kv_head, vocab_size=self.vocab_size, seq_len=self.seq_len,
                             pos=self.pos, norm=self.norm, norm_position=self.norm_position,
                             activation=self.activation, qk_norm=self.qk_norm,
                             tie_embeddings=self.tie_embeddings, dropout=self.dropout)
        except ValueError as exc:
            raise InvalidRecord(str(exc), field="n_head") from None

    def resolved(self) -> "TrainConfig":
        """Every derived value filled in: what the run really used, and what its record stores."""
        m = self.model_config()
        lr = self.lr if self.lr is not None else LR_REF * math.sqrt(D_REF / m.d_model)
        min_lr = self.min_lr if self.min_lr is not None else lr / 10
        if min_lr > lr:
            raise InvalidRecord(f"min_lr {min_lr:g} is above the peak lr {lr:g}", field="min_lr")
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise InvalidRecord(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {micro}",
                                field="micro_batch_size")
        if self.data_mixture:
            mixture = dict(self.data_mixture)
        elif self.data_sources:
            mixture = {name: 1 / len(self.data_sources) for name in self.data_sources}
        else:
            mixture = dict(DEFAULT_MIXTURE)
        return replace(
            self, d_model=m.d_model, n_head=m.n_head, n_kv_head=m.n_kv_head, lr=lr, min_lr=min_lr,
            warmup_steps=self.warmup_steps if self.warmup_steps is not None else min(100, self.max_steps // 10),
            micro_batch_size=micro, data_mixture=mixture,
            name=self.name or f"proxy-d{self.n_layer}-s{self.seed}")

    def with_depth(self, n_layer: int) -> "TrainConfig":
        """This config at another depth (`kb submit --scales`). What followed the depth rule here
        (width, heads, lr, min_lr: equal to what this depth derives) follows it at the new depth;
        what was set apart from the rule stays as set."""
        rule = replace(self, d_model=0, n_head=0, n_kv_head=0, lr=None, min_lr=None).resolved()
        mine = self.resolved()
        keep = {k: getattr(self, k) for k in ("d_model", "n_head", "n_kv_head", "lr", "min_lr")
                if getattr(mine, k) != getattr(rule, k)}
        if "lr" in keep and "min_lr" not in keep and math.isclose(mine.min_lr, mine.lr / 10):
            keep["min_lr"] = None          # the default ratio to a fixed lr stays the ratio
        base = {"d_model": 0, "n_head": 0, "n_kv_head": 0, "lr": None, "min_lr": None}
        return replace(self, n_layer=_checked("n_layer", "n_layer", n_layer), name=None, **{**base, **keep})

    def to_config(self, source_origins: dict[str, str] | None = None) -> dict:
        """The run record's config: every option by its canonical name, data nested."""
        flat = asdict(self)
        out = {k: v for k, v in flat.items()
               if k in RUNNER_OPTIONS and v is not None}
        out["data"] = {"mixture": dict(self.data_mixture),
                       "sources": dict(source_origins or self.data_sources)}
        return out

    def runtime(self) -> dict:
        return {k: getattr(self, k) for k in RUNTIME_OPTIONS}

    def same_experiment(self, other: dict) -> bool:
        """Whether a checkpoint's stored config is this one's (the data's paths aside)."""
        def strip(config: dict) -> dict:
            data = config.get("data")
            mixture = data.get("mixture") if isinstance(data, dict) else None
            return {k: v for k, v in config.items() if k != "data"} | {"mixture": mixture}
        # a run from elsewhere may name no data at all: it is then no proxy run of this experiment
        return strip(self.to_config()) == strip(other)


def _option(path: tuple[str, ...]) -> str | None:
    """The TrainConfig field a config key sets, by its last segment (or the whole for data.*)."""
    last = path[-1]
    if last in RECORD_KEYS and len(path) == 1:
        return last
    for name in (last, hparam_name(last)):
        if name and (name in RUNNER_OPTIONS or name in RUNTIME_OPTIONS) and not name.startswith("data."):
            return name
    return None


INT_MIN = {"n_layer": 1, "d_model": 0, "n_head": 0, "n_kv_head": 0, "vocab_size": 2, "warmup_steps": 0,
           "batch_size": 1, "micro_batch_size": 1, "seq_len": 2, "max_steps": 1, "max_tokens": 0,
           "seed": 0, "eval_interval": 1, "eval_batches": 1, "threads": 0, "checkpoint_interval": 0}
FLOAT_RANGE = {  # name: the interval a value must lie in, as it reads
    "lr": "(0, inf)", "min_lr": "[0, inf)", "dropout": "[0, 1)", "weight_decay": "[0, inf)",
    "beta1": "[0, 1)", "beta2": "[0, 1)", "grad_clip": "[0, inf)", "max_seconds": "[0, inf)",
    "divergence_factor": "(1, inf)", "decay_frac": "(0, 1]"}
BOOLS = ("qk_norm", "tie_embeddings", "compile")


def _checked(name: str, where: str, value: Any) -> Any:
    if name in RECORD_KEYS or name == "device":
        if not isinstance(value, str) or not value.strip():
            raise InvalidRecord(f"{value!r} is not a non-empty string", field=where)
        return value
    if name in CHOICES:
        if value not in CHOICES[name]:
            raise InvalidRecord(f"{value!r} is not one of {', '.join(CHOICES[name])}", field=where)
        return value
    if name in BOOLS:
        if not isinstance(value, bool):
            raise InvalidRecord(f"{value!r} is not true or false", field=where)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRecord(f"{value!r} is not a finite number", field=where)
    if name in INT_MIN:
        if value != int(value):
            raise InvalidRecord(f"{value!r} is not a whole number", field=where)
        if value < INT_MIN[name]:
            raise InvalidRecord(f"{value!r} is below {INT_MIN[name]}", field=where)
        if name == "vocab_size" and value > 2**16:
            raise InvalidRecord(f"{value} is above 65536, the most a uint16 .bin shard holds", field=where)
        return int(value)
    interval = FLOAT_RANGE[name]
    low, high = (float(x) for x in interval[1:-1].split(", "))
    below = value < low or (value == low and interval[0] == "(")
    above = value > high or (value == high and interval[-1] == ")")
    if below or above:
        raise InvalidRecord(f"{value!r} is outside {interval}", field=where)
    return float(value)


def _checked_mixture(mixture: dict) -> dict[str, float]:
    for source, w in mixture.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise InvalidRecord(f"weight {w!r} is not a number >= 0", field=f"data.mixture.{source}")
    total = sum(mixture.values())
    if abs(total - 1) > MIXTURE_TOLERANCE:
        raise InvalidRecord(f"weights sum to {total:g}, not 1", field="data.mixture")
    return {source: float(w) / total for source, w in mixture.items()}
