"""Curve anomalies on synthetic losses with known ground truth: power-law decay plus seeded noise,
with spikes, NaNs, blow-ups and flat tails injected where the test decides."""
from __future__ import annotations

import math

import numpy as np
import pytest
from sqlalchemy import select
from sqlmodel import Session

from kb.curves import Finding, anomaly_summary, failure_from_curves, find_anomalies


def power_law(seed: int, n: int = 2000, noise: float = 0.02, every: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A healthy loss: 2 + 8 (t+1)^-0.5, with 2% multiplicative Gaussian noise (batch-to-batch)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) * every
    return t, (2 + 8 * (t / every + 1) ** -0.5) * (1 + noise * rng.standard_normal(n))


def points(t, y) -> list[list]:
    return [[int(s), float(v)] for s, v in zip(t, y)]


@pytest.mark.parametrize("seed", range(20))
def test_clean_noisy_loss_has_no_anomalies(seed):
    t, y = power_law(seed)
    _, y_eval = power_law(seed + 100, n=80, every=25, noise=0.005)
    assert find_anomalies({"train/loss": points(t, y), "val/loss": points(t[::25], y_eval)}) == []


@pytest.mark.parametrize("seed", range(20))
def test_fast_initial_drop_is_not_a_spike(seed):
    rng = np.random.default_rng(seed)
    t = np.arange(1500) * 10
    y = (3 + 7.9 * np.exp(-t / 300) + 2 * (t + 10) ** -0.3) * (1 + 0.01 * rng.standard_normal(len(t)))
    assert find_anomalies({"train/loss": points(t, y)}) == []


@pytest.mark.parametrize("seed", range(20))
def test_injected_spikes_are_found_exactly(seed):
    t, y = power_law(seed)
    rng = np.random.default_rng(1000 + seed)
    where = np.sort(rng.choice(np.arange(60, 1940, 40), size=4, replace=False)) + rng.integers(0, 20, 4)
    y[where] *= 1 + rng.uniform(0.25, 1.5, 4)           # +25% to +150% for one step
    found = find_anomalies({"train/loss": points(t, y)})
    assert [(f.kind, f.step) for f in found] == [("loss_spike", int(s)) for s in where]
    assert all(f.score > 8 and f.value == pytest.approx(y[f.step]) for f in found)


def test_spike_evidence_reads_like_a_sentence():
    t, y = power_law(3)
    y[1200] = 7.9
    (f,) = find_anomalies({"train/loss": points(t, y)})
    assert f.evidence.startswith("train/loss 7.9 at step 1200 vs smoothed 2.2")
    assert f"(z={f.score:.1f})" in f.evidence


def test_a_spike_lasting_several_steps_is_one_finding():
    t, y = power_law(4)
    y[800:812] += 1.5
    (f,) = find_anomalies({"train/loss": points(t, y)})
    assert f.kind == "loss_spike" and 800 <= f.step < 812 and "steps 800-811" in f.evidence


def test_nan_is_divergence_at_its_step_and_a_diverged_failure():
    t, y = power_law(5)
    y[1337:] = np.nan
    pts = points(t, y)
    pts[1340][1] = None                                # None is NaN too
    found = find_anomalies({"train/loss": pts})
    assert [(f.kind, f.step, f.value) for f in found] == [("divergence", 1337, None)]
    assert "nan at step 1337" in found[0].evidence and "last finite" in found[0].evidence
    failure = failure_from_curves({"train/loss": pts, "lr": points(t, np.ones_like(y))})
    assert failure["kind"] == "diverged" and failure["step"] == 1337
    assert "step 1336" in failure["evidence"] and "nan at step 1337" in failure["evidence"]


def test_inf_in_the_earliest_loss_wins():
    t, y = power_law(6)
    val = y.copy()
    y[900] = np.inf
    val[400:] = np.nan
    failure = failure_from_curves({"train/loss": points(t, y), "val/loss": points(t, val)})
    assert failure["step"] == 400 and "val/loss" in failure["message"]


def test_blow_up_that_stays_is_divergence_without_spikes_after_it():
    t, y = power_law(7)
    y[1500:] *= 2.5                                    # from ~2.2 to ~5.5 for good: the run is lost
    found = find_anomalies({"train/loss": points(t, y)})
    assert [(f.kind, f.step) for f in found] == [("divergence", 1500)]
    assert found[0].score == pytest.approx(2.5, rel=0.1)
    assert failure_from_curves({"train/loss": points(t, y)}) is None    # finite: a curve anomaly, not NaN


def test_flat_tail_is_a_plateau_and_a_healthy_tail_is_not():
    rng = np.random.default_rng(8)
    t = np.arange(3000)
    # falls like a power law until step 1000, then learns nothing more
    y = np.where(t < 1000, 2 + 8 * (t + 1) ** -0.5, 2 + 8 * 1001 ** -0.5) * (1 + 0.01 * rng.standard_normal(len(t)))
    found = find_anomalies({"train/loss": points(t, y)})
    assert [f.kind for f in found] == ["plateau"]
    assert 700 <= found[0].step <= 1200 and found[0].value == pytest.approx(2.253, abs=0.02)
    assert "improved" in found[0].evidence
    t, y = power_law(8, n=3000, noise=0.01)
    assert find_anomalies({"train/loss": points(t, y)}) == []


def test_grad_norm_spikes_on_multiplicative_noise():
    rng = np.random.default_rng(9)
    t = np.arange(2000)
    g = (0.3 + 5 * np.exp(-t / 50)) * np.exp(0.15 * rng.standard_normal(len(t)))
    clean = points(t, g)
    g[[700, 1600]] *= 10
    found = find_anomalies({"grad_norm": points(t, g), "train/grad_norm_clean": clean})
    assert [(f.kind, f.key, f.step) for f in found] == [("grad_spike", "grad_norm", 700),
                                                        ("grad_spike", "grad_norm", 1600)]


def test_only_losses_and_grad_norms_are_judged():
    t, y = power_law(10)
    y[500] *= 5
    jumpy = points(t, y)
    metrics = {"loss_scale": jumpy, "lr": jumpy, "tokens_per_sec": jumpy, "eval/accuracy": jumpy}
    assert find_anomalies(metrics) == []
    assert [f.key for f in find_anomalies({"eval/lm_loss": jumpy})] == ["eval/lm_loss"]


def test_short_and_odd_curves_do_not_break():
    assert find_anomalies({"train/loss": [], "val/loss": [[0, 3.0]], "loss": [[0, 3.0, 1.0], [1, None, 2.0]]}) == [
        Finding("divergence", "loss", 1, None, None, "loss became nan at step 1 (last finite 3 at step 0)")]
    unsorted = points(*power_law(11, n=100))[::-1]
    assert find_anomalies({"train/loss": unsorted}) == []


def test_anomaly_summary_is_queryable_data():
    t, y = power_law(12)
    y[[1200, 1800]] *= 2.0
    y[1900] = np.nan
    found = find_anomalies({"train/loss": points(t, y)})
    summary = anomaly_summary(found)
    assert summary["loss_spike"]["count"] == 2
    assert summary["loss_spike"]["first_step"] == 1200 and summary["loss_spike"]["last_step"] == 1800
    assert summary["loss_spike"]["max_score"] == max(f.score for f in found if f.kind == "loss_spike")
    assert summary["divergence"] == {"count": 1, "first_step": 1900, "last_step": 1900, "max_score": None}
    assert anomaly_summary([]) == {}


def test_anomalies_are_stored_and_flattened(engine):
    from kb.models import Anomaly, RunField
    from kb.records import parse_run
    from kb.runs import write_run

    t, y = power_law(13)
    y[1200] *= 3
    record = parse_run({"name": "spiky", "metrics": {"train/loss": points(t, y)}})
    with Session(engine) as s, s.begin():
        _, run_id = write_run(s, record, "native", "test")
    with Session(engine) as s:
        rows = s.execute(select(RunField.key, RunField.num).where(RunField.run_id == run_id)
                         .where(RunField.key.like("anomalies.%"))).all()
        stored = s.execute(select(Anomaly.kind, Anomaly.step).where(Anomaly.run_id == run_id)).all()
    assert dict(rows)["anomalies.loss_spike.first_step"] == 1200
    assert stored == [("loss_spike", 1200)]


def test_many_points_are_handled():
    t, y = power_law(14, n=10_000)
    y[[2500, 7000]] *= 1.5
    found = find_anomalies({"train/loss": points(t, y), "grad_norm": points(t, np.abs(y) / 3)})
    assert [(f.kind, f.step) for f in found if f.key == "train/loss"] == [("loss_spike", 2500), ("loss_spike", 7000)]
    assert all(math.isfinite(f.score) for f in found)


@pytest.mark.parametrize("n", [10, 11, 12, 50, 51, 52, 200, 1001, 1100])
def test_noise_at_some_points_is_the_noise_everywhere_there(n):
    from kb.curves import _median, _median_at

    d2 = np.abs(np.random.default_rng(n).standard_normal(n)) ** 3
    d2[n // 3: n // 3 + 5] = 0.0                       # ties and a dead-flat stretch
    for size in (7, 51, 501):
        assert np.array_equal(_median_at(d2, size, np.arange(n)), _median(d2, size, "reflect"))


@pytest.mark.parametrize("seed", range(10))
def test_the_cheap_bound_never_clears_a_curve_the_full_noise_would_flag(seed):
    from kb.curves import _Rough

    t, y = power_law(seed, n=300, noise=0.01)
    rng = np.random.default_rng(seed)
    y[rng.integers(20, 280, 3)] *= 1 + rng.uniform(0.0, 0.08, 3)    # from invisible to just visible
    rough = _Rough(y)
    resid = y - rough.level
    z = resid / rough.noise()
    for threshold in (2.0, 4.0, 6.0, 8.0, 12.0):
        if rough.below(resid, threshold):
            assert (z <= threshold).all()
        elif (resid / rough.floor() > threshold).sum() * rough.window <= 4 * len(y):
            assert (z > threshold).any()                # few candidates: the answer is exact both ways


def test_arrays_from_the_shared_table_equal_the_point_by_point_ones():
    """Curves takes a curve's arrays from the float table the writer packs (kb.series) where the
    curve has one: the same arrays as converting point by point, ties kept in logged order."""
    from kb.curves import Curves, _arrays
    curves = {"flat": [(5, 2.0, 1.0), (3, 1.5, 2.0), (5, 1.0, 3.0), (1, math.nan, 4.0), (3, 0.5, 5.0)],
              "a None": [(2, 1.0), (1, None), (0, 3.0)],
              "big steps": [(2**53 + 1, 1.0), (7, 2.0)]}
    cv = Curves(curves)
    assert cv.table("flat") is not None and cv.table("a None") is not None and cv.table("big steps") is None
    for key, points in curves.items():
        steps, values = cv.arrays(key)
        want_steps, want_values = _arrays(points, None)
        assert steps.dtype == want_steps.dtype == np.int64
        assert steps.tolist() == want_steps.tolist() and np.array_equal(values, want_values, equal_nan=True)
    steps, values = cv.arrays("flat")
    assert steps.tolist() == [1, 3, 3, 5, 5] and values.tolist()[1:] == [1.5, 0.5, 2.0, 1.0]
    assert cv.arrays("big steps")[0].tolist() == [7, 2**53 + 1]
