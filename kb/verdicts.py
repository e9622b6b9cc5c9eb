"""Noise-aware verdicts: does a change beat its baseline by more than its seeds disagree?

    v = compare(k, "base-s0", "rms-s0")          # a run id stands for its seed group
    v.outcome, v.delta, v.interval                # "better" | "worse" | "inconclusive"
    t = transfer(k, base_ids, variant_ids, target=1e9)    # proxy scales -> a verdict at 1e9
    ps = patterns(k)                              # one factor ablated in several projects

Seed noise comes from the store: runs of one project whose configs differ only in seed keys are
one configuration measured several times (kb.ablations.group_runs), and their spread is what a
difference has to clear. When both sides have two or more seeds, Welch's t interval on their own
seeds; when a side has one, the project's pooled seed standard deviation (every seed group of
the project, kb.ablations.pooled_sd) with a t interval on its degrees of freedom. A variant is
better or worse only when the interval at `level` excludes zero; which method, and which seed
groups, is in the verdict. Scale transfer (kb.transfer) and patterns across ablations
(kb.patterns) judge effects against the same noise.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from kb.errors import InsufficientData, NotFound, QueryError
from kb.models import RunPublic
from kb.noise import (Noise, check_level, higher_is_better, judge, metric_value, read_runs, seed_groups, seed_noise,
                      t_quantile)

@dataclass(frozen=True)
class Verdict:
    outcome: str                    # better | worse | inconclusive (the variant, against the baseline)
    metric: str
    higher_is_better: bool
    delta: float                    # variant mean - baseline mean
    interval: tuple[float, float]   # of delta, at `level`
    level: float
    method: str                     # "welch-t" (each side's own seeds) | "pooled-t" (project pool)
    noise: Noise
    baseline: dict                  # {"mean", "n", "runs"}
    variant: dict
    without_metric: tuple[str, ...] = ()    # named runs with no final value (diverged), left out

    @property
    def evidence(self) -> list[str]:
        return self.baseline["runs"] + self.variant["runs"]

    def to_json(self) -> dict:
        return {"outcome": self.outcome, "metric": self.metric, "higher_is_better": self.higher_is_better,
                "delta": self.delta, "interval": list(self.interval), "level": self.level,
                "method": self.method, "noise": self.noise.to_json(), "baseline": self.baseline,
                "variant": self.variant, "evidence": self.evidence, "without_metric": list(self.without_metric)}


def compare(source, baseline: str | Sequence[str], variant: str | Sequence[str], metric: str = "val/loss",
            level: float = 0.95, *, higher: bool | None = None) -> Verdict:
    """Is `variant` better than `baseline` on `metric` by more than seed noise, at `level`?

    Each side is a run id (standing for its seed group: the project's runs equal to it but for
    seed keys) or a list of run ids (exactly those). `higher` overrides the metric's direction
    (higher_is_better). Runs without a final value are left out and listed in the verdict."""
    check_level(level)
    up = higher_is_better(metric) if higher is None else higher
    cache: dict[str, list] = {}
    base_runs = _side(source, baseline, "baseline", metric, cache)
    var_runs = _side(source, variant, "variant", metric, cache)
    both = sorted({r.id for r in base_runs} & {r.id for r in var_runs})
    if both:
        raise QueryError(f"runs on both sides of the comparison: {', '.join(both)}")
    (b_ids, b), (v_ids, v) = _values(base_runs, metric, "baseline"), _values(var_runs, metric, "variant")
    missing = tuple(r.id for r in base_runs + var_runs if r.id not in set(b_ids) | set(v_ids))
    mb, mv = math.fsum(b) / len(b), math.fsum(v) / len(v)
    delta = mv - mb
    noise, se, method = None, 0.0, "welch-t"
    if len(b) >= 2 and len(v) >= 2:
        vb, vv = statistics.variance(b) / len(b), statistics.variance(v) / len(v)
        if vb + vv > 0:
            se = math.sqrt(vb + vv)
            dof = (vb + vv) ** 2 / (vb ** 2 / (len(b) - 1) + vv ** 2 / (len(v) - 1))
            sd = math.sqrt((statistics.variance(b) * (len(b) - 1) + statistics.variance(v) * (len(v) - 1))
                           / (len(b) + len(v) - 2))
            noise = Noise(sd, dof, "own seeds", (tuple(b_ids), tuple(v_ids)))
    if noise is None:       # a side with one seed (or seeds that agree exactly): the project's pool
        noise = seed_noise(source, {r.project for r in base_runs + var_runs}, metric)
        se, method = noise.sd * math.sqrt(1 / len(b) + 1 / len(v)), "pooled-t"
    half = t_quantile(level, noise.dof) * se
    low, high = delta - half, delta + half
    return Verdict(judge(delta, low, high, up), metric, up, delta, (low, high), level, method, noise,
                   {"mean": mb, "n": len(b), "runs": b_ids}, {"mean": mv, "n": len(v), "runs": v_ids}, missing)


def _side(source, ref, role: str, metric: str, cache: dict) -> list[RunPublic]:
    if isinstance(ref, str):
        found = read_runs(source, ids=[ref])
        if not found:
            raise NotFound(f"{role}: no run {ref!r}")
        project = found[0].project
        if project not in cache:
            cache[project] = read_runs(source, project=project)
        group = next(g for g in seed_groups(cache[project], project, metric) if any(r.id == ref for r in g.runs))
        ids = {r.id for r in group.runs}
        return [r for r in cache[project] if r.id in ids]
    ids = list(dict.fromkeys(ref))
    if not ids:
        raise QueryError(f"{role}: no runs given")
    runs = read_runs(source, ids=ids)
    missing = sorted(set(ids) - {r.id for r in runs})
    if missing:
        raise NotFound(f"{role}: no run {', '.join(map(repr, missing))}")
    return runs


def _values(runs: list, metric: str, role: str) -> tuple[list[str], list[float]]:
    pairs = [(r.id, v) for r in runs if (v := metric_value(r, metric)) is not None]
    if not pairs:
        raise InsufficientData(f"{role} has no final {metric}: runs {', '.join(r.id for r in runs)}")
    return [i for i, _ in pairs], [v for _, v in pairs]


# the other two judgements, against the same noise, importable from here too
from kb.patterns import Pattern, patterns          # noqa: E402
from kb.transfer import Transfer, transfer         # noqa: E402

__all__ = ["Noise", "Pattern", "Transfer", "Verdict", "compare", "higher_is_better", "metric_value",
           "patterns", "read_runs", "seed_groups", "seed_noise", "transfer"]
