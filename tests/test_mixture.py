"""Data-mixture laws (kb.mixture): fitted over runs ingested through the real ingest path, on SQLite
and Postgres; the proposed mixture judged by the known function the runs were generated from."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from kb.errors import InsufficientData, InvalidRecord, QueryError
from kb.mixture import fit_mixture

SOURCES = ("books", "code", "math", "web")
# the validation loss is a weighted sum of per-domain losses, each a data-mixing law of the training
# mixture (Ye et al. 2024): training on a domain helps it most, neighbours a little
DOMAIN_WEIGHT = np.array([0.2, 0.25, 0.15, 0.4])
C = np.array([2.2, 1.2, 1.6, 2.6])
K = np.array([1.5, 1.8, 1.6, 1.4])
T = np.array([[-3.0, -0.2, -0.1, -1.0],
              [-0.1, -4.0, -0.8, -0.2],
              [-0.1, -1.0, -4.0, -0.1],
              [-1.0, -0.2, -0.1, -2.5]])


def true_loss(r):
    r = np.atleast_2d(r)
    return (DOMAIN_WEIGHT * (C + K * np.exp(r @ T.T))).sum(axis=1)


def true_optimum():
    simplex = [{"type": "eq", "fun": lambda w: w.sum() - 1}]
    fits = [minimize(lambda w: true_loss(w)[0], x0, method="SLSQP", bounds=[(0, 1)] * 4, constraints=simplex)
            for x0 in np.random.default_rng(1).dirichlet(np.ones(4), 20)]
    return min(f.fun for f in fits)


def record(i, weights, value, project="mix", nested=True, metric="val/loss"):
    mixture = dict(zip(SOURCES, map(float, weights))) if isinstance(weights, (list, np.ndarray)) else weights
    config = {"data": {"mixture": mixture}} if nested else {f"data.mixture.{s}": w for s, w in mixture.items()}
    return {"id": f"{project}-{i}", "project": project, "config": config | {"model": {"n_layer": 2}},
            "summary": {metric: float(value)}}


def ingest(kb, records):
    report = kb.ingest_records(records, index=False)
    assert not report.failed, report.failed
    return report


def test_proposed_mixture_is_within_one_percent_of_the_true_optimum(kb):
    rng = np.random.default_rng(0)
    optimum = true_optimum()
    # 30 runs, none of them near the optimum (each > 1.5% worse), measured with seed-like noise
    tried = rng.dirichlet(np.ones(4), 400)
    tried = tried[(true_loss(tried) - optimum) / optimum > 0.015][:30]
    measured = true_loss(tried) + rng.normal(0, 0.005, len(tried))
    # half with nested weights, half flat as trackers log them; and a run without a mixture
    ingest(kb, [record(i, w, v, nested=i % 2 == 0) for i, (w, v) in enumerate(zip(tried, measured))]
           + [{"id": "no-mixture", "project": "mix", "config": {"model": {"n_layer": 2}}, "summary": {"val/loss": 1.0}}])
    fit = kb.mixture_fit("mix")
    assert fit.sources == SOURCES and len(fit.runs) == 30 and "no-mixture" not in fit.runs
    assert set(fit.cv) == {"mixing-law", "linear", "quadratic"} and fit.form == min(fit.cv, key=fit.cv.get)
    weights, predicted, (low, high) = fit.best()
    assert sum(weights.values()) == pytest.approx(1) and min(weights.values()) >= 0
    proposed = true_loss(np.array([weights[s] for s in SOURCES]))[0]
    assert (proposed - optimum) / optimum < 0.01                          # the done-when point
    assert proposed < true_loss(tried).min()                               # better than any run tried
    assert low < predicted < high and high - low < 0.1
    assert fit.predict(weights) == pytest.approx(predicted)
    js = fit.to_json()
    assert js["form"] == fit.form and js["best"]["weights"] == weights and js["n"] == 30


def test_a_mixing_law_is_recognised_and_its_parameters_recovered(kb):
    rng = np.random.default_rng(1)
    t, c, k = np.array([-1.0, -2.0, -0.5]), 2.0, 1.5           # L = c + k·exp(t·r), 3 sources
    r = rng.dirichlet(np.ones(3), 20)
    y = c + k * np.exp(r @ t) + rng.normal(0, 0.003, 20)
    ingest(kb, [record(i, dict(zip(("a", "b", "c"), map(float, w))), v, project="law") for i, (w, v) in enumerate(zip(r, y))])
    fit = fit_mixture(kb, project="law")
    assert fit.form == "mixing-law"
    # t is identified up to a common shift (Σr = 1), so the last source's is 0 and k absorbs it
    assert fit.params["c"] == pytest.approx(c, abs=0.05)
    assert fit.params["t[a]"] == pytest.approx(t[0] - t[2], abs=0.1)
    assert fit.params["t[b]"] == pytest.approx(t[1] - t[2], abs=0.1)
    assert fit.params["k"] == pytest.approx(k * np.exp(t[2]), rel=0.05)
    weights, _, _ = fit.best("simplex")       # exp of a linear function: best at the vertex of b
    assert weights["b"] == pytest.approx(1, abs=0.01)


def test_higher_is_better_metrics_are_maximised_and_where_selects_runs(kb):
    rng = np.random.default_rng(2)
    r = rng.dirichlet(np.ones(3), 12)
    acc = 0.4 + 0.3 * r[:, 1] + rng.normal(0, 0.002, 12)                 # more of b, better accuracy
    records = [record(i, dict(zip("xyz", map(float, w))), v, project="acc", metric="val/accuracy")
               for i, (w, v) in enumerate(zip(r, acc))]
    records.append(record(99, {"x": 0.2, "y": 0.2, "z": 0.6}, 0.99, project="acc", metric="val/accuracy") |
                   {"tags": ["outlier"]})
    ingest(kb, records)
    fit = kb.mixture_fit("acc", metric="val/accuracy", where="tags.outlier not exists")
    assert "acc-99" not in fit.runs and fit.higher_is_better
    weights, _, _ = fit.best()
    assert weights["y"] == pytest.approx(r[:, 1].max(), abs=0.02)       # as far as the runs went
    with pytest.raises(QueryError, match="sum to"):
        fit.predict({"x": 0.5, "y": 0.1, "z": 0.1})
    with pytest.raises(QueryError, match="unknown source"):
        fit.predict({"x": 0.5, "web": 0.5})


@pytest.mark.parametrize("weights, message", [
    ({"web": 0.6, "code": 0.3}, "mixture weights sum to 0.9, not 1"),
    ({"web": 1.2, "code": -0.2}, "weight of 'code' is -0.2"),
    ({"web": "most", "code": 0.5}, "weight of 'web' is 'most'"),
])
def test_bad_mixtures_are_errors_naming_the_run(kb, weights, message):
    ingest(kb, [record(i, {"web": 0.5 + i / 10, "code": 0.5 - i / 10}, 3.0 - i / 10) for i in range(4)]
           + [record("bad", weights, 3.0)])
    with pytest.raises(InvalidRecord, match=f"run mix-bad: {message}"):
        fit_mixture(kb, project="mix")


def test_degenerate_mixture_data_are_errors(kb):
    same = [record(i, {"web": 0.5, "code": 0.5}, 3.0 + i / 100, project="same") for i in range(5)]
    fixed = [record(i, {"web": 0.4 + i / 20, "code": 0.5 - i / 20, "math": 0.1}, 3.0 - i / 50, project="fixed")
             for i in range(6)]
    few = [record(i, {"web": 0.2 + i / 5, "code": 0.4 - i / 10, "math": 0.4 - i / 10}, 3.0 - i / 9, project="few")
           for i in range(3)]
    ingest(kb, same + fixed + few)
    with pytest.raises(InsufficientData, match="same mixture"):
        fit_mixture(kb, project="same")
    with pytest.raises(InsufficientData, match=r"\['math'\] have the same weight"):
        fit_mixture(kb, project="fixed")
    with pytest.raises(InsufficientData, match="3 runs .* needs more than 3"):
        fit_mixture(kb, project="few")
    with pytest.raises(InsufficientData, match="no run of project 'nowhere'"):
        fit_mixture(kb, project="nowhere")
