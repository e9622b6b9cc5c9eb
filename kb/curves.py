"""What a curve says: summary statistics and anomalies (spikes, divergence, plateaus), found on ingest."""
from __future__ import annotations

import math
from typing import Sequence

Point = Sequence   # (step, value) or (step, value, wall_time); value None means NaN


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def curve_stats(metrics: dict[str, list[Point]]) -> dict[str, dict]:
    """Per metric: final value, best (lowest for losses, highest otherwise), its step, and extent."""
    stats = {}
    for key, points in metrics.items():
        if not points:
            continue
        pts = sorted(points, key=lambda p: p[0])
        finite = [(p[0], p[1]) for p in pts if _finite(p[1])]
        s = {"points": len(pts), "first_step": pts[0][0], "last_step": pts[-1][0]}
        last = pts[-1][1]
        s["final"] = last if _finite(last) else None
        s["nonfinite"] = len(pts) - len(finite)
        if finite:
            lower_is_better = not any(w in key.lower() for w in ("acc", "accuracy", "score", "throughput", "mfu", "tokens_per", "lr"))
            pick = min if lower_is_better else max
            best_step, best = pick(finite, key=lambda sv: sv[1])
            s.update(best=best, best_step=best_step)
        stats[key] = s
    return stats
