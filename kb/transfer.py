"""Scale transfer: a gain measured at proxy scales, judged at a target scale.

    t = transfer(k, baseline=[ids at 1e7, 3e7, 1e8], variant=[...], target=1e9)
    t.outcome, t.delta, t.interval     # holds | grows | shrinks | vanishes | reverses | inconclusive

Baseline and variant are each measured at two or more proxy scales (seeds at a scale averaged);
at every scale both were run at, the gain is variant - baseline. The gain is fitted with a
one-variable power law in scale, delta(X) = c·(X/X_ref)^γ (γ = 0: it holds; γ < 0: it shrinks
toward zero; γ > 0: it grows), and evaluated at the target. Only when the proxy gains already
change sign beyond their noise is a trend that can cross zero fitted instead,
delta(X) = u + v·ln(X/X_ref).

Why the gain and not each side: power laws fitted to each side and differenced extrapolate a
shrinking gain as a reversal (two straight lines in log-log always cross: on losses
1.8 + 20·N^-0.25 with a gain of 0.3·(N/1e6)^-0.5 measured at 1e6-1e7, such fits put the variant
0.08 worse at 1e8 where it is 0.03 better), and an offset law E + A·X^-α per side needs more
scales than proxies usually have, and fares little better from four.

The interval is a parametric bootstrap over the points: each side's mean at each scale is drawn
around its value with the project's pooled seed noise (kb.noise.seed_noise; every seed group
there, these points' own included) for its number of seeds, t-distributed on the pool's degrees
of freedom (a resample of two seeds says little about their spread), and the gain law is refitted
for every draw. The outcome sets the target interval against the gain at the largest proxy scale:
    reverses      excludes zero, and the gain has the opposite sign to the proxy's
    vanishes      includes zero but not the proxy gain; or excludes it and is smaller than one
                  run's seed noise (there, a run could not tell it from noise)
    inconclusive  includes both: too uncertain at that distance to say
    holds         excludes zero, includes the proxy gain
    grows/shrinks excludes both; larger / smaller in magnitude than the proxy gain
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kb.errors import InsufficientData, NotFound, QueryError
from kb.noise import Noise, check_level, higher_is_better, judge, metric_value, read_runs, seed_noise

SCALES = ("params", "tokens", "flops")
SAME_SCALE = 0.01        # relative: params derived from two configs of one size differ by rounding


@dataclass(frozen=True)
class Transfer:
    outcome: str                    # holds | grows | shrinks | vanishes | reverses | inconclusive
    at_target: str                  # better | worse | inconclusive: the variant at the target scale
    metric: str
    scale: str                      # params | tokens | flops
    target: float
    delta: float                    # predicted variant - baseline at the target
    interval: tuple[float, float]
    level: float
    proxy: dict                     # {"scale", "delta", "interval"}: the gain at the largest proxy scale
    law: dict                       # {"form": "power" | "log-linear", params}: the gain's fit
    points: list                    # [{"scale", "baseline", "variant", "delta", "baseline_runs", "variant_runs"}]
    noise: Noise                    # the pooled seed noise the points are drawn with
    samples: int

    @property
    def method(self) -> str:
        law = "c*(X/X_ref)^gamma" if self.law["form"] == "power" else "u + v*ln(X/X_ref)"
        return (f"gain fitted as {law} on the per-scale gains; parametric bootstrap ({self.samples} draws): "
                "each side's mean at each scale drawn with the pooled seed noise of its seed count")

    @property
    def evidence(self) -> list[str]:
        return [rid for p in self.points for rid in p["baseline_runs"] + p["variant_runs"]]

    def to_json(self) -> dict:
        return {"outcome": self.outcome, "at_target": self.at_target, "metric": self.metric,
                "scale": self.scale, "target": self.target, "delta": self.delta,
                "interval": list(self.interval), "level": self.level, "proxy": self.proxy, "law": self.law,
                "points": self.points, "noise": self.noise.to_json(),
                "samples": self.samples, "method": self.method, "evidence": self.evidence}


def transfer(source, baseline: Sequence[str], variant: Sequence[str], *, target: float, scale: str = "params",
             metric: str = "val/loss", level: float = 0.95, samples: int = 1000, seed: int = 0,
             higher: bool | None = None) -> Transfer:
    """Does the variant's gain over the baseline at the proxy scales hold at `target`?

    `baseline` and `variant` are run ids, both measured at two or more common values of `scale`
    (equal within 1%; seeds at a scale are averaged). `samples` bootstrap draws with `seed`;
    `higher` overrides the metric's direction."""
    check_level(level)
    if scale not in SCALES:
        raise QueryError(f"unknown scale {scale!r}; known: {list(SCALES)}")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
        raise QueryError(f"target scale must be a positive number, not {target!r}")
    if not isinstance(samples, int) or samples < 100:
        raise QueryError(f"samples must be an integer of at least 100, not {samples!r}")
    up = higher_is_better(metric) if higher is None else higher
    base, var = _points(source, baseline, "baseline", scale, metric), _points(source, variant, "variant", scale, metric)
    shared = _shared(base, var)
    if len(shared) < 2:
        raise InsufficientData(f"baseline and variant share {len(shared)} scale(s) of {scale} with a final {metric}; "
                               "a gain's trend in scale needs both measured at two or more")
    noise = seed_noise(source, {r.project for pair in shared for _, vals in pair for r, _ in vals}, metric)
    rng = np.random.default_rng(seed)
    xs = np.array([b[0] for b, _ in shared])
    means = np.array([[_mean(b[1]), _mean(v[1])] for b, v in shared])
    gains = means[:, 1] - means[:, 0]
    counts = np.array([[len(b[1]), len(v[1])] for b, v in shared])
    # each side's mean at each scale drawn around its value with the seed noise of that many seeds
    # (t-distributed: the pooled sd is itself an estimate on noise.dof degrees of freedom)
    spread = noise.sd / np.sqrt(counts) * rng.standard_t(noise.dof, (samples, len(shared), 2))
    drawn = (means + spread) @ np.array([-1.0, 1.0])                                 # (samples, scales)
    law = _choose_law(gains, drawn, level)
    lx, at = np.log(xs / xs[-1]), math.log(target / xs[-1])          # X_ref: the largest proxy scale
    point = _fit(law, lx, gains[None, :])
    fits = _fit(law, lx, drawn)
    predicted, draws_at = float(_at(law, point, at)[0]), _at(law, fits, at)
    q = [0.5 - level / 2, 0.5 + level / 2]
    low, high = (float(x) for x in np.quantile(draws_at, q))
    proxy_iv = [float(x) for x in np.quantile(drawn[:, -1], q)]
    first, slope = float(point[0][0]), float(point[1][0])
    fitted = {"form": law, "x_ref": float(xs[-1])} | ({"c": first, "gamma": slope} if law == "power"
                                                      else {"u": first, "v": slope})
    proxy = {"scale": float(xs[-1]), "delta": float(gains[-1]), "interval": proxy_iv}
    points = [{"scale": float(b[0]), "baseline": float(m[0]), "variant": float(m[1]), "delta": float(g),
               "baseline_runs": [r.id for r, _ in b[1]], "variant_runs": [r.id for r, _ in v[1]]}
              for (b, v), m, g in zip(shared, means, gains)]
    return Transfer(_outcome(proxy["delta"], predicted, low, high, noise.sd), judge(predicted, low, high, up),
                    metric, scale, float(target), predicted, (low, high), level, proxy, fitted, points, noise, samples)


def _points(source, ids: Sequence[str], role: str, scale: str, metric: str) -> list[tuple[float, list]]:
    """[(scale value, [(run, value), ...])] in scale order, for one side."""
    if isinstance(ids, str):
        raise QueryError(f"{role}: give the run ids at each proxy scale, not one id ({ids!r})")
    ids = list(dict.fromkeys(ids))
    runs = read_runs(source, ids=ids)
    missing = sorted(set(ids) - {r.id for r in runs})
    if missing:
        raise NotFound(f"{role}: no run {', '.join(map(repr, missing))}")
    by_scale: dict[float, list] = {}
    for r in runs:
        x, v = r.scale.get(scale), metric_value(r, metric)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise InsufficientData(f"{role}: run {r.id} has no positive scale.{scale}")
        if v is not None:       # a diverged run has no final value to average
            by_scale.setdefault(float(x), []).append((r, v))
    return sorted(by_scale.items())


def _shared(base: list, var: list) -> list[tuple]:
    """[(baseline point, variant point)] at the scales both have, equal within SAME_SCALE."""
    out = []
    for b in base:
        match = [v for v in var if abs(v[0] - b[0]) <= SAME_SCALE * max(v[0], b[0])]
        if match:
            out.append((b, match[0]))
    return out


def _mean(vals: list) -> float:
    return math.fsum(v for _, v in vals) / len(vals)


def _choose_law(gains: np.ndarray, drawn: np.ndarray, level: float) -> str:
    """"power" unless the gains change sign beyond noise across the proxies: then "log-linear"."""
    q = np.quantile(drawn, [0.5 - level / 2, 0.5 + level / 2], axis=0)
    return "log-linear" if np.any(q[0] > 0) and np.any(q[1] < 0) else "power"


def _fit(law: str, lx: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(c, gamma) of c·e^(gamma·lx) per row of g, or (u, v) of u + v·lx; lx = ln(X/X_ref). A power
    law is a straight line in log-log when a row's gains share a sign, as nearly all draws' do."""
    if law == "log-linear":
        return _line(lx, g)
    sign = np.sign(g.sum(axis=1, keepdims=True))
    sign[sign == 0] = 1
    same = np.all(g * sign > 0, axis=1)
    c, gamma = np.empty(len(g)), np.empty(len(g))
    a, b = _line(lx, np.log(np.where(same[:, None], g * sign, 1.0)))       # straight in log-log
    c[same], gamma[same] = sign[same, 0] * np.exp(a[same]), b[same]
    for i in np.flatnonzero(~same):         # a draw whose gains straddle zero: least squares on the gains
        c[i], gamma[i] = _fit_straddling(lx, g[i])
    return c, gamma


def _fit_straddling(lx: np.ndarray, g: np.ndarray) -> tuple[float, float]:
    from scipy.optimize import least_squares
    start = np.array([g[-1] if g[-1] != 0 else g.mean(), 0.0])
    res = least_squares(lambda p: p[0] * np.exp(np.clip(p[1] * lx, -50, 50)) - g, start)
    return float(res.x[0]), float(res.x[1])


def _line(lx: np.ndarray, ly: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares intercept (at lx = 0) and slope of each row of ly against lx."""
    cx = lx - lx.mean()
    slope = (ly - ly.mean(axis=1, keepdims=True)) @ cx / (cx @ cx)
    return ly.mean(axis=1) - slope * lx.mean(), slope


def _at(law: str, params: tuple[np.ndarray, np.ndarray], at: float) -> np.ndarray:
    first, second = params
    if law == "log-linear":
        return first + second * at
    return first * np.exp(np.clip(second * at, -50, 50))


def _outcome(proxy: float, target: float, low: float, high: float, sd: float) -> str:
    has_zero, has_proxy = low <= 0 <= high, low <= proxy <= high
    if not has_zero and proxy != 0 and (target > 0) != (proxy > 0):
        return "reverses"
    if has_zero:
        return "inconclusive" if has_proxy else "vanishes"
    if not has_proxy and abs(target) < sd:
        return "vanishes"           # nonzero, but smaller than one run's seed noise: lost in it
    if has_proxy:
        return "holds"
    return "grows" if abs(target) > abs(proxy) else "shrinks"
