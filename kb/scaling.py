"""Scaling laws fitted over runs: L = E + A·X^-α, and L(N, D) = E + A/N^α + B/D^β (Chinchilla).

    fit = fit_points(points, form="chinchilla", draws=200, seed=0)    # points: kb.scaling_points
    fit.params["alpha"]                  -> Estimate(value, low, high)
    fit.predict(N=7e10, D=1.4e12)        -> Estimate of the loss
    fit.compute_optimal(5.76e23)         -> {"params", "tokens", "tokens_per_param", "loss"}

Fitted as Hoffmann et al. 2022, Approach 3: a law is a log-sum-exp in log space,
log L = LSE(a - α log N, b - β log D, e) with A = e^a, B = e^b, E = e^e, so the loss stays
positive with no constraint on the parameters; the objective is the sum of Huber losses
(δ = 1e-3) of the log residuals log L_pred - log L_obs, minimised by L-BFGS-B from a grid of
starts, best kept. Intervals are percentile bootstrap: points resampled with replacement, each
resample refitted from the best fit (its optimum lies near it; a grid per draw would cost ~100×).
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from kb.errors import InvalidRecord, KBError

DELTA = 1e-3           # Huber's δ on log residuals, as Hoffmann et al. and Epoch's replication
# Hoffmann et al.'s grid of initialisations: exponents 0..2, log E -1..1, log A and log B 0..25
EXPONENT_GRID = (0.0, 0.5, 1.0, 1.5, 2.0)
LOG_E_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0)
LOG_COEF_GRID = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
# L-BFGS-B starts from the grid points with the lowest objective: on Epoch's Chinchilla data all
# 4,500 of them find no better optimum than the best 32 (benchmarks/scaling_chinchilla.py --starts 4500)
REFINED_STARTS = 32
DRAWS = 200
LEVEL = 0.95


@dataclass(frozen=True)
class Form:
    """A law as terms coef_i · x_i^-exponent_i plus an irreducible E. theta is
    [log coef_1, exponent_1, ..., log coef_k, exponent_k, log E]."""
    name: str
    variables: tuple[str, ...]          # what each term scales with: N, D or X
    coefs: tuple[str, ...]              # public names of the coefficients
    exponents: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters in the order the contract's JSON lists them."""
        return ("E", *itertools.chain.from_iterable(zip(self.coefs, self.exponents)))

    @property
    def size(self) -> int:
        return 2 * len(self.variables) + 1

    def public(self, theta: np.ndarray) -> dict[str, np.ndarray]:
        """{E, A, alpha, ...} from theta; works on one theta or a stack of them (last axis)."""
        out = {"E": np.exp(theta[..., -1])}
        for i, (c, x) in enumerate(zip(self.coefs, self.exponents)):
            out[c], out[x] = np.exp(theta[..., 2 * i]), theta[..., 2 * i + 1]
        return out


FORMS = {
    "chinchilla": Form("chinchilla", ("N", "D"), ("A", "B"), ("alpha", "beta")),
    "power": Form("power", ("X",), ("A",), ("alpha",)),
}


def form_named(name: str) -> Form:
    if name not in FORMS:
        raise InvalidRecord(f"unknown form {name!r}; known: {sorted(FORMS)}", field="form")
    return FORMS[name]


@dataclass(frozen=True)
class Estimate:
    """A value with its bootstrap percentile interval (low, high None without bootstrap draws)."""
    value: float
    low: float | None = None
    high: float | None = None

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}


# ---- the objective ------------------------------------------------------------------------

def log_predicted(theta: np.ndarray, logx: np.ndarray) -> np.ndarray:
    """log L for thetas (..., p) at points logx (n, k): LSE over the k terms and log E."""
    k = logx.shape[1]
    theta = np.asarray(theta)[..., None, :]                      # broadcast over points
    terms = [theta[..., 2 * i] - theta[..., 2 * i + 1] * logx[:, i] for i in range(k)]
    terms.append(np.broadcast_to(theta[..., -1], terms[0].shape))
    return np.logaddexp.reduce(np.stack(terms), axis=0)


def huber(r: np.ndarray) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= DELTA, 0.5 * r * r, DELTA * (a - 0.5 * DELTA))


def objective(theta: np.ndarray, logx: np.ndarray, logy: np.ndarray) -> np.ndarray:
    """Sum of Huber(δ) over log residuals, for one theta or a stack of them."""
    return huber(log_predicted(theta, logx) - logy).sum(axis=-1)


def _scaled_objective(theta: np.ndarray, logx: np.ndarray, logy: np.ndarray) -> tuple[float, np.ndarray]:
    """objective / δ and its gradient. Divided by δ so the gradient is O(points), not O(δ):
    with the raw objective L-BFGS-B's gradient tolerance stops it short of the optimum (the
    early stop Epoch found behind the paper's published fit)."""
    k = logx.shape[1]
    terms = np.stack([theta[2 * i] - theta[2 * i + 1] * logx[:, i] for i in range(k)]
                     + [np.full(len(logy), theta[-1])])
    lse = np.logaddexp.reduce(terms, axis=0)
    r = lse - logy
    weights = np.exp(terms - lse)                    # d LSE / d term: a softmax over the terms
    psi = np.clip(r / DELTA, -1.0, 1.0)              # Huber's derivative, over δ
    grad = np.empty_like(theta)
    for i in range(k):
        g = psi * weights[i]
        grad[2 * i], grad[2 * i + 1] = g.sum(), -(g * logx[:, i]).sum()
    grad[-1] = (psi * weights[k]).sum()
    return float(huber(r).sum() / DELTA), grad


def _minimise(theta0: np.ndarray, logx: np.ndarray, logy: np.ndarray) -> np.ndarray:
    from scipy.optimize import minimize
    result = minimize(_scaled_objective, theta0, args=(logx, logy), jac=True, method="L-BFGS-B",
                      options={"maxiter": 2000, "ftol": 1e-14, "gtol": 1e-10})
    return result.x


def grid(form: Form) -> np.ndarray:
    """Hoffmann et al.'s initialisations, one row per start, in theta's layout."""
    per_term = [LOG_COEF_GRID, EXPONENT_GRID] * len(form.variables)
    return np.array(list(itertools.product(*per_term, LOG_E_GRID)))


def best_theta(form: Form, logx: np.ndarray, logy: np.ndarray, starts: int = REFINED_STARTS) -> np.ndarray:
    """L-BFGS-B from the `starts` best grid points (the whole grid is scored at once), best kept."""
    inits = grid(form)
    scores = objective(inits, logx, logy)
    order = np.argsort(scores, kind="stable")[:starts]
    fits = [_minimise(inits[i], logx, logy) for i in order]
    values = np.array([objective(t, logx, logy) for t in fits])
    if not np.isfinite(values).any():
        raise KBError(f"no fit of {len(fits)} L-BFGS-B starts reached a finite objective")
    return fits[int(np.nanargmin(values))]


# ---- the fit ------------------------------------------------------------------------------

COLLINEAR = 1e-6       # 1 - |corr(log N, log D)| below this: N and D cannot be told apart


@dataclass(frozen=True)
class Points:
    """What a law is fitted to: the loss and each variable the form scales with, all > 0."""
    y: np.ndarray
    x: dict[str, np.ndarray]               # {"N": ..., "D": ...} or {"X": ...}
    runs: tuple[str, ...] = ()
    names: dict[str, str] = field(default_factory=dict)   # y, N, D, X as errors name them (run keys)

    def logx(self, form: Form) -> np.ndarray:
        return np.log(np.column_stack([self.x[v] for v in form.variables]))

    def name(self, what: str) -> str:
        return self.names.get(what, what)


def check(points: Points, form: Form) -> None:
    """InvalidRecord naming what is wrong when `form` cannot be fitted to `points`: a value that is
    not a positive number (the fit is in log space), fewer points than parameters plus one, a loss
    or a scale that never varies, N and D that vary only together."""
    for what, values in [("y", points.y), *((v, points.x[v]) for v in form.variables)]:
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            i = int(np.argmax(bad))
            run = f"run {points.runs[i]!r}" if points.runs else f"point {i}"
            raise InvalidRecord(f"{run} has {values[i]:g}; a scaling law is fitted in log space, so every "
                                f"value must be a positive number (--where can leave that run out)",
                                field=points.name(what))
    n, need = len(points.y), form.size + 1
    if n < need:
        raise InvalidRecord(f"{n} point(s) with a finite value: a {form.name} law has {form.size} parameters, "
                            f"so the fit needs at least {need} points", field=points.name("y"))
    if np.ptp(points.y) == 0:
        raise InvalidRecord(f"constant at {points.y[0]:g} over all {n} runs: there is no trend to fit",
                            field=points.name("y"))
    for v in form.variables:
        if np.ptp(points.x[v]) == 0:
            raise InvalidRecord(f"one scale only: every run has {points.x[v][0]:g}; a law in it needs "
                                f"runs at several", field=points.name(v))
    if form.name == "chinchilla":
        corr = np.corrcoef(np.log(points.x["N"]), np.log(points.x["D"]))[0, 1]
        if 1 - abs(corr) < COLLINEAR:
            raise InvalidRecord("N and D vary together (D is a fixed power of N in every run), so their "
                                "effects cannot be told apart; add runs off that line or fit --form power",
                                field=points.name("D"))


@dataclass
class ScalingFit:
    form: Form
    theta: np.ndarray                      # the best fit, in theta's layout
    boot: np.ndarray                       # (draws, p) bootstrap refits; (0, p) with no draws
    points: Points
    level: float = LEVEL
    seed: int = 0
    meta: dict = field(default_factory=dict)   # y, x, where, skipped runs, wall time: for the record

    @property
    def runs(self) -> list[str]:
        return list(self.points.runs)

    @property
    def params(self) -> dict[str, Estimate]:
        best, boot = self.form.public(self.theta), self.form.public(self.boot)
        return {name: self._estimate(best[name], boot[name]) for name in self.form.names}

    def _estimate(self, value, draws: np.ndarray) -> Estimate:
        value = float(value)
        draws = draws[np.isfinite(draws)]
        if not len(draws):
            return Estimate(value)
        tail = 100 * (1 - self.level) / 2
        low, high = np.percentile(draws, [tail, 100 - tail])
        return Estimate(value, float(low), float(high))

    def predict(self, N: float | None = None, D: float | None = None, X: float | None = None) -> Estimate:
        """The predicted loss at (N, D) for a Chinchilla fit, at X for a power law."""
        given = {"N": N, "D": D, "X": X}
        wanted = self.form.variables
        if any(given[v] is None for v in wanted) or any(given[v] is not None for v in given if v not in wanted):
            raise InvalidRecord(f"a {self.form.name} law predicts from {' and '.join(wanted)}", field="predict")
        logx = _log_positive({v: given[v] for v in wanted})[None, :]
        value = np.exp(log_predicted(self.theta, logx))[0]
        draws = np.exp(log_predicted(self.boot, logx))[..., 0] if len(self.boot) else np.empty(0)
        return self._estimate(value, draws)

    def compute_optimal(self, C: float) -> dict[str, Estimate]:
        """N and D minimising L(N, D) subject to 6ND = C, in closed form (Hoffmann et al., eq. 4):
        G = (αA/(βB))^(1/(α+β)), N = G (C/6)^(β/(α+β)), D = (C/6)^(α/(α+β)) / G."""
        if self.form.name != "chinchilla":
            raise InvalidRecord("compute-optimal N and D need a chinchilla fit (L in both N and D)",
                                field="compute")
        logc = float(_log_positive({"compute": C})[0]) - np.log(6.0)
        best = _optimum(self.form.public(self.theta), logc)
        boot = _optimum(self.form.public(self.boot), logc)
        return {k: self._estimate(best[k], boot[k]) for k in best}

    def residual(self) -> dict:
        logx, logy = self.points.logx(self.form), np.log(self.points.y)
        r = log_predicted(self.theta, logx) - logy
        return {"huber": float(huber(r).sum()), "rmse_log": float(np.sqrt(np.mean(r * r))),
                "max_abs_log": float(np.abs(r).max()), "delta": DELTA}

    def to_json(self) -> dict:
        """The contract's `kb scaling fit --json` shape, plus what says how it was made."""
        return {"form": self.form.name, "n": len(self.points.y),
                "params": {k: v.as_dict() for k, v in self.params.items()},
                "residual": self.residual(),
                "bootstrap": {"draws": len(self.boot), "level": self.level, "seed": self.seed},
                **self.meta, "runs": self.runs}


def _optimum(p: dict[str, np.ndarray], logc: float) -> dict[str, np.ndarray]:
    a, b = p["alpha"], p["beta"]
    with np.errstate(all="ignore"):         # a bootstrap draw may have a degenerate exponent
        log_g = (np.log(a * p["A"]) - np.log(b * p["B"])) / (a + b)
        n = np.exp(log_g + logc * b / (a + b))
        d = np.exp(logc * a / (a + b) - log_g)
        loss = p["E"] + p["A"] / n ** a + p["B"] / d ** b
    return {"params": n, "tokens": d, "tokens_per_param": d / n, "loss": loss}


def _log_positive(values: dict[str, float | None]) -> np.ndarray:
    out = []
    for name, v in values.items():
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise InvalidRecord(f"{v!r} is not a number", field=name) from None
        if not np.isfinite(x) or x <= 0:
            raise InvalidRecord(f"{v!r}: must be a positive number", field=name)
        out.append(np.log(x))
    return np.array(out)


def _one_blas_thread():
    """L-BFGS-B calls BLAS on vectors of five numbers: OpenBLAS's threads only contend for them,
    and on a busy 2-core machine made the Chinchilla fit 5× slower (2.9 s against 14.8 s)."""
    import scipy.optimize  # noqa: F401 - loads scipy's own OpenBLAS, so that the limit reaches it
    try:
        from threadpoolctl import threadpool_limits     # there with scikit-learn (sentence-transformers)
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def fit_points(points: Points, form: str | Form = "chinchilla", draws: int = DRAWS, seed: int = 0,
               level: float = LEVEL, starts: int = REFINED_STARTS, meta: dict | None = None) -> ScalingFit:
    """The best fit of a law to points, with `draws` bootstrap refits for its intervals."""
    form = form if isinstance(form, Form) else form_named(form)
    if draws < 0:
        raise InvalidRecord(f"{draws}: the number of bootstrap draws cannot be negative", field="bootstrap")
    if not 0 < level < 1:
        raise InvalidRecord(f"{level}: the interval's level is a fraction between 0 and 1", field="level")
    check(points, form)
    started = time.perf_counter()
    logx, logy = points.logx(form), np.log(points.y)
    with _one_blas_thread():
        theta = best_theta(form, logx, logy, starts)
        rng = np.random.default_rng(seed)
        n = len(logy)
        boot = np.empty((draws, form.size))
        for i in range(draws):
            pick = rng.integers(0, n, n)
            boot[i] = _minimise(theta, logx[pick], logy[pick])
    meta = dict(meta or {}) | {"wall_s": round(time.perf_counter() - started, 3)}
    return ScalingFit(form, theta, boot, points, level=level, seed=seed, meta=meta)


def prediction(fit: ScalingFit, params: float | None = None, tokens: float | None = None,
               compute: float | None = None) -> dict:
    """`kb scaling predict --json`: the loss at (N, D), at X, or at the compute-optimal (N, D)
    for a budget C, each with its interval."""
    at = {k: v for k, v in (("params", params), ("tokens", tokens), ("compute", compute)) if v is not None}
    out = {"form": fit.form.name, "n": len(fit.points.y), "y": fit.meta.get("y"), "at": at}
    if fit.form.name == "chinchilla":
        if compute is not None and params is None and tokens is None:
            optimal = fit.compute_optimal(compute)
            return out | {"predicted": optimal.pop("loss").as_dict(),
                          "optimal": {k: v.as_dict() for k, v in optimal.items()}}
        if compute is not None or params is None or tokens is None:
            raise InvalidRecord("a chinchilla law predicts at --params N --tokens D, or at the "
                                "compute-optimal point of --compute C", field="predict")
        return out | {"predicted": fit.predict(N=params, D=tokens).as_dict()}
    x = fit.meta.get("x") or "params"
    if set(at) != {x}:
        raise InvalidRecord(f"this power law is in {x}: predict with --{x} alone", field="predict")
    return out | {"predicted": fit.predict(X=at[x]).as_dict()}
