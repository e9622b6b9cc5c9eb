"""The regression forms kb.mixture fits of a metric on mixture weights r (rows sum to 1).

    mixing-law   c + k·exp(Σ_j t_j r_j)      least squares (scipy) on t, c and k solved given t
    linear       Σ_j β_j r_j                 ordinary least squares
    quadratic    Σ_j β_j r_j + Σ_{i<j} β_ij r_i r_j    ordinary least squares

No intercept in the polynomials and t_m = 0 in the mixing law: with Σ r = 1, an intercept is a
shift of every β_j, and a shift of every t_j a factor on k, so each is left out to keep the
parameters identifiable (and counted: a form is tried only with more runs than parameters).
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np

EXP_LIMIT = 50.0        # exponents clipped here: a wild start must not overflow to inf


class Linear:
    name = "linear"

    @staticmethod
    def n_params(m: int) -> int:
        return m

    def __init__(self, beta: np.ndarray):
        self.beta = beta

    @classmethod
    def design(cls, X: np.ndarray) -> np.ndarray:
        return X

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray, start=None):
        beta, *_ = np.linalg.lstsq(cls.design(X), y, rcond=None)
        return cls(beta)

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.design(X) @ self.beta

    def params(self, sources) -> dict:
        return {f"beta[{s}]": float(b) for s, b in zip(sources, self.beta)}


class Quadratic(Linear):
    name = "quadratic"

    @staticmethod
    def n_params(m: int) -> int:
        return m + m * (m - 1) // 2

    @classmethod
    def design(cls, X: np.ndarray) -> np.ndarray:
        pairs = list(itertools.combinations(range(X.shape[1]), 2))
        return np.hstack([X] + [X[:, [i]] * X[:, [j]] for i, j in pairs])

    def params(self, sources) -> dict:
        names = [f"beta[{s}]" for s in sources]
        names += [f"beta[{a}*{b}]" for a, b in itertools.combinations(sources, 2)]
        return {n: float(b) for n, b in zip(names, self.beta)}


class MixingLaw:
    name = "mixing-law"

    @staticmethod
    def n_params(m: int) -> int:
        return m + 1            # c, k, and t for all but the last source

    def __init__(self, theta: np.ndarray):
        self.theta = theta      # c, k, t_1..t_{m-1}

    def predict(self, X: np.ndarray) -> np.ndarray:
        c, k, t = self.theta[0], self.theta[1], self.theta[2:]
        return c + k * np.exp(np.clip(X[:, :-1] @ t, -EXP_LIMIT, EXP_LIMIT))

    def params(self, sources) -> dict:
        out = {"c": float(self.theta[0]), "k": float(self.theta[1])}
        out |= {f"t[{s}]": float(t) for s, t in zip(sources, self.theta[2:])}
        out[f"t[{sources[-1]}]"] = 0.0
        return out

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray, start=None):
        """Least squares by variable projection: for given exponents t, c and k are a linear
        least-squares solve, so only t (one per source but the last) is searched, from `start`
        (a previous fit, as a bootstrap refit does) or from several starts, the best kept."""
        from scipy.optimize import least_squares

        R = X[:, :-1]

        def linear_part(t):
            A = np.column_stack([np.ones(len(y)), np.exp(np.clip(R @ t, -EXP_LIMIT, EXP_LIMIT))])
            ck, *_ = np.linalg.lstsq(A, y, rcond=None)
            return A, ck

        def residual(t):
            A, ck = linear_part(t)
            return A @ ck - y

        starts = [start.theta[2:]] if isinstance(start, MixingLaw) else cls._starts(R, y)
        best = None
        for t0 in starts:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                res = least_squares(residual, t0, method="lm")
            if np.all(np.isfinite(res.x)) and np.isfinite(res.cost) and (best is None or res.cost < best.cost):
                best = res
        if best is None:
            return None
        _, ck = linear_part(best.x)
        return cls(np.concatenate([ck, best.x]))

    @staticmethod
    def _starts(R: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
        """Exponents from log|y - c0| fitted linearly in r, for c0 below the data (k > 0, a loss
        falling toward c) and above it (k < 0), plus zero and a few random ones."""
        spread = max(float(np.ptp(y)), 1e-12)
        A = np.column_stack([np.ones(len(y)), R])
        out = [np.zeros(R.shape[1])]
        for c0 in (y.min() - 0.1 * spread, y.min() - spread, y.max() + 0.1 * spread, y.max() + spread):
            coef, *_ = np.linalg.lstsq(A, np.log(np.abs(y - c0)), rcond=None)
            out.append(coef[1:])
        rng = np.random.default_rng(0)
        out += [rng.normal(0, 2, R.shape[1]) for _ in range(3)]
        return out


FORMS = {f.name: f for f in (MixingLaw, Linear, Quadratic)}


def fit_form(name: str, X: np.ndarray, y: np.ndarray, start=None):
    """A fitted model of form `name`, or None when the fit fails (no finite solution)."""
    return FORMS[name].fit(X, y, start=start)
