"""Hypotheses through the queue and the experiment loop (runner/submit.py, runner/conclude.py,
runner/loop.py, kb submit HYP, kb loop): a proposal approved with `kb approve` runs its plan and
ends with a verdict; a clear gain is verified at a second scale; `kb loop` runs rounds on the
built-in corpus, keeps only verified gains, and a rerun repeats no configuration. Real tiny proxy
trainings on CPU (the inline backend: a subprocess's start-up would cost more than the training)."""
from __future__ import annotations

import json
import re
import statistics
import threading
import time

import pytest

from kb.cli import main
from kb.hypotheses import store
from kb.noise import metric_value

TINY = {"n_layer": 1, "seq_len": 32, "batch_size": 8, "max_steps": 40, "eval_interval": 20, "eval_batches": 2,
        "threads": 1, "checkpoint_interval": 0}


def cli(k, capsys, *args) -> tuple[int, str, str]:
    rc = main(["--home", str(k.settings.home), "--database-url", k.settings.database_url, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def sweep(k, project: str, lrs=(1e-3, 3e-3, 1e-2), seeds: int = 2, **over) -> None:
    for lr in lrs:
        k.submit(config={**TINY, **over, "lr": lr}, backend="inline", project=project, seeds=seeds)
    k.work(backend="inline")


def mean_metric(k, run_ids) -> float:
    return statistics.fmean(metric_value(k.run(r), "val/loss") for r in run_ids)


def test_an_approved_hypothesis_runs_its_plan_and_ends_with_a_verdict(kb, capsys):
    sweep(kb, "p")
    [h] = kb.propose(goal="lower val/loss", n=1, project="p", budget_runs=2)
    rc, _, err = cli(kb, capsys, "submit", h["id"], "--backend", "inline")
    assert rc == 2 and f"hypothesis {h['id']} is proposed, not approved: approve it first" in err
    rc, _, err = cli(kb, capsys, "approve", h["id"], "--by", "alice", "--reason", "cheap")
    assert rc == 0, err
    rc, out, err = cli(kb, capsys, "submit", h["id"], "--backend", "inline", "--json")
    assert rc == 0, err
    jobs = json.loads(out)
    seeds = h["plan"]["seeds"]
    assert len(jobs) == 2 * seeds and all(j["hypothesis"] == h["id"] for j in jobs)
    # the baseline run itself answers its own cell: not trained twice, its seed not counted twice
    reused = [j for j in jobs if j["status"] == "succeeded"]
    assert h["baseline_run"] in {j["run"] for j in reused}
    assert kb.hypothesis(h["id"])["status"] == "running"
    rc, _, err = cli(kb, capsys, "worker", "--once", "--backend", "inline")
    assert rc == 0, err
    done = kb.hypothesis(h["id"])
    assert done["status"] == "done"
    result = done["result"]
    assert all(j["status"] == "succeeded" for j in kb.jobs(hypothesis=h["id"]))
    [cell] = result["scales"]
    assert len(cell["baseline_runs"]) == len(cell["variant_runs"]) == seeds
    # the stored effect is the difference of the two sides' means, read back from the runs
    assert result["effect"]["delta"] == pytest.approx(mean_metric(kb, cell["variant_runs"])
                                                      - mean_metric(kb, cell["baseline_runs"]))
    low, high = result["effect"]["interval"]
    assert low < result["effect"]["delta"] < high and result["effect"]["method"] in ("welch-t", "pooled-t")
    assert result["outcome"] == ("inconclusive" if low <= 0 <= high else "better" if high < 0 else "worse")
    assert not result["verified"] and result["transfer"] is None          # one scale: nothing to verify it with
    [(key, lr)] = h["change"].items()
    for run_id in cell["variant_runs"]:
        run = kb.run(run_id)
        assert run.hypothesis == h["id"] and run.parent == h["baseline_run"] and "side:variant" in run.tags
        assert run.config["lr"] == lr and run.config["min_lr"] == pytest.approx(lr / 10)   # derived again
    rc, _, err = cli(kb, capsys, "submit", h["id"])
    assert rc == 2 and "has run and its result is stored" in err


def test_a_clear_gain_is_verified_at_a_second_scale(kb, capsys):
    sweep(kb, "v", lrs=(1e-5,), seeds=2)                        # a rate far too low to learn anything
    sweep(kb, "v", lrs=(1e-5,), seeds=2, n_layer=2)
    small, large = sorted({r.scale["params"] for r in kb.runs(project="v")})
    baseline = min(r.id for r in kb.runs(project="v") if r.config["n_layer"] == 1)
    [h] = store(kb.engine, [dict(id="hyp-lr-up", title="lr 1e-5 -> 3e-3", rationale="the sweep", baseline_run=baseline,
                                 change={"lr": 3e-3}, evidence=[baseline], status="proposed", project="v",
                                 predicted={"metric": "val/loss", "delta": -1.0, "interval": [-2.0, -0.5]},
                                 plan={"scales": [{"params": small}], "seeds": 2, "steps": 40})])
    kb.approve(h["id"], by="alice")
    kb.submit(h["id"], backend="inline")
    kb.work(backend="inline")
    first = kb.hypothesis(h["id"])["result"]
    assert first["outcome"] == "better" and not first["verified"] and first["effect"]["delta"] < -0.5
    rc, out, err = cli(kb, capsys, "submit", h["id"], "--scales", f"{large:g}", "--backend", "inline", "--json")
    assert rc == 0, err
    extra = [j for j in json.loads(out) if j["status"] == "queued"]
    assert len(extra) == 2 and {j["name"].split("-d2-")[0] for j in extra} == {"hyp-lr-up-variant"}   # the
    # baseline's two seeds at depth 2 are the sweep's runs
    kb.work(backend="inline")
    result = kb.hypothesis(h["id"])["result"]
    assert [s["params"] for s in result["scales"]] == [small, large]
    assert [s["outcome"] for s in result["scales"]] == ["better", "better"] and result["verified"]
    assert result["transfer"]["outcome"] in ("holds", "grows", "shrinks", "vanishes", "reverses", "inconclusive")
    assert set(result["transfer"]["evidence"]) == set(result["runs"]["baseline"]) | set(result["runs"]["variant"])
    deep = [kb.run(r) for r in result["scales"][1]["variant_runs"]]
    assert {(r.config["n_layer"], r.config["lr"]) for r in deep} == {(2, 3e-3)}    # the change carried as set


@pytest.mark.slow
def test_kb_loop_keeps_only_verified_gains_and_a_rerun_repeats_nothing(kb, capsys, tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**TINY, "lr": 1e-4}))      # a start too slow to learn much in 40 steps
    args = ["loop", "--project", "tl", "--config", str(config), "--approve", "auto", "--backend", "inline",
            "--budget-runs", "2", "--out", str(tmp_path / "reports"), "--json"]
    rc, out, err = cli(kb, capsys, *args, "--rounds", "3")
    assert rc == 0, err
    report = json.loads(out)
    assert len(report["rounds"]) == 3 or report["stopped"].startswith("proposals ran dry")
    started = [r.id for r in kb.runs(project="tl") if "loop:start" in r.tags]
    assert len(started) == 8 and len(report["starting_baseline"]) == 2
    done = {h["id"]: h for h in kb.hypotheses(project="tl")}
    assert {r["hypothesis"] for r in report["rounds"]} <= set(done)
    for r in report["rounds"]:
        h = done[r["hypothesis"]]
        assert h["status"] == "done" and h["decision"]["by"] == "kb loop (auto)" and "top-ranked" in h["decision"]["reason"]
    # kept means verified at two scales, and the report names nothing else as kept or best; from a
    # rate that slow, a higher one is a gain clear enough to verify
    assert report["kept"] and all(done[i]["result"]["verified"] for i in report["kept"])
    for i in report["kept"]:
        assert [s["outcome"] for s in done[i]["result"]["scales"]] == ["better", "better"]
    assert set(report["kept"]) | set(report["not_kept"]) == {i for i, h in done.items() if h["status"] == "done"}
    text = open(report["markdown"], encoding="utf-8").read()
    kept_section = text.split("## Kept (verified improvements)")[1].split("## Not kept")[0]
    assert set(re.findall(r"hyp-[0-9a-f]{10}", kept_section)) == set(report["kept"])
    best_section = text.split("## Best verified improvement over the starting baseline")[1]
    assert set(re.findall(r"hyp-[0-9a-f]{10}", best_section)) <= set(report["kept"])
    if report["best"]:
        assert report["best"]["hypothesis"] in report["kept"]
        if report["best"]["outcome"] == "better":
            assert set(report["best"]["baseline_runs"]) == set(report["starting_baseline"])
    for i in done:
        assert i in text.split("## What was tried")[1].split("## Kept")[0]
    # a rerun continues from the store: no second start, and no configuration tried twice
    rc, out, err = cli(kb, capsys, *args, "--rounds", "1")
    assert rc == 0, err
    again = json.loads(out)
    assert sorted(r.id for r in kb.runs(project="tl") if "loop:start" in r.tags) == sorted(started)
    hashes = [row.config_hash for row in _rows(kb, "tl")]
    assert len(hashes) == len(set(hashes)) == len(done) + len(again["rounds"])
    configs = [json.dumps({k: v for k, v in r.config.items() if k != "seed"}, sort_keys=True)
               for r in kb.runs(project="tl") if "side:variant" in r.tags and r.config["n_layer"] == 1]
    seeds_per_config = {c: configs.count(c) for c in configs}
    assert all(n <= 2 for n in seeds_per_config.values())      # each tried configuration ran once (2 seeds)


def test_manual_approval_waits_for_a_person_and_a_spent_budget_stops_the_loop(kb):
    decided = {}

    def person() -> None:
        """Rejects the first proposals it sees, then approves one of the next."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "approved" not in decided:
            for h in kb.hypotheses(status="proposed", project="m"):
                if "rejected" not in decided:
                    kb.reject(h["id"], by="bob", reason="not this one")
                    decided.setdefault("rejected", []).append(h["id"])
                elif h["id"] not in decided["rejected"]:
                    kb.approve(h["id"], by="alice")
                    decided["approved"] = h["id"]
                    break
            time.sleep(0.05)

    said = []
    thread = threading.Thread(target=person)
    thread.start()
    report = kb.loop(project="m", config=TINY, rounds=2, approve="manual", n=1, backend="inline", poll_s=0.1,
                     budget_runs=2, say=said.append, out=str(kb.settings.home / "reports"))
    thread.join()
    assert any(line.startswith("waiting for a decision: kb approve hyp-") for line in said)
    assert [r["hypothesis"] for r in report.rounds] == [decided["approved"]]
    assert kb.hypothesis(decided["approved"])["status"] == "done"
    assert all(kb.hypothesis(i)["status"] == "rejected" for i in decided["rejected"])
    spent = kb.loop(project="m", budget_hours=1e-9, backend="inline", say=said.append,
                    out=str(kb.settings.home / "reports"))
    assert spent.rounds == [] and spent.stopped.startswith("budget of 1e-09 h spent")


def _rows(k, project: str) -> list:
    from sqlalchemy import select
    from kb.models import Hypothesis
    with k.engine.connect() as conn:
        return conn.execute(select(Hypothesis.config_hash).where(Hypothesis.project == project)).all()
