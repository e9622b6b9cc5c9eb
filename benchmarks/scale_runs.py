"""The scale benchmark's runs, filters and questions (benchmarks/scale.py): a run history whose
filters select known fractions of it, generated run by run so 100,000 runs never sit in memory.

    from scale_runs import make_run, FILTERS, QUESTIONS
    batch = [make_run(i, points=200) for i in range(1000, 2000)]     # the same runs on every call
    FILTERS["1%"].kb_where(3)     # "config.optim.lr = 0.0004 and config.data.batch_size = 96"

Each run is a point of a sweep: one of 6 model sizes (smaller ones more common, with their
params and tokens), 10 learning rates, 10 batch sizes, 10 warmups, 2 norms and 5 seeds, drawn
independently and uniformly where a filter reads them, so `lr = X` holds for 10% of runs,
`lr = X and batch = Y` for 1%, adding `warmup = Z` for 0.1%, and `norm = 'rmsnorm'` for 50%.
Each run is also tagged with its sweep, ten runs of one project (`tags.lr-sweep-0003 = true`):
a filter whose matches stay ten however long the history grows, where the others' grow with it.
Statuses: mostly completed; diverged runs (more often at high lr) end in NaN with a `diverged`
failure; some failed (oom) or killed. Curves: train/loss with 3/4 of the points, val/loss with
the rest, loss falling towards a floor set by model size and lr.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

LRS = (1e-4, 2e-4, 3e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1.5e-3, 2e-3, 3e-3)
BATCHES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
WARMUPS = (0, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000)
# (label, n_layer, d_model, params), with how often each is trained
MODELS = (("30M", 6, 384, 30_000_000), ("50M", 8, 512, 51_000_000), ("125M", 12, 768, 124_000_000),
          ("350M", 24, 1024, 354_000_000), ("760M", 24, 1536, 757_000_000), ("1.3B", 24, 2048, 1_310_000_000))
MODEL_WEIGHTS = (30, 25, 20, 12, 8, 5)
PROJECTS = ("gpt-small", "gpt-medium", "lr-sweep", "norm-ablation", "warmup-study", "batch-scaling",
            "data-mix", "optim-sweep", "scaling-2025", "long-ctx", "distill", "tokenizer")
SWEEP_RUNS = 10                                # runs a sweep tag holds
SWEEP_BLOCK = len(PROJECTS) * SWEEP_RUNS       # consecutive runs holding one sweep of each project
TOTAL_STEPS = 20_000


def make_run(i: int, points: int = 200) -> dict:
    """Run number i: the same record every time (its own random stream), `points` curve points."""
    rng = random.Random(i)
    label, n_layer, d_model, params = rng.choices(MODELS, MODEL_WEIGHTS)[0]
    lr, batch, warmup = rng.choice(LRS), rng.choice(BATCHES), rng.choice(WARMUPS)
    norm, seed = rng.choice(("layernorm", "rmsnorm")), rng.randrange(5)
    config = {"model": {"n_layer": n_layer, "d_model": d_model, "n_head": d_model // 64, "norm": norm,
                        "dropout": 0.0, "vocab_size": 50304, "block_size": 1024},
              "optim": {"name": "adamw", "lr": lr, "beta2": 0.95, "weight_decay": 0.1, "warmup": warmup,
                        "grad_clip": 1.0},
              "data": {"batch_size": batch, "mix": rng.choice(("web", "web+code", "web+code+math"))},
              "seed": seed, "schedule": "cosine", "precision": "bf16"}
    floor = (1.7 + 400 / params ** 0.3 + 0.12 * math.log10(lr / 6e-4) ** 2 + (0.02 if norm == "layernorm" else 0)
             + 0.03 * (warmup == 0) + rng.gauss(0, 0.02))
    roll, diverges = rng.random(), 0.01 + (0.15 if lr >= 2e-3 else 0)
    status = ("diverged" if roll < diverges else "failed" if roll < diverges + 0.04 else
              "killed" if roll < diverges + 0.06 else "completed")
    n_val = max(1, points // 4)
    n_train = points - n_val
    diverge_at = rng.uniform(0.3, 0.9) * TOTAL_STEPS if status == "diverged" else None
    metrics = {"train/loss": _curve(rng, floor, n_train, 0.01, diverge_at, i),
               "val/loss": _curve(rng, floor + 0.03, n_val, 0.004, diverge_at, i)}
    run = {"id": f"scale-{i:07d}", "project": PROJECTS[i % len(PROJECTS)],
           "name": f"{label}-lr{lr:g}-b{batch}-w{warmup}-{norm}-s{seed}-{i}", "status": status, "config": config,
           "scale": {"params": params, "tokens": params * rng.choice((10, 20, 40)), "gpus": rng.choice((8, 16, 64))},
           "metrics": metrics, "summary": {"tokens_per_s": round(rng.uniform(2e5, 2e6) / (params / 1e8), 1)},
           "tags": [sweep_tag(i)] + (["baseline"] if seed == 0 and rng.random() < 0.1 else [])}
    if status == "diverged":
        run["failure"] = {"kind": "diverged", "step": int(diverge_at), "message": "loss is NaN"}
    elif status == "failed":
        run["failure"] = {"kind": "oom", "step": rng.randrange(TOTAL_STEPS), "message": "CUDA out of memory"}
    return run


def sweep_tag(i: int) -> str:
    """Run i's sweep: the runs of its project in the same SWEEP_BLOCK."""
    return f"{PROJECTS[i % len(PROJECTS)]}-{i // SWEEP_BLOCK:04d}"


def _curve(rng: random.Random, floor: float, n: int, noise: float, diverge_at: float | None, i: int) -> list:
    stride = TOTAL_STEPS // n
    tail = (1 + TOTAL_STEPS / 200) ** -0.7
    out = []
    for p in range(1, n + 1):
        step = p * stride
        if diverge_at is not None and step > diverge_at:
            value = math.nan
        else:
            value = round(floor + 8.0 * ((1 + step / 200) ** -0.7 - tail) + rng.gauss(0, noise), 5)
        out.append([step, value, 1.7e9 + i * 3600 + step * 0.2])
    return out


@dataclass(frozen=True)
class Filter:
    """A conjunction of config equalities over value lists; repeat r takes the r-th combination,
    so repeats ask different questions of the same selectivity."""
    fraction: float
    keys: tuple[tuple[str, tuple], ...]

    def values(self, r: int) -> list:
        return [vals[(r * (7 ** j)) % len(vals)] for j, (_, vals) in enumerate(self.keys)]

    def kb_where(self, r: int) -> str:
        return " and ".join(f"config.{k} = {_literal(v)}" for (k, _), v in zip(self.keys, self.values(r)))

    def mlflow_filter(self, r: int) -> str:
        return " and ".join(f"params.`{k}` = '{v}'" for (k, _), v in zip(self.keys, self.values(r)))


@dataclass(frozen=True)
class SweepFilter:
    """One sweep's tag: SWEEP_RUNS matches at every size. Repeat r takes one of the sweeps that
    are whole in the first `whole_blocks` blocks (4 blocks of 120 runs: whole at 500 runs)."""
    whole_blocks: int = 4

    def tag(self, r: int) -> str:
        block = (r * 3) % self.whole_blocks
        return sweep_tag(block * SWEEP_BLOCK + (r * 5) % len(PROJECTS))

    def kb_where(self, r: int) -> str:
        return f"tags.{self.tag(r)} = true"

    def mlflow_filter(self, r: int) -> str:
        return f"tags.`{self.tag(r)}` = 'true'"


def _literal(v) -> str:
    return f"'{v}'" if isinstance(v, str) else repr(v)


FILTERS = {
    "10 runs": SweepFilter(),
    "0.1%": Filter(0.001, (("optim.lr", LRS), ("data.batch_size", BATCHES), ("optim.warmup", WARMUPS))),
    "1%": Filter(0.01, (("optim.lr", LRS), ("data.batch_size", BATCHES))),
    "10%": Filter(0.1, (("optim.lr", LRS),)),
    "50%": Filter(0.5, (("model.norm", ("rmsnorm", "layernorm")),)),
}
SORT = "summary.val/loss"
MLFLOW_ORDER = "metrics.`val/loss` ASC"
LIMIT = 20

# quantitative questions the planner answers from SQL (no LLM)
QUESTIONS = ("How many runs diverged?",
             "Which learning rate gave the lowest val loss for the 125M runs?",
             "What is the mean val loss by learning rate at 350M?",
             "How many runs used rmsnorm?",
             "Which learning rates diverged at 1.3B?")
