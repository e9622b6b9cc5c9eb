"""What a curve says: summary statistics and anomalies (spikes, divergence, plateaus), found on ingest."""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Sequence

import numpy as np

from kb import series

Point = Sequence   # (step, value) or (step, value, wall_time); value None means NaN


class Curves:
    """A run's curves as (steps, values) arrays, each built once and shared by the stats, the
    anomaly detectors and the failure check (building them was a fifth of the analysis).
    The functions below take this or the plain `{key: points}` dict."""

    def __init__(self, metrics: dict[str, list[Point]]):
        self.metrics = metrics
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._tables: dict[str, np.ndarray | None] = {}

    def table(self, key: str) -> np.ndarray | None:
        """The curve as kb.series packs it (series.uniform_table), shared with the writer."""
        if key not in self._tables:
            self._tables[key] = series.uniform_table(self.metrics[key])
        return self._tables[key]

    def arrays(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        if key not in self._arrays:
            self._arrays[key] = _arrays(self.metrics[key], self.table(key))
        return self._arrays[key]


def _curves(metrics: "dict[str, list[Point]] | Curves") -> Curves:
    return metrics if isinstance(metrics, Curves) else Curves(metrics)


HIGHER_IS_BETTER = ("acc", "accuracy", "score", "throughput", "mfu", "tokens_per", "lr")


def curve_stats(metrics: "dict[str, list[Point]] | Curves") -> dict[str, dict]:
    """Per metric: final value, best (lowest for losses, highest otherwise), its step, and extent."""
    cv = _curves(metrics)
    stats = {}
    for key, points in cv.metrics.items():
        if not points:
            continue
        steps, values = cv.arrays(key)          # ordered by step, stably: ties keep their order
        finite = np.isfinite(values)
        n_finite = int(finite.sum())
        last = float(values[-1])
        s = {"points": len(points), "first_step": int(steps[0]), "last_step": int(steps[-1]),
             "final": last if math.isfinite(last) else None, "nonfinite": len(points) - n_finite}
        if n_finite:
            lower_is_better = not any(w in key.lower() for w in HIGHER_IS_BETTER)
            # the first best point in step order, as min()/max() over the points would pick
            if n_finite == len(values):
                i = int(np.argmin(values) if lower_is_better else np.argmax(values))
            else:
                at = np.flatnonzero(finite)
                sub = values[at]
                i = int(at[np.argmin(sub) if lower_is_better else np.argmax(sub)])
            s.update(best=float(values[i]), best_step=int(steps[i]))
        stats[key] = s
    return stats


# ---- anomalies ------------------------------------------------------------------------------
#
# Every detector works on one curve at a time. Spikes and divergence look at point indices (not
# steps), so a curve logged every step and one logged every 250 steps are judged alike; the
# plateau test compares doublings of the step, the scale on which losses fall. Spikes are residuals against a
# rolling median, scaled by a local robust noise estimate taken from second differences: a
# median window over a monotone stretch returns the centre point itself, so the residual of a
# steep but clean initial drop is zero, and the second differences there are large, which only
# makes the detector more cautious where the curve bends.

SPIKE_Z = 8.0            # robust z above which a point is a spike (Gaussian noise: ~1e-15 per point)
GRAD_Z = 8.0             # the same on log10(grad norm), whose noise is multiplicative
REL_FLOOR = 1e-3         # noise is never taken below 0.1% of the curve's level: a smooth eval curve
                         # with a 0.002 wiggle is not a spike anyone needs to hear about
DIVERGE_RATIO = 0.5      # "far above": the smoothed loss sits 50% (of its best) above its best ...
DIVERGE_MIN_POINTS = 3   # ... from some point to the end of the curve, for at least this many points
PLATEAU_RATIO = 0.2      # plateau: the last doubling of steps improved by less than this fraction of
                         # the doubling before, with two standard errors to spare


@dataclass
class Finding:
    kind: str             # loss_spike | divergence | plateau | grad_spike
    key: str
    step: int | None
    value: float | None   # None where the value was NaN/Inf
    score: float | None
    evidence: str


def is_loss(key: str) -> bool:
    k = key.lower()
    return "loss" in k and "scale" not in k     # fp16's loss scale jumps by design


def is_grad_norm(key: str) -> bool:
    k = key.lower()
    return "grad" in k and "norm" in k


def _arrays(points: list[Point], table: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    if table is not None:
        steps, values = table[:, 0].astype(np.int64), table[:, 1].copy()
    else:
        steps = np.fromiter(map(itemgetter(0), points), dtype=np.int64, count=len(points))
        values = np.array(list(map(itemgetter(1), points)), dtype=float)     # None becomes NaN
    if len(steps) > 1 and not (steps[1:] >= steps[:-1]).all():
        # stable, as sorting the points by step is: points logged twice at one step keep their order
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
    return steps, values


def _odd(n: int) -> int:
    return n if n % 2 else n + 1


SMALL_MEDIAN = 1 << 16      # window x points up to which numpy's partition beats scipy's filter


def _median(y: np.ndarray, size: int, mode: str = "nearest") -> np.ndarray:
    """scipy.ndimage.median_filter(y, size, mode=mode), window capped at the curve's length.

    Short curves (most runs' eval curves, and training curves logged every few steps) take a
    partition over the padded windows: the same medians, without importing scipy (~0.6 s) or
    its per-call overhead. Long curves, and any with NaN/inf, go to scipy."""
    size = min(size, _odd(len(y)))
    h = size // 2
    if h and len(y) * size <= SMALL_MEDIAN and np.isfinite(y).all():
        if mode == "nearest":     # a a a | a b c d | d d d
            padded = np.concatenate((np.repeat(y[:1], h), y, np.repeat(y[-1:], h)))
        else:                     # reflect: c b a | a b c d | d c b
            padded = np.concatenate((y[h - 1::-1], y, y[:-h - 1:-1]))
        # the windows as a strided view of the padded curve (np.lib's helpers cost more than the
        # partition on curves this short)
        windows = np.ndarray((len(y), size), dtype=padded.dtype, buffer=padded,
                             strides=(padded.strides[0], padded.strides[0]))
        return np.partition(windows, h, axis=1)[:, h]
    from scipy.ndimage import median_filter     # here, not at import: `kb runs` never needs scipy

    return median_filter(y, size=size, mode=mode)


def _median_at(y: np.ndarray, size: int, at: np.ndarray) -> np.ndarray:
    """_median(y, size, "reflect") at the indices `at` only: the same windows, so the same values."""
    h = min(size, _odd(len(y))) // 2
    padded = np.concatenate([y[h - 1::-1], y, y[:-h - 1:-1]])     # (d c b a | a b c d | d c b a)
    windows = padded[at[:, None] + np.arange(2 * h + 1)]
    return np.partition(windows, h, axis=1)[:, h]


def _mid(a: np.ndarray) -> np.ndarray:
    """np.median of a finite 1-d array, from one partition (np.median's checks cost more on short curves)."""
    h = len(a) // 2
    if len(a) % 2:
        return np.partition(a, h)[h]
    part = np.partition(a, (h - 1, h))
    return (part[h - 1] + part[h]) / 2


def _smooth(y: np.ndarray) -> np.ndarray:
    # 'nearest' repeats the end values, so a monotone curve's first point is its own median
    # wide enough to see through spikes that last up to ~2.5% of the curve
    return _median(y, _odd(max(7, min(101, len(y) // 40))))


def _sigma(median_d2):
    """Gaussian sigma from a median of |second differences|: MAD -> sigma, and var(d2) = 6 sigma^2."""
    return median_d2 * 1.4826 / np.sqrt(6)


class _Rough:
    """One curve's rolling median and local robust noise: MAD of second differences (var = 6 sigma^2
    for white noise). The detectors share it, and the wide median behind the local noise is only
    taken where a question needs it: the noise never falls below a floor that is cheap to compute,
    and most curves are clean by a margin that the floor alone proves."""

    def __init__(self, y: np.ndarray):
        self.y, self.level = y, _smooth(y)
        d2 = np.zeros_like(y)
        if len(y) >= 3:
            d2[1:-1] = np.abs(y[2:] - 2 * y[1:-1] + y[:-2])
            d2[0], d2[-1] = d2[1], d2[-2]
        self.d2 = d2
        self.window = _odd(max(51, len(y) // 20))
        # finite second differences (y itself is finite) make every noise value finite and positive:
        # then a bound drawn from the floor decides exactly what the full noise would
        self.exact = bool(np.isfinite(d2).all())
        self.overall = _sigma(_mid(d2) if self.exact else np.median(d2))
        self._noise: np.ndarray | None = None

    def floor(self) -> np.ndarray:
        # a locally dead-flat stretch must not make every wiggle in it "infinitely" surprising
        return np.maximum(REL_FLOOR * np.abs(self.level), max(0.5 * self.overall, 1e-12))

    def noise(self) -> np.ndarray:
        if self._noise is None:
            # 'reflect', not 'nearest': fifty copies of one small end value would pass for quiet noise
            local = _sigma(_median(self.d2, self.window, "reflect"))
            y = self.y
            self._noise = np.maximum.reduce([local, np.full_like(y, 0.5 * self.overall),
                                             REL_FLOOR * np.abs(self.level), np.full_like(y, 1e-12)])
        return self._noise

    def below(self, resid: np.ndarray, threshold: float) -> bool:
        """True when no point's z = resid / noise can exceed threshold (False: it may)."""
        if not self.exact:
            return False
        floor = self.floor()
        # z <= resid / floor everywhere: division rounds monotonically in the divisor
        maybe = np.flatnonzero(resid / floor > threshold)
        if not len(maybe):
            return True
        if len(maybe) * self.window > 4 * len(resid):
            return False
        noise = np.maximum(_sigma(_median_at(self.d2, self.window, maybe)), floor[maybe])
        return bool((resid[maybe] / noise <= threshold).all())


def _spikes(kind: str, key: str, steps: np.ndarray, y: np.ndarray, shown: np.ndarray,
            threshold: float, rough: _Rough | None = None) -> list[Finding]:
    """Upward spikes of y; `shown` holds the values reported in the evidence (y may be a log)."""
    if len(y) < 10:
        return []
    rough = rough or _Rough(y)
    base = rough.level
    resid = y - base
    # the bar below is never under `threshold`, so a curve clear of it has no spike
    if rough.below(resid, threshold):
        return []
    z = resid / rough.noise()
    # heavy-tailed noise earns a higher bar: spikes go up, so the downward tail measures the noise
    threshold = max(threshold, 2.0 * float(np.quantile(-z, 0.999)))
    hot = np.flatnonzero(z > threshold)
    out: list[Finding] = []
    shown_base = base if shown is y else _smooth(shown)
    # consecutive flagged points are one event, reported at its peak
    for group in np.split(hot, np.flatnonzero(np.diff(hot) > 1) + 1) if len(hot) else []:
        i = int(group[np.argmax(z[group])])
        span = f", elevated over steps {steps[group[0]]}-{steps[group[-1]]}" if len(group) > 1 else ""
        out.append(Finding(kind, key, int(steps[i]), float(shown[i]), round(float(z[i]), 2),
                           f"{key} {shown[i]:.4g} at step {steps[i]} vs smoothed {shown_base[i]:.4g} "
                           f"(z={z[i]:.1f}){span}"))
    return out


def _divergence(key: str, steps: np.ndarray, y: np.ndarray, s: np.ndarray) -> Finding | None:
    """The smoothed loss s climbs far above its running best and never comes back."""
    best = np.minimum.accumulate(s)
    excess = s - best
    # far above the best in relative terms, and a real share of what the run had learnt so far
    # (a loss near zero doubling from 1e-4 to 2e-4 is noise, not a blow-up)
    far = (excess > DIVERGE_RATIO * np.maximum(np.abs(best), 1e-12)) & \
          (excess > 0.1 * (np.maximum.accumulate(s) - best))
    if not far[-1]:
        return None
    # the first point of the final run of "far" points
    start = len(far) - int(np.argmin(far[::-1])) if not far.all() else 0
    if len(far) - start < DIVERGE_MIN_POINTS:
        return None
    b = int(np.argmin(s[:start + 1]))
    ratio = float(np.median(s[start:]) / best[start]) if best[start] else None
    return Finding("divergence", key, int(steps[start]), float(y[start]), round(ratio, 2) if ratio else None,
                   f"{key} rose to {np.median(s[start:]):.4g} from step {steps[start]} to {steps[-1]} and stayed, "
                   f"vs its best {best[start]:.4g} at step {steps[b]}")


def _log_drop(x: np.ndarray, s: np.ndarray, lo: float, hi: float) -> tuple[float, float, int]:
    """How much the smoothed curve fell over log-steps [lo, hi), from a fitted line; the spread of
    those log-steps (root of their sum of squares about the mean; 0 where no line fits); count."""
    mask = (x >= lo) & (x < hi)
    n = int(mask.sum())
    if n < 3:
        return 0.0, 0.0, n
    xs, v = x[mask], s[mask]
    dx = xs - xs.sum() / n          # sum / n is what .mean() computes, without its overhead
    sxx = float((dx * dx).sum())
    if sxx <= 0:
        return 0.0, 0.0, n
    slope = float((dx * (v - v.sum() / n)).sum() / sxx)
    return -slope * (hi - lo), math.sqrt(sxx), n


def _stderr(sigma: float, lo: float, hi: float, spread: float) -> float:
    """Standard error of a _log_drop over [lo, hi) on noise sigma."""
    return sigma * (hi - lo) / spread if spread else math.inf


def _plateau(key: str, steps: np.ndarray, rough: _Rough) -> Finding | None:
    """No meaningful improvement over the last doubling of steps, relative to the doubling before.

    Losses fall roughly as a power of the step, so a healthy run improves by a similar amount
    per doubling (a power law with exponent 0.5 keeps ~70% of its pace); a run that stopped
    learning keeps almost none of it."""
    s = rough.level
    x = np.log2(steps.astype(float) + 1)
    top = float(x[-1])
    (t_lo, t_hi), (p_lo, p_hi) = (top - 1, top + 1e-9), (top - 2, top - 1)
    tail, spread_tail, n_tail = _log_drop(x, s, t_lo, t_hi)
    prev, spread_prev, n_prev = _log_drop(x, s, p_lo, p_hi)
    if n_tail < 20 or n_prev < 10:
        return None
    # the doubling before must itself be a clear improvement, and the last one clearly below its pace;
    # finite noise only widens both margins, so a run that failed them without it is healthy
    if rough.exact and (prev <= 0 or tail >= PLATEAU_RATIO * prev):
        return None
    sigma = float(np.median(rough.noise()))
    se_tail, se_prev = _stderr(sigma, t_lo, t_hi, spread_tail), _stderr(sigma, p_lo, p_hi, spread_prev)
    if prev <= 3 * se_prev or tail + 2 * se_tail >= PLATEAU_RATIO * prev:
        return None
    level = float(np.median(s[-max(5, n_tail // 5):]))
    onset = int(np.argmax(s <= level + PLATEAU_RATIO * prev))
    return Finding("plateau", key, int(steps[onset]), level, round(prev / max(tail, se_tail), 2),
                   f"{key} improved {tail:.3g} over steps {steps[-n_tail]}-{steps[-1]} vs {prev:.3g} over the "
                   f"doubling before; flat at {level:.4g} since about step {steps[onset]}")


def find_anomalies(metrics: "dict[str, list[Point]] | Curves") -> list[Finding]:
    """Spikes, divergence and plateaus of losses; spikes of grad norms. Plain data, ordered by key."""
    cv = _curves(metrics)
    metrics = cv.metrics
    out: list[Finding] = []
    for key in sorted(metrics):
        if metrics[key] and is_grad_norm(key):
            kind = "grad"
        elif metrics[key] and is_loss(key):
            kind = "loss"
        else:
            continue
        steps, values = cv.arrays(key)
        with np.errstate(over="ignore", invalid="ignore"):      # a loss of 1e300 just before the NaN
            out.extend(_judge(key, kind, steps, values))
    return out


def _judge(key: str, kind: str, steps: np.ndarray, values: np.ndarray) -> list[Finding]:
    bad = np.flatnonzero(~np.isfinite(values))
    # everything after the first NaN/Inf is wreckage: judge the curve up to it
    end = int(bad[0]) if len(bad) else len(values)
    st, y = steps[:end], values[:end]
    if kind == "grad":
        return _spikes("grad_spike", key, st, np.log10(np.maximum(y, 1e-12)), y, GRAD_Z)
    out: list[Finding] = []
    if len(bad):
        prior = f" (last finite {y[-1]:.4g} at step {st[-1]})" if len(y) else ""
        out.append(Finding("divergence", key, int(steps[end]), None, None,
                           f"{key} became {values[end]} at step {steps[end]}{prior}"))
    if len(y) < 10:         # too short for any curve test
        return out
    rough = _Rough(y)       # one smoothing and one noise estimate serve all three tests
    div = None if len(bad) else _divergence(key, st, y, rough.level)
    if div:
        # past a blow-up every point is "high": the divergence is the one finding there
        before = y[:int(np.searchsorted(st, div.step))]
        return _spikes("loss_spike", key, st[:len(before)], before, before, SPIKE_Z) + [div]
    out[:0] = _spikes("loss_spike", key, st, y, y, SPIKE_Z, rough)
    if not len(bad) and len(y) >= 50 and (p := _plateau(key, st, rough)):
        out.append(p)
    return out


def anomaly_summary(findings: list[Finding]) -> dict[str, dict]:
    """Per kind: count, first and last step, max score; stored under `anomalies.<kind>.<field>`."""
    out: dict[str, dict] = {}
    for f in findings:
        s = out.setdefault(f.kind, {"count": 0, "first_step": None, "last_step": None, "max_score": None})
        s["count"] += 1
        if f.step is not None:
            s["first_step"] = f.step if s["first_step"] is None else min(s["first_step"], f.step)
            s["last_step"] = f.step if s["last_step"] is None else max(s["last_step"], f.step)
        if f.score is not None and math.isfinite(f.score):
            s["max_score"] = f.score if s["max_score"] is None else max(s["max_score"], f.score)
    return out


def failure_from_curves(metrics: "dict[str, list[Point]] | Curves") -> dict | None:
    """A native `diverged` failure at the earliest step where a loss went NaN/Inf, else None."""
    cv = _curves(metrics)
    worst = None
    for key, points in cv.metrics.items():
        if not points or not is_loss(key):
            continue
        steps, values = cv.arrays(key)
        bad = np.flatnonzero(~np.isfinite(values))
        if not len(bad):
            continue
        i = int(bad[0])
        if worst is None or steps[i] < worst[0]:
            worst = (int(steps[i]), key, values[i], (int(steps[i - 1]), values[i - 1]) if i else None)
    if worst is None:
        return None
    step, key, value, prior = worst
    before = f"{key} {prior[1]:.4g} at step {prior[0]}, then " if prior else ""
    return {"kind": "diverged", "step": step, "message": f"{key} became {value} at step {step}",
            "evidence": f"{before}{value} at step {step}"}
