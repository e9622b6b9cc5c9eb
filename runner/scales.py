"""Training configs at the scales a plan names: a run's config read back as a TrainConfig, the
model's parameter count, and the same experiment at another depth.

    cfg = train_config(run.config)          # a proxy run's stored config, runnable again
    depth_for(cfg, 2e6)                     # the n_layer whose model is nearest 2M parameters
    at_depth(cfg, 4)                        # the same experiment 4 blocks deep

A scale is a parameter count, as plans and runs' `scale.params` hold it; it runs at the depth
(n_layer, the runner's one size dial) whose model is nearest to it in log-parameters. At another
depth, what followed the runner's depth rule (width, heads, lr, min_lr) follows it there, and what
a config or a hypothesis set apart from it stays as set (TrainConfig.with_depth): a hypothesis that
sets lr 3e-3 is checked at lr 3e-3 at every scale, against a baseline whose lr follows the rule.
"""
from __future__ import annotations

import math
from dataclasses import replace

from kb.errors import InvalidRecord

MAX_DEPTH = 64


def train_config(config: dict, *, strict: bool = True):
    """A TrainConfig from a job's or a run's config. A run's config names its built-in sources as
    `builtin:<name>` and several shards as one comma-joined string: both read back as they were given."""
    from runner.config import TrainConfig
    config = dict(config)
    data = config.get("data")
    if isinstance(data, dict) and isinstance(data.get("sources"), dict):
        sources = {}
        for name, origin in data["sources"].items():
            if origin == f"builtin:{name}":
                continue
            sources[name] = origin.split(", ") if isinstance(origin, str) and ", " in origin else origin
        config["data"] = dict(data, sources=sources)
    return TrainConfig.from_dict(config, ignore_unknown=not strict)


def spec_config(cfg) -> dict:
    """What a job stores: the resolved options (its record's config, data paths as given) and the
    runtime ones (device, threads, checkpoint interval), which its record keeps in meta."""
    out = cfg.resolved().to_config()
    out["data"]["sources"] = dict(cfg.data_sources)
    return out | {k: v for k, v in cfg.runtime().items() if v is not None}


def params_of(cfg) -> int:
    """Parameters of the model a config builds (as the run's scale.params counts them), built on the
    meta device: no memory, no initialisation time."""
    import torch
    from runner.model import GPT
    with torch.device("meta"):
        return GPT(cfg.resolved().model_config()).num_params()


UNSET = {"d_model": 0, "n_head": 0, "n_kv_head": 0, "lr": None, "min_lr": None, "warmup_steps": None,
         "micro_batch_size": None}          # the options the runner derives when they are not given


def with_change(base, changed):
    """`changed` (the baseline's config with a hypothesis's change applied) with the options the
    baseline left to the runner's defaults derived again: a run's config stores every value
    resolved, so a baseline swept in lr stores min_lr = lr / 10, and a change of lr alone moves
    min_lr with it, as the sweep the proposal learned from did. An option the change sets, or
    one the baseline set to something else than its default, stays as it is."""
    base = base.resolved()
    unset = {}
    for key, sentinel in UNSET.items():
        default = getattr(replace(base, **{key: sentinel}).resolved(), key)
        if getattr(base, key) == default and getattr(changed, key) == getattr(base, key):
            unset[key] = sentinel
    return replace(changed, **unset).resolved()


def at_depth(cfg, depth: int):
    """The same experiment at another depth, resolved (TrainConfig.with_depth: what followed the
    depth rule follows it there, what was set apart stays as set)."""
    return cfg.resolved() if depth == cfg.n_layer else cfg.with_depth(depth).resolved()


def depth_for(cfg, params: float) -> int:
    """The depth whose model is nearest `params` in log-parameters."""
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params > 0):
        raise InvalidRecord(f"a scale is a positive parameter count, not {params!r}", field="scales")
    best, best_gap = 1, math.inf
    for depth in range(1, MAX_DEPTH + 1):
        n = params_of(at_depth(cfg, depth))
        gap = abs(math.log(n / params))
        if gap < best_gap:
            best, best_gap = depth, gap
        if n > params:
            break
    return best


def parse_scales(text: str | None) -> list[float] | None:
    """`--scales 2e5,1e6` -> [200000.0, 1000000.0]."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise InvalidRecord(f"{part.strip()!r} is not a parameter count (like 2e5)", field="scales") from None
        if not math.isfinite(value) or value <= 0:
            raise InvalidRecord(f"{part.strip()!r} is not a positive parameter count", field="scales")
        out.append(value)
    return out
