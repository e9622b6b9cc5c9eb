"""Data-mixture laws: a project's loss as a function of its data mixture, and the best mixture.

    fit = fit_mixture(k, project="mix-sweep", metric="val/loss")
    fit.form, fit.cv                      # the form cross-validation chose, each form's CV error
    fit.predict({"web": 0.6, "code": 0.3, "math": 0.1})
    weights, predicted, interval = fit.best()

A run's mixture is `config.data.mixture = {"web": 0.6, "code": 0.3, "math": 0.1}`, or the same
as flat keys (`config["data.mixture.web"]`, as trackers flatten configs): weights per source,
each >= 0, summing to 1 (within 1%, then normalised). Three forms are fitted to the runs that
vary it (kb.mixture_forms):

    mixing-law   L(r) = c + k·exp(Σ_j t_j r_j)        (Ye et al. 2024, data mixing laws)
    linear       L(r) = Σ_j β_j r_j                   (RegMix-style regression on the weights)
    quadratic    L(r) = Σ_j β_j r_j + Σ_{i<j} β_ij r_i r_j      (Scheffé's mixture polynomial)

and the one with the lowest K-fold cross-validated RMSE is kept (a form needs more runs than
parameters to be tried at all). `best()` searches the simplex for the predicted optimum (dense
Dirichlet sampling, the few best refined by SLSQP under sum-to-one and bounds), by default only
where the runs went (each weight within the range the runs used: a polynomial extrapolated to a
corner of the simplex is where such fits go wrong), and gives the predicted loss there with a
bootstrap interval (runs resampled with replacement, the chosen form refitted).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kb.errors import InsufficientData, InvalidRecord, QueryError
from kb.fields import leaves
from kb.mixture_forms import FORMS, fit_form
from kb.noise import check_level, higher_is_better, metric_value, read_runs

PREFIX = "data.mixture."
SUM_TOLERANCE = 0.01        # weights written to two decimals (0.33 x 3) still count as summing to 1
FOLDS = 10
SEARCH_POINTS = 20000       # Dirichlet samples of the simplex before local refinement
REFINE = 5                  # of the best samples, refined by SLSQP


def mixture_of(run) -> dict[str, float] | None:
    """A run's data mixture {source: weight}, normalised; None when its config has none.
    InvalidRecord, naming the run and key, for a weight that is not a number >= 0 or weights
    that do not sum to 1."""
    found = {}
    for path, value in leaves(run.config):
        dotted = ".".join(path)         # nested and flat spellings read alike
        if dotted == PREFIX[:-1]:
            raise InvalidRecord(f"run {run.id}: config.data.mixture must be an object of weights per source, "
                                f"not {value!r}", field="config.data.mixture")
        if dotted.startswith(PREFIX):
            found[dotted[len(PREFIX):]] = value
    if not found:
        return None
    for source, w in found.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise InvalidRecord(f"run {run.id}: weight of {source!r} is {w!r}, not a number >= 0",
                                field=f"config.{PREFIX}{source}")
    total = math.fsum(found.values())
    if abs(total - 1) > SUM_TOLERANCE:
        raise InvalidRecord(f"run {run.id}: mixture weights sum to {total:.6g}, not 1", field="config.data.mixture")
    return {s: w / total for s, w in sorted(found.items())}


@dataclass
class MixtureFit:
    project: str
    metric: str
    higher_is_better: bool
    sources: tuple[str, ...]
    form: str                       # mixing-law | linear | quadratic
    params: dict
    cv: dict[str, float]            # form -> K-fold cross-validated RMSE (the forms tried)
    cv_r2: float                    # 1 - CV MSE / variance of the metric: how much the mixture explains
    runs: tuple[str, ...]           # the runs fitted
    skipped: tuple[str, ...]        # runs with a mixture but no final metric (diverged)
    weights: np.ndarray = field(repr=False)     # runs x sources
    values: np.ndarray = field(repr=False)
    level: float = 0.95
    samples: int = 200
    seed: int = 0
    _model: object = field(default=None, repr=False)
    _best: dict = field(default_factory=dict, repr=False)

    def predict(self, weights) -> float:
        """The fitted metric at a mixture ({source: weight} or weights in `sources` order)."""
        return float(self._model.predict(self._vector(weights)[None, :])[0])

    def best(self, within: str = "observed") -> tuple[dict[str, float], float, tuple[float, float]]:
        """(weights, predicted metric, its interval at `level`) at the predicted optimum: within
        the range of each weight the runs used ("observed"), or anywhere on the simplex ("simplex")."""
        if within not in ("observed", "simplex"):
            raise QueryError(f"within must be 'observed' or 'simplex', not {within!r}")
        if within not in self._best:
            lo, hi = ((self.weights.min(axis=0), self.weights.max(axis=0)) if within == "observed"
                      else (np.zeros(len(self.sources)), np.ones(len(self.sources))))
            w = self._search(lo, hi)
            self._best[within] = (dict(zip(self.sources, map(float, w))), self.predict(w), self._interval(w))
        return self._best[within]

    def to_json(self) -> dict:
        weights, predicted, interval = self.best()
        return {"project": self.project, "metric": self.metric, "higher_is_better": self.higher_is_better,
                "sources": list(self.sources), "form": self.form, "params": self.params, "cv": self.cv,
                "cv_r2": self.cv_r2, "n": len(self.runs), "best": {"weights": weights, "predicted": predicted,
                                                                     "interval": list(interval), "level": self.level},
                "runs": list(self.runs), "skipped": list(self.skipped)}

    # ---- inside ---------------------------------------------------------------------------

    def _vector(self, weights) -> np.ndarray:
        if isinstance(weights, dict):
            unknown = sorted(set(weights) - set(self.sources))
            if unknown:
                raise QueryError(f"unknown source(s) {unknown}; this fit's sources: {list(self.sources)}")
            weights = [weights.get(s, 0.0) for s in self.sources]
        w = np.asarray(weights, dtype=float)
        if w.shape != (len(self.sources),) or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise QueryError(f"a mixture is {len(self.sources)} weights >= 0 for {list(self.sources)}, not {weights!r}")
        if abs(w.sum() - 1) > SUM_TOLERANCE:
            raise QueryError(f"mixture weights sum to {w.sum():.6g}, not 1")
        return w / w.sum()

    def _search(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        from scipy.optimize import minimize

        sign = -1.0 if self.higher_is_better else 1.0
        rng = np.random.default_rng(self.seed)
        # Dirichlet points mapped into the box [lo, hi] ∩ simplex: lo + (1 - Σlo)·d, kept if under hi
        d = rng.dirichlet(np.ones(len(self.sources)), SEARCH_POINTS)
        cand = lo + (1 - lo.sum()) * d
        cand = np.vstack([cand[np.all(cand <= hi + 1e-12, axis=1)], self.weights])
        scores = sign * self._model.predict(cand)
        starts = cand[np.argsort(scores)[:REFINE]]
        best, best_score = starts[0], float(sign * self._model.predict(starts[:1])[0])
        for x0 in starts:
            res = minimize(lambda w: sign * self._model.predict(w[None, :])[0], x0, method="SLSQP",
                           bounds=list(zip(lo, hi)), constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}])
            w = np.clip(res.x, lo, hi)
            w = w / w.sum()
            score = float(sign * self._model.predict(w[None, :])[0])
            if np.isfinite(score) and score < best_score:
                best, best_score = w, score
        return best

    def _interval(self, w: np.ndarray) -> tuple[float, float]:
        rng = np.random.default_rng(self.seed)
        n, preds = len(self.values), []
        for _ in range(self.samples):
            idx = rng.integers(0, n, n)
            model = fit_form(self.form, self.weights[idx], self.values[idx], start=self._model)
            if model is not None:
                preds.append(model.predict(w[None, :])[0])
        preds = np.asarray(preds)
        preds = preds[np.isfinite(preds)]
        if len(preds) < self.samples // 2:
            raise InsufficientData(f"the {self.form} fit fails on most bootstrap resamples of {n} runs: "
                                   "too few runs for an interval")
        low, high = np.quantile(preds, [0.5 - self.level / 2, 0.5 + self.level / 2])
        return float(low), float(high)


def fit_mixture(source, project: str, metric: str = "val/loss", where: str | None = None, *,
                level: float = 0.95, samples: int = 200, seed: int = 0, higher: bool | None = None) -> MixtureFit:
    """Fit `metric` as a function of the data mixture over the project's runs (those matching
    `where`, when given) that carry one. `samples` bootstrap draws for best()'s interval."""
    check_level(level)
    if not isinstance(samples, int) or samples < 20:
        raise QueryError(f"samples must be an integer of at least 20, not {samples!r}")
    up = higher_is_better(metric) if higher is None else higher
    runs = read_runs(source, project=project, where=where)
    rows, ids, skipped = [], [], []
    for r in runs:
        mix = mixture_of(r)
        if mix is None:
            continue
        v = metric_value(r, metric)
        if v is None:
            skipped.append(r.id)
        else:
            rows.append((mix, v))
            ids.append(r.id)
    scope = f"project {project!r}" + (f" where {where}" if where else "")
    if not rows:
        raise InsufficientData(f"no run of {scope} has config.data.mixture and a final {metric}")
    sources = sorted({s for mix, _ in rows for s, w in mix.items() if w > 0})     # never used: no information
    X = np.array([[mix.get(s, 0.0) for s in sources] for mix, _ in rows])
    X /= X.sum(axis=1, keepdims=True)
    y = np.array([v for _, v in rows])
    if len({tuple(np.round(x, 9)) for x in X}) < 2:
        raise InsufficientData(f"every run of {scope} has the same mixture; vary it to fit a mixture law")
    fixed = [s for s, col in zip(sources, X.T) if np.ptp(col) < 1e-9]
    if fixed:
        raise InsufficientData(f"source(s) {fixed} have the same weight in every run of {scope}: their effect "
                               "cannot be told apart; vary them, or select runs with `where`")
    if np.ptp(y) == 0:
        raise InsufficientData(f"{metric} is the same in every run of {scope}: nothing to fit")
    cv = _cross_validate(X, y, seed)
    if not cv:
        smallest = min(FORMS.values(), key=lambda f: f.n_params(len(sources)))
        raise InsufficientData(f"{len(y)} runs of {scope} with a mixture and a final {metric}; the smallest "
                               f"mixture model ({smallest.name}) needs more than {smallest.n_params(len(sources))}")
    form = min(cv, key=lambda f: (cv[f], FORMS[f].n_params(len(sources))))
    model = fit_form(form, X, y)
    return MixtureFit(project, metric, up, tuple(sources), form, model.params(sources), cv,
                      float(1 - cv[form] ** 2 / np.var(y)), tuple(ids), tuple(skipped), X, y, level, samples, seed,
                      model)


def _cross_validate(X: np.ndarray, y: np.ndarray, seed: int) -> dict[str, float]:
    """K-fold RMSE of each form that has more training runs than parameters in every fold."""
    n, m = X.shape
    k = min(n, FOLDS)
    fold = np.random.default_rng(seed).permutation(n) % k
    out = {}
    for name, form in FORMS.items():
        if n - math.ceil(n / k) <= form.n_params(m):
            continue
        errors = np.empty(n)
        for f in range(k):
            test = fold == f
            model = fit_form(name, X[~test], y[~test])
            errors[test] = np.inf if model is None else model.predict(X[test]) - y[test]
        rmse = float(np.sqrt(np.mean(errors ** 2)))
        if np.isfinite(rmse):
            out[name] = rmse
    return out
