"""A synthetic pretraining history for the agent's tests (tests/test_agent.py): learning-rate sweeps
at two scales, a divergence, a loss spike, a norm ablation with seeds, and a postmortem note,
written as the files a team would have (native JSONL + Markdown) and ingested through the real path.

    files = example_history(tmp_path / "history")      # [runs.jsonl, postmortem-lr-3e-3.md]

`kb demo` shows a history the proxy trainer really trained (runner/demo_history.py); this one
stays for the tests, whose questions name its ids (small-lr0.003, base-lr0.001, gpt-sweep).

The curves are generated from a Chinchilla-style loss model, L(t) = E + A / t^a, with the
learning rate moving the constant and the too-high rates blowing up; every run is tagged
`example` so nobody mistakes it for a measurement.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

SCALES = {"small": {"n_layer": 6, "d_model": 384, "n_head": 6},
          "base": {"n_layer": 12, "d_model": 768, "n_head": 12}}
LRS = (1e-4, 3e-4, 6e-4, 1e-3, 3e-3)
STEPS, EVERY = 2000, 20


def _curve(rng, lr: float, width: int, steps: int = STEPS, diverge_at: int | None = None,
           spike_at: int | None = None, offset: float = 0.0) -> list[list]:
    best_lr = 6e-4 * (384 / width)            # wider models want smaller rates (muP-ish)
    miss = abs(math.log10(lr / best_lr))
    floor = 2.9 - 0.25 * math.log2(width / 384) + 0.35 * miss**2 + offset
    pts = []
    for step in range(0, steps + 1, EVERY):
        loss = floor + 8.0 / (1 + step / 60) ** 0.7 + rng.normal(0, 0.015)
        if spike_at and spike_at <= step < spike_at + 3 * EVERY:
            loss += 2.5
        if diverge_at and step >= diverge_at:
            loss = float("nan")
        pts.append([step, round(loss, 5) if loss == loss else loss])
    return pts


def example_history(folder: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for scale, model in SCALES.items():
        params = 12 * model["n_layer"] * model["d_model"] ** 2 + 50304 * model["d_model"]
        for lr in LRS:
            diverge = 1200 if lr >= 3e-3 else None
            spike = 900 if (scale == "base" and lr == 1e-3) else None
            train = _curve(rng, lr, model["d_model"], diverge_at=diverge, spike_at=spike)
            val = [[s, v + 0.04 if v == v else v] for s, v in train[::5]]
            rec = {"id": f"{scale}-lr{lr:g}", "project": "gpt-sweep", "name": f"{scale} lr={lr:g}",
                   "config": {"model": model | {"norm": "layernorm", "vocab_size": 50304},
                              "optim": {"name": "adamw", "lr": lr, "beta2": 0.95, "warmup": 100},
                              "data": {"batch_size": 256, "block_size": 1024}},
                   "scale": {"params": params},
                   "metrics": {"train/loss": train, "val/loss": val},
                   "tags": ["example", "lr-sweep", "baseline"] if lr == 6e-4 else ["example", "lr-sweep"]}
            if diverge:
                rec["notes"] = "loss went NaN shortly after warmup; grad norm exploded first"
            records.append(rec)
    for norm, offset in (("layernorm", 0.0), ("rmsnorm", -0.03)):
        for seed in range(3):
            rec = {"id": f"small-{norm}-s{seed}", "project": "gpt-norm", "name": f"small {norm} seed {seed}",
                   "config": {"model": SCALES["small"] | {"norm": norm}, "optim": {"lr": 6e-4}, "seed": seed},
                   "metrics": {"train/loss": _curve(rng, 6e-4, 384, offset=offset + rng.normal(0, 0.004))},
                   "tags": ["example", "ablation:norm"]}
            records.append(rec)
    runs = folder / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in records))
    note = folder / "postmortem-lr-3e-3.md"
    note.write_text(POSTMORTEM)
    return [runs, note]


POSTMORTEM = """# Postmortem: lr=3e-3 divergence in the gpt-sweep

## What happened
Both `small-lr0.003` and `base-lr0.003` went NaN at step 1200, right after warmup ended.
The gradient norm climbed for ~100 steps before the loss blew up.

## Why we think so
At 3e-3 the update size exceeded what AdamW with beta2=0.95 tolerates at this width.
`base-lr0.001` also showed a loss spike at step 900 but recovered.

## What we changed
Sweeps now cap lr at 1e-3 for the base model and add gradient clipping at 1.0.
"""
