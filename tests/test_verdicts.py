"""Noise-aware verdicts (kb.verdicts): compare, scale transfer and patterns across ablations, on runs
ingested through the real ingest path, on SQLite and Postgres."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from scipy import stats

from kb.errors import InsufficientData, NotFound, QueryError
from kb.verdicts import compare, higher_is_better, patterns, seed_noise, transfer


def run(rid, value, *, project="p", norm="layernorm", seed=0, metric="val/loss", params=None, **config):
    record = {"id": rid, "project": project, "config": {"model": {"norm": norm, **config}, "seed": seed},
              "summary": {metric: value} if value is not None else {}}
    if params:
        record["scale"] = {"params": params}
    if value is None:
        record["status"] = "diverged"
    return record


def seeds(prefix, values, **kw):
    return [run(f"{prefix}-{i}", v, seed=i, **kw) for i, v in enumerate(values)]


def ingest(kb, records):
    report = kb.ingest_records(records, index=False)
    assert not report.failed, report.failed
    return report


# ---- compare -----------------------------------------------------------------------------------

def test_gain_inside_seed_noise_is_inconclusive_and_a_clear_gain_is_better(kb):
    base = [3.00, 3.02, 3.01, 2.99]
    ingest(kb, seeds("ln", base) + seeds("rms", [2.90, 2.92, 2.91, 2.93], norm="rmsnorm")
           + seeds("tiny", [3.00, 2.99, 3.02, 2.98], norm="scalenorm"))
    clear = kb.compare("ln-0", "rms-2")              # each id stands for its seed group
    assert clear.outcome == "better" and clear.method == "welch-t"
    assert clear.baseline["runs"] == ["ln-0", "ln-1", "ln-2", "ln-3"] and clear.variant["n"] == 4
    # the interval is Welch's, as scipy computes it
    ref = stats.ttest_ind([2.90, 2.92, 2.91, 2.93], base, equal_var=False)
    ci = ref.confidence_interval(0.95)
    assert clear.delta == pytest.approx(2.915 - 3.005) and clear.noise.dof == pytest.approx(ref.df)
    assert clear.interval == pytest.approx((ci.low, ci.high))
    assert set(clear.evidence) == {f"ln-{i}" for i in range(4)} | {f"rms-{i}" for i in range(4)}
    within = compare(kb, "ln-0", "tiny-0")
    assert within.outcome == "inconclusive" and within.delta < 0       # a lower mean, but not a win
    assert within.interval[0] < 0 < within.interval[1]
    assert compare(kb, "rms-0", "ln-0").outcome == "worse"
    js = clear.to_json()
    assert js["outcome"] == "better" and js["noise"]["groups"] == [clear.baseline["runs"], clear.variant["runs"]]


def test_one_seed_borrows_the_projects_pooled_noise(kb):
    rep_a, rep_b = [3.10, 3.13, 3.07], [2.50, 2.52]          # seed groups elsewhere in the project
    ingest(kb, seeds("a", rep_a, norm="a") + seeds("b", rep_b, norm="b")
           + [run("one", 3.00), run("near", 2.99, norm="rmsnorm"), run("far", 2.80, norm="deepnorm")]
           + [run("other-project", 1.0, project="q", norm="x"), run("other-project-2", 5.0, project="q", norm="x",
                                                                    seed=1)])
    pooled = math.sqrt((statistics.variance(rep_a) * 2 + statistics.variance(rep_b)) / 3)
    near, far = compare(kb, "one", "near"), compare(kb, "one", "far")
    for v in (near, far):
        assert v.method == "pooled-t" and v.noise.sd == pytest.approx(pooled) and v.noise.dof == 3
        assert sorted(map(list, v.noise.groups)) == [["a-0", "a-1", "a-2"], ["b-0", "b-1"]]   # not project q's
        half = stats.t.ppf(0.975, 3) * pooled * math.sqrt(2)
        assert v.interval == pytest.approx((v.delta - half, v.delta + half))
    assert near.outcome == "inconclusive" and far.outcome == "better"
    assert compare(kb, "one", "far", level=0.999999).outcome == "inconclusive"   # a stricter level


def test_direction_comes_from_the_metric(kb):
    acc = dict(metric="val/accuracy")
    ingest(kb, seeds("base", [0.60, 0.61, 0.62], **acc) + seeds("new", [0.70, 0.71, 0.72], norm="rmsnorm", **acc))
    assert compare(kb, "base-0", "new-0", metric="val/accuracy").outcome == "better"
    assert compare(kb, "base-0", "new-0", metric="val/accuracy", higher=False).outcome == "worse"
    assert higher_is_better("eval_loss") is False and higher_is_better("val/ppl") is False
    assert higher_is_better("eval_accuracy") is True and higher_is_better("mfu") is True
    with pytest.raises(QueryError, match="higher or lower"):
        higher_is_better("widgets")


def test_diverged_seeds_are_left_out_and_named(kb):
    ingest(kb, seeds("base", [3.0, 3.02, 3.01]) + seeds("new", [2.8, None, 2.81], norm="rmsnorm"))
    v = compare(kb, "base-0", "new-0")
    assert v.without_metric == ("new-1",) and v.variant["runs"] == ["new-0", "new-2"]


def test_bad_and_degenerate_comparisons_are_errors(kb):
    ingest(kb, [run("a", 3.0), run("b", 2.9, norm="rmsnorm"), run("dead", None, norm="x")])
    with pytest.raises(InsufficientData, match="no seed noise .* project 'p'"):
        compare(kb, "a", "b")                            # no config was ever run with two seeds
    with pytest.raises(NotFound, match="nope"):
        compare(kb, "a", "nope")
    with pytest.raises(QueryError, match="both sides"):
        compare(kb, ["a", "b"], ["b"])
    with pytest.raises(InsufficientData, match="variant has no final val/loss"):
        compare(kb, "a", "dead")
    with pytest.raises(QueryError, match="level"):
        compare(kb, "a", "b", level=95)
    with pytest.raises(InsufficientData):
        seed_noise(kb, "p")


# ---- scale transfer ----------------------------------------------------------------------------

SCALES = (1e6, 3e6, 1e7)


def baseline_loss(n):
    return 1.8 + 20 * n ** -0.25          # a loss with an irreducible part


def scaled(gain, rng, noise=0.002, n_seeds=2):
    """Baseline and variant at three proxy scales, n_seeds each; variant = baseline + gain(N)."""
    records = []
    for side, f in (("base", baseline_loss), ("var", lambda n: baseline_loss(n) + gain(n))):
        for n in SCALES:
            records += [run(f"{side}-{n:g}-{s}", float(f(n) + rng.normal(0, noise)), seed=s, params=int(n),
                            norm=side, width=int(n)) for s in range(n_seeds)]
    return records


def sides(records):
    return [r["id"] for r in records if r["id"].startswith("base")], [r["id"] for r in records if r["id"].startswith("var")]


@pytest.mark.parametrize("gain, outcome, at_target", [
    (lambda n: -0.05 + 0 * n, "holds", -0.05),                             # a shift of the irreducible loss
    (lambda n: -0.3 * (n / 1e6) ** -0.5, "shrinks", -0.03),                # 0.3 at 1e6, 0.095 at 1e7
])
def test_scale_transfer_of_a_gain_known_to_hold_or_shrink(kb, gain, outcome, at_target):
    records = scaled(gain, np.random.default_rng(7))
    ingest(kb, records)
    base, var = sides(records)
    t = kb.transfer(base, var, target=1e8)
    assert t.outcome == outcome and t.at_target == "better"
    assert t.interval[0] <= at_target <= t.interval[1]                      # the truth at 1e8 is covered
    assert t.delta == pytest.approx(at_target, abs=0.01)
    assert t.proxy["scale"] == 1e7 and t.proxy["delta"] == pytest.approx(gain(1e7), abs=0.006)
    assert sorted(t.evidence) == sorted(base + var)
    assert t.to_json()["points"][0]["baseline_runs"] == ["base-1e+06-0", "base-1e+06-1"]


def test_a_gain_that_decays_fast_vanishes_at_scale(kb):
    records = scaled(lambda n: -0.1 * (n / 1e6) ** -1.0, np.random.default_rng(3), noise=0.004)
    ingest(kb, records)
    t = transfer(kb, *sides(records), target=1e9)       # -0.1 at 1e6, -0.01 at 1e7, -1e-4 at 1e9
    assert t.outcome == "vanishes" and t.at_target in ("inconclusive", "better")
    assert abs(t.delta) < t.noise.sd


def test_one_shared_scale_is_not_a_trend(kb):
    records = scaled(lambda n: -0.05 + 0 * n, np.random.default_rng(0))
    ingest(kb, records)
    base, var = sides(records)
    with pytest.raises(InsufficientData, match="share 1 scale"):
        transfer(kb, base, [v for v in var if "1e+07" in v], target=1e8)
    with pytest.raises(QueryError, match="target"):
        transfer(kb, base, var, target=-1)


# ---- patterns ----------------------------------------------------------------------------------

def test_a_factor_ablated_in_five_projects_is_a_pattern_with_its_record(kb):
    effects = {"p1": -0.06, "p2": -0.05, "p3": -0.04, "p4": -0.07, "p5": +0.002}     # p5: within noise
    records = []
    for project, effect in effects.items():
        n_layer = int(project[1]) + 2           # each project at its own scale
        for s, e in enumerate((-0.005, 0.005)):
            records.append(run(f"{project}-ln-{s}", 3.0 + e, project=project, seed=s, n_layer=n_layer))
            records.append(run(f"{project}-rms-{s}", 3.0 + effect - e, project=project, norm="rmsnorm", seed=s,
                               n_layer=n_layer))
    # p3 ran it the other way round: rmsnorm is its baseline (tagged so)
    for r in records:
        if r["project"] == "p3" and r["config"]["model"]["norm"] == "rmsnorm":
            r["tags"] = ["baseline"]
    records.append(run("p1-lr", 2.9, project="p1", norm="layernorm", seed=0, n_layer=3, lr=1e-3))   # a lone ablation
    ingest(kb, records)
    [norm] = [p for p in kb.patterns() if p.factor == "norm"]
    assert (norm.baseline_level, norm.level) == ("layernorm", "rmsnorm")
    assert (norm.better_in, norm.worse_in, norm.of) == (4, 0, 5)
    deltas = list(effects.values())
    assert norm.effect == pytest.approx(statistics.fmean(deltas)) and norm.spread == pytest.approx(statistics.stdev(deltas))
    assert norm.record == f"better in 4 of 5, effect {statistics.fmean(deltas):+.3f} ± {statistics.stdev(deltas):.3f}"
    by_project = {i["project"]: i for i in norm.instances}
    assert by_project["p5"]["outcome"] == "inconclusive" and by_project["p3"]["outcome"] == "better"
    assert by_project["p3"]["baseline_runs"] == ["p3-ln-0", "p3-ln-1"]       # seen from layernorm, like the rest
    # every instance cites an ablation that exists and holds its runs
    for inst in norm.instances:
        held = {a["id"]: a for a in kb.run(inst["baseline_runs"][0]).ablations}
        assert inst["ablation"] in held
        members = {rid for v in held[inst["ablation"]]["variants"] for rid in v["runs"]}
        assert set(inst["baseline_runs"] + inst["variant_runs"]) == members
    assert set(norm.evidence) >= {i["ablation"] for i in norm.instances}
    assert not [p for p in patterns(kb) if p.factor == "lr"]                 # one instance is no pattern
    assert [p.factor for p in patterns(kb, min_instances=1)].count("lr") == 1
    assert norm.to_json()["record"] == norm.record
