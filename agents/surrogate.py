"""The next configuration to try, from a project's own runs at one scale: Optuna warm-started with
every run as a finished trial suggests it, and a response surface fitted to the same runs predicts
its effect with an interval.

    for c in surrogate_candidates(history, n=2, is_new=...):   # agents.proposal.Candidate
        c.change, c.predicted        # {"optim.lr": 0.0011}, {"delta": -0.04, "interval": [...]}

Runs are searched in groups: one project, one scale (scale.params), the same non-numeric config
(norm, optimizer name, ...) and the same numeric keys; the numeric keys that vary inside a group
(seeds aside) are its search space, at most MAX_DIMS of them. Keys whose runs span a factor of 4 or
more are searched in log space (learning rates, batch sizes), each range widened past what was
run (half the smallest, twice the largest) so the search can leave the sweep's edge.

Suggesting: Optuna's GPSampler (fixed seed) over the group's trials. A diverged or OOM run is a
trial too, scored worse than any finished run (worst value plus the group's spread), so the
search learns where training breaks. A suggestion is rounded (two significant digits in log
space, three otherwise; powers of two stay powers of two). One that the store or a hypothesis
already holds, that lies within MIN_GAP of a run, or that the surface finds worse than the best
run by more than its residual sd even at the hopeful end of its interval is told back to the study as the worst finished value, so the next ask moves on; a
kept one is told back at its predicted value, so the next pick of the same call looks elsewhere.

Predicting: ordinary least squares of the metric on the encoded keys, quadratic (with
interactions) when the runs leave a residual degree of freedom for it, else linear;
the predicted effect is the surface's difference between the suggestion and the best run so far,
with a t interval at LEVEL from the fit's covariance. A quadratic in log learning rate is the
usual shape of a loss-versus-lr sweep near its optimum; far outside the runs it only extrapolates,
and the interval says so by widening.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from agents.proposal import Candidate, History
from kb.ablations import SEED_KEYS
from kb.fields import canonical
from kb.hypotheses import apply_change

log = logging.getLogger(__name__)

MAX_DIMS = 4
MAX_ASKS = 24           # suggestions looked at per group before giving up on new ones
MIN_GAP = 0.02          # a pick differs from every run and earlier pick by this share of a key's (encoded) range
LOG_SPAN = 4.0          # a key whose runs span this factor is searched in log space
LEVEL = 0.95
SEED = 0
MIN_DOF = 1             # residual degrees of freedom a surface must keep (its t interval widens as they fall)


@dataclass
class Dim:
    """One searched key: its range, scale and how a suggestion is rounded."""
    key: str
    path: tuple[str, ...]
    integer: bool
    log: bool
    low: float
    high: float
    pow2: bool = False

    @classmethod
    def of(cls, key: str, path: tuple[str, ...], values: list[float]) -> "Dim":
        lo, hi = min(values), max(values)
        integer = all(isinstance(v, int) for v in values)
        log_scale = lo > 0 and hi / lo >= LOG_SPAN
        if log_scale:
            low, high = lo / 2, hi * 2
        else:
            pad = (hi - lo) / 4
            low, high = lo - pad, hi + pad
            if lo >= 0:
                low = max(low, 0.0)
            if 0 <= lo and hi < 1 and not integer:       # a probability or a beta: stays below 1
                high = min(high, (1 + hi) / 2)
        pow2 = integer and lo > 0 and all(v & (v - 1) == 0 for v in values)
        if integer:
            low, high = max(math.floor(low), 1 if log_scale else 0), math.ceil(high)
        return cls(key, path, integer, log_scale, low, high, pow2)

    def distribution(self):
        from optuna.distributions import FloatDistribution, IntDistribution
        if self.integer:
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(float(self.low), float(self.high), log=self.log)

    def rounded(self, v: float):
        if self.integer:
            if self.pow2:
                return int(2 ** round(math.log2(max(v, 1))))
            return int(round(v))
        digits = 2 if self.log else 3
        return float(f"{v:.{digits - 1}e}") if v else 0.0

    def encode(self, v: float) -> float:
        return math.log10(v) if self.log else float(v)


@dataclass
class Group:
    project: str
    params: float | None
    dims: list[Dim]
    runs: list                      # RunPublic, finished and failed
    baseline: str

    @property
    def where(self) -> str:
        at = f" at {self.params:.3g} params" if self.params else ""
        return f"project {self.project}{at}"


def surrogate_candidates(history: History, n: int, is_new: Callable[[str, dict], bool],
                         project: str | None = None) -> list[Candidate]:
    """Up to n candidates from each searchable group (of `project`, or of every project)."""
    out = []
    for group in search_groups(history, project):
        try:
            out += _suggest(history, group, n, is_new)
        except np.linalg.LinAlgError as exc:          # a degenerate surface: this group has nothing to say
            log.info("surrogate over %s: %s", group.where, exc)
    return out


def _numeric_leaves(config: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], float]:
    """Numeric config leaves reachable through dicts (a list item is no key a change can set)."""
    out = {}
    for k, v in config.items():
        path = prefix + (str(k),)
        if isinstance(v, dict):
            out.update(_numeric_leaves(v, path))
        elif _is_number(v) and math.isfinite(v) and k not in SEED_KEYS and not _in_mixture(path):
            out[path] = v
    return out


def _fixed_leaves(config: dict, prefix: tuple[str, ...] = ()) -> tuple:
    out = []
    for k, v in sorted(config.items(), key=lambda kv: str(kv[0])):
        path = prefix + (str(k),)
        if isinstance(v, dict):
            out += _fixed_leaves(v, path)
        elif (not _is_number(v) or _in_mixture(path)) and k not in SEED_KEYS:
            out.append((path, repr(v)))
    return tuple(out)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _in_mixture(path: tuple[str, ...]) -> bool:
    """A data-mixture weight: the weights sum to one, so no one of them moves alone (the mixture
    source, agents.proposal_sources.mixture_candidates, proposes whole mixtures)."""
    return "mixture" in path[:-1]


def search_groups(history: History, project: str | None = None) -> list[Group]:
    """The groups of runs a surrogate can search over: enough finished runs for a linear surface
    over the keys that vary with two residual degrees of freedom (dims + 3), best-supported first."""
    buckets: dict[tuple, list] = defaultdict(list)
    for r in history.runs:
        if project and r.project != project:
            continue
        if history.value(r.id) is None and history.failed(r.id) is None:
            continue                 # killed, running, or failed for a reason that says nothing of the config
        numeric = _numeric_leaves(r.config)
        buckets[(r.project, history.scale_of(r.id), _fixed_leaves(r.config), frozenset(numeric))].append(r)
    groups = []
    for (proj, params, _, keys), runs in buckets.items():
        finished = [r for r in runs if history.value(r.id) is not None and not history.failed(r.id)]
        values = {p: [_numeric_leaves(r.config)[p] for r in runs] for p in keys}
        varying = sorted((p for p in keys if len(set(values[p])) >= 2), key=lambda p: (-len(set(values[p])), p))
        varying = _independent(varying, values)
        dims = [Dim.of(canonical(p), p, values[p]) for p in varying[:MAX_DIMS]]
        if not dims or len(finished) < len(dims) + 3:
            continue
        groups.append(Group(proj, params, dims, runs, _best_config(history, finished)))
    return sorted(groups, key=lambda g: (-len(g.runs), g.project, g.params or 0))


def _independent(keys: list, values: dict) -> list:
    """The keys less those that moved in lockstep with an earlier one: a key whose value each run is
    told by another's, one to one (a runner's min_lr = lr / 10 across an lr sweep), is one dimension
    of the search, not two; a surface over both would be singular. A change to the kept key lets
    the other follow it (the runner derives it again)."""
    kept: list = []
    for key in keys:
        if not any(_one_to_one(values[k], values[key]) for k in kept):
            kept.append(key)
    return kept


def _one_to_one(a: list, b: list) -> bool:
    pairs = set(zip(a, b))
    return len(pairs) == len({x for x, _ in pairs}) == len({y for _, y in pairs})


def _best_config(history: History, finished: list) -> str:
    """The first run of the configuration with the best mean over its seeds (one lucky seed of a
    config is not the best config)."""
    configs: dict[tuple, list] = defaultdict(list)
    for r in finished:
        configs[tuple(sorted(_numeric_leaves(r.config).items()))].append(r.id)
    mean = lambda ids: sum(history.value(i) for i in ids) / len(ids)      # noqa: E731
    best = min(configs.values(), key=lambda ids: (-mean(ids) if history.higher else mean(ids), min(ids)))
    return min(best)


# ---- the response surface -----------------------------------------------------------------------

class Surface:
    """OLS of the metric on the encoded keys: quadratic when the runs allow it, else linear."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.center, self.width = x.mean(axis=0), np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
        for order in (2, 1):
            phi = self.features(x, order)
            if len(y) - phi.shape[1] >= MIN_DOF and np.linalg.matrix_rank(phi) == phi.shape[1]:
                break
        else:
            raise np.linalg.LinAlgError(f"{len(y)} runs are too few for a linear surface in {x.shape[1]} keys")
        self.order = order
        self.beta, *_ = np.linalg.lstsq(phi, y, rcond=None)
        self.dof = len(y) - phi.shape[1]
        resid = y - phi @ self.beta
        self.s2 = float(resid @ resid) / self.dof
        self.xtx_inv = np.linalg.inv(phi.T @ phi)

    @property
    def name(self) -> str:
        return "quadratic" if self.order == 2 else "linear"

    def features(self, x: np.ndarray, order: int | None = None) -> np.ndarray:
        z = (np.atleast_2d(x) - self.center) / self.width
        cols = [np.ones(len(z))] + [z[:, i] for i in range(z.shape[1])]
        if (order or self.order) == 2:
            d = z.shape[1]
            cols += [z[:, i] * z[:, j] for i in range(d) for j in range(i, d)]
        return np.column_stack(cols)

    def predict(self, x: np.ndarray) -> float:
        return float((self.features(x) @ self.beta)[0])

    def contrast(self, x_new: np.ndarray, x_base: np.ndarray, level: float = LEVEL) -> tuple[float, float, float]:
        """The surface's difference new - base, and its t interval at `level`."""
        from scipy.stats import t
        c = (self.features(x_new) - self.features(x_base))[0]
        delta = float(c @ self.beta)
        half = float(t.ppf(0.5 + level / 2, self.dof)) * math.sqrt(max(self.s2 * float(c @ self.xtx_inv @ c), 0.0))
        return delta, delta - half, delta + half


# ---- suggesting ---------------------------------------------------------------------------------

def _suggest(history: History, group: Group, n: int, is_new: Callable[[str, dict], bool]) -> list[Candidate]:
    import optuna
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dims = group.dims
    dists = {d.key: d.distribution() for d in dims}
    finished = [r for r in group.runs if history.value(r.id) is not None and not history.failed(r.id)]
    broken = [r for r in group.runs if history.failed(r.id)]
    point = lambda r: [d.encode(_numeric_leaves(r.config)[d.path]) for d in dims]   # noqa: E731
    y = np.array([history.value(r.id) for r in finished])
    surface = Surface(np.array([point(r) for r in finished]), y)
    spread = float(y.max() - y.min()) or abs(float(y.mean())) * 0.1 or 1.0
    penalty = float(y.min() - spread) if history.higher else float(y.max() + spread)
    worst = float(y.min() if history.higher else y.max())
    noise = math.sqrt(surface.s2)                   # the surface's residual sd: seed noise and misfit

    study = optuna.create_study(direction="maximize" if history.higher else "minimize",
                                sampler=optuna.samplers.GPSampler(seed=SEED, n_startup_trials=0))
    study.add_trials([create_trial(params={d.key: _numeric_leaves(r.config)[d.path] for d in dims},
                                   distributions=dists, value=history.value(r.id) if i < len(finished) else penalty)
                      for i, r in enumerate(finished + broken)])

    base = history.by_id[group.baseline]
    base_values = _numeric_leaves(base.config)
    x_base = np.array(point(base))
    gap = MIN_GAP * np.array([d.encode(d.high) - d.encode(d.low) for d in dims])
    out: list[Candidate] = []
    picked: list[np.ndarray] = [np.array(point(r)) for r in group.runs]
    for _ in range(MAX_ASKS):
        if len(out) >= n:
            break
        trial = study.ask(dists)
        chosen = {d.key: d.rounded(trial.params[d.key]) for d in dims}
        x = np.array([d.encode(chosen[d.key]) for d in dims])
        change = {d.key: chosen[d.key] for d in dims if chosen[d.key] != base_values[d.path]}
        delta, low, high = surface.contrast(x, x_base)
        if (not change or any(np.all(np.abs(x - p) < gap) for p in picked)
                or not is_new(group.project, apply_change(base.config, change))
                or ((high < -noise) if history.higher else (low > noise))):
            # next to a run or an earlier pick, held already, or worse than the best run by more
            # than seed noise even at the hopeful end of its interval: told back as the worst
            # finished value, so the search leaves this place
            study.tell(trial, worst)
            continue
        study.tell(trial, surface.predict(x))       # believed, so the next pick looks elsewhere
        picked.append(x)
        out.append(_candidate(history, group, surface, base, change, delta, (low, high), len(finished), len(broken)))
    return out


def _candidate(history: History, group: Group, surface: Surface, base, change: dict, delta: float,
               interval: tuple[float, float], finished: int, broken: int) -> Candidate:
    metric = history.metric
    base_values = _numeric_leaves(base.config)
    moves = ", ".join(f"{k} {_num(base_values[d.path])} -> {_num(change[k])}"
                      for d in group.dims if (k := d.key) in change)
    space = ", ".join(("log " if d.log else "") + d.key for d in group.dims)
    failed = f", {broken} of them diverged or out of memory" if broken else ""
    rationale = (f"Optuna's GP sampler, warm-started with the {finished + broken} runs of {group.where}{failed}, "
                 f"suggests {moves}. A {surface.name} response surface in {space} fitted to the {finished} "
                 f"finished runs predicts {metric} {delta:+.4g} (95% interval {interval[0]:+.4g} to "
                 f"{interval[1]:+.4g}) against the best run so far, {base.id} ({history.value(base.id):.4g}).")
    evidence = [base.id] + sorted(r.id for r in group.runs if r.id != base.id)
    return Candidate(
        source="surrogate", project=group.project, baseline=base.id, change=change,
        title=f"{moves} in {group.where}", rationale=rationale, evidence=evidence,
        predicted={"metric": metric, "delta": delta, "interval": [interval[0], interval[1]], "level": LEVEL,
                   "higher_is_better": history.higher, "baseline_value": history.value(base.id),
                   "method": f"{surface.name} response surface (OLS in {space}) over {finished} runs, "
                             f"t interval of the difference to the baseline"})


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else repr(v)
