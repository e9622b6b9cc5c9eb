"""Ablations found on ingest: one-key differences, seed spread, tag ablations; shown and queryable."""
from __future__ import annotations

import json


def run(rid, final, *, norm="layernorm", lr=6e-4, seed=0, tags=(), project="p", extra=None):
    cfg = {"model": {"n_layer": 4, "norm": norm}, "optim": {"lr": lr}, "seed": seed} | (extra or {})
    return {"id": rid, "project": project, "config": cfg, "tags": list(tags),
            "metrics": {"val/loss": [[0, 9.0], [100, final]]}}


def ingest(kb, tmp_path, records):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return kb.ingest(str(path), index=False)


def test_one_key_difference_with_seeds_is_an_ablation_with_spread(kb, tmp_path):
    records = [run(f"ln-{s}", 3.00 + 0.01 * s, seed=s, tags=["baseline"]) for s in range(3)]
    records += [run(f"rms-{s}", 2.90 + 0.01 * s, norm="rmsnorm", seed=s) for s in range(3)]
    records += [run("tiny-gain", 2.995, norm="scalenorm")]
    ingest(kb, tmp_path, records)
    detail = kb.run("rms-1")
    [abl] = [a for a in detail.ablations if a["factor"] == "config.model.norm"]
    assert abl["baseline_run"] == "ln-0" and abl["metric"] == "val/loss"
    by_value = {v["value"]: v for v in abl["variants"]}
    assert by_value["layernorm"]["baseline"] and by_value["layernorm"]["seeds"] == 3
    assert abs(by_value["rmsnorm"]["delta"] - (-0.10)) < 1e-9
    assert abs(abl["effect"]["seed_sigma"] - 0.01) < 1e-9
    assert by_value["rmsnorm"]["exceeds_seed_spread"] is True       # 0.10 > 2 sigma
    assert by_value["scalenorm"]["exceeds_seed_spread"] is False    # 0.005 is inside the noise
    assert abl["effect"]["best"] == "rms-0"
    found = {r.id for r in kb.runs(where="ablations.norm.role = 'variant' and ablations.norm.exceeds_seed_spread = true")}
    assert found == {"rms-0", "rms-1", "rms-2"}
    assert {r.id for r in kb.runs(where="ablations.norm.delta < 0")} == {"rms-0", "rms-1", "rms-2", "tiny-gain"}


def test_two_key_difference_is_not_a_single_factor_ablation(kb, tmp_path):
    ingest(kb, tmp_path, [run("a", 3.0), run("b", 2.9, norm="rmsnorm", lr=1e-3)])
    assert kb.run("a").ablations == []
    assert kb.runs(where="ablations exists") == []


def test_tagged_runs_form_an_ablation_even_when_several_keys_differ(kb, tmp_path):
    records = [run("base", 3.0, tags=["ablation:recipe", "baseline"]),
               run("new", 2.8, norm="rmsnorm", lr=1e-3, tags=["ablation:recipe"])]
    ingest(kb, tmp_path, records)
    [abl] = kb.run("new").ablations
    assert abl["factor"] == "recipe" and abl["baseline_run"] == "base"
    new = next(v for v in abl["variants"] if v["run"] == "new")
    assert new["value"] == {"model.norm": "rmsnorm", "optim.lr": 1e-3}
    assert abs(new["delta"] + 0.2) < 1e-9
    assert {r.id for r in kb.runs(where="ablations.recipe.role = 'variant'")} == {"new"}


def test_ablations_follow_updates_and_stay_per_project(kb, tmp_path):
    ingest(kb, tmp_path, [run("x1", 3.0), run("x2", 2.9, lr=1e-3), run("y1", 3.0, project="other")])
    assert len(kb.run("x1").ablations) == 1 and kb.run("y1").ablations == []
    ingest(kb, tmp_path, [run("x1", 3.0), run("x2", 2.9, lr=1e-3, norm="rmsnorm"), run("y1", 3.0, project="other")])
    assert kb.run("x1").ablations == []
