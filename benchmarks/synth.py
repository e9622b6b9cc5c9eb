"""Generated run histories for the benchmarks: the same records go to pretrain-kb and to MLflow.

Each run has ~20 hyperparameters (nested, as a real config is) and `curves` loss-like
curves of `points` points; lrs come from a small grid so "best run at lr X" is a real query.
"""
from __future__ import annotations

import math
import random

LRS = (1e-4, 2e-4, 3e-4, 6e-4, 1e-3, 2e-3, 3e-3)


def make_runs(n: int, curves: int = 3, points: int = 200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    runs = []
    for i in range(n):
        lr = rng.choice(LRS)
        width = rng.choice((256, 384, 512, 768))
        config = {
            "model": {"n_layer": rng.choice((4, 6, 8, 12)), "d_model": width, "n_head": width // 64,
                      "norm": rng.choice(("layernorm", "rmsnorm")), "dropout": 0.0, "bias": False,
                      "vocab_size": 50304, "block_size": 1024},
            "optim": {"name": "adamw", "lr": lr, "beta1": 0.9, "beta2": rng.choice((0.95, 0.99)),
                      "weight_decay": 0.1, "warmup": rng.choice((100, 500, 1000)), "grad_clip": 1.0},
            "data": {"batch_size": rng.choice((128, 256, 512)), "mix": rng.choice(("web", "web+code"))},
            "seed": i % 5, "schedule": "cosine", "precision": "bf16",
        }
        floor = 2.8 + 0.3 * abs(math.log10(lr / 6e-4)) + rng.gauss(0, 0.05)
        metrics = {}
        for c in range(curves):
            key = ("train/loss", "val_loss", "grad_norm")[c] if c < 3 else f"metric_{c}"
            pts = []
            for p in range(points):
                step = p * 10
                v = floor + 7.0 / (1 + step / 50) ** 0.7 + rng.gauss(0, 0.01) if key != "grad_norm" \
                    else 0.5 + rng.random()
                pts.append([step, round(v, 6), 1.7e9 + i * 100 + p])
            metrics[key] = pts
        runs.append({"id": f"run-{i:06d}", "project": "bench", "name": f"run {i}", "config": config,
                     "metrics": metrics, "status": "completed"})
    return runs


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """MLflow params: flat, dotted, stringified (what a team logging to MLflow would write)."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_params(v, key + "."))
        else:
            out[key] = str(v)
    return out
