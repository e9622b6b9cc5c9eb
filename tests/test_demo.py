"""`kb demo` (kb/cli/demo.py, kb/cli/demo_build.py, runner/demo_history.py): the history shipped
with the package holds what issue 11 lists, a second `kb demo` adds nothing, `--fresh` trains the
history again through the real proxy trainer (a few steps a run, KB_DEMO_STEPS), and a plain
`kb demo` serves the UI and the API over it until SIGTERM."""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from kb.cli import main
from kb.cli.demo_build import PROJECT, MIX_PROJECT, SHIPPED, history_files

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")


def read_records(folder: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (folder / "runs.jsonl").read_text().splitlines())}


def demo_json(home: Path, capsys, *args) -> dict:
    rc = main(["--home", str(home), "demo", "--json", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


# ---- the shipped history ----------------------------------------------------------------------

def test_the_shipped_history_holds_what_the_issue_lists(kb):
    records = read_records(SHIPPED)
    assert all("demo" in r["tags"] for r in records.values())
    assert all(r["meta"]["runner"]["threads"] == 1 for r in records.values())      # trained by runner.train
    report = kb.ingest(*map(str, history_files(SHIPPED)), index=False)
    assert not report.failed and report.added == len(records) + kb.count()["notes"]

    # the highest rate diverged for real at both depths, with the trainer's failure record
    diverged = kb.runs(where="status = 'diverged'", sort="config.n_layer")
    assert [(r.project, r.config["n_layer"], r.config["lr"]) for r in diverged] == [(PROJECT, 1, 1.0), (PROJECT, 2, 1.0)]
    for r in diverged:
        [failure] = kb.run(r.id).failures
        assert failure["kind"] == "diverged" and 0 < failure["step"] < r.config["max_steps"]
        assert "train/loss" in failure["message"]
    # a sweep at two scales: every lower rate finished, with its own parameter count per depth
    sweep = kb.runs(where=f"project = '{PROJECT}' and tags.lr-sweep exists and status = 'completed'")
    assert {r.config["n_layer"] for r in sweep} == {1, 2} and len({r.scale["params"] for r in sweep}) == 2
    assert len(sweep) >= 8

    # the ablation: pos learned vs rope, three seeds a side, judged against the seeds' spread
    [ablation] = [a for a in kb.run("d1-rope-s0").ablations if a["factor"] == "config.pos"]
    sides = {v["value"]: v for v in ablation["variants"]}
    assert set(sides) == {"learned", "rope"} and all(v["seeds"] == 3 for v in sides.values())
    assert ablation["baseline_run"].startswith("d1-lr0.003")
    assert sides["rope"]["exceeds_seed_spread"] is True and sides["rope"]["delta"] < 0
    verdict = kb.compare("d1-lr0.003", "d1-rope-s0")
    assert verdict.method == "welch-t" and verdict.baseline["n"] == verdict.variant["n"] == 3
    assert verdict.outcome == "better"          # the interval is all below zero

    # the mixture variation, in its own project: a mixture law fits it
    mixes = kb.runs(project=MIX_PROJECT)
    assert len({r.config["data"]["mixture"]["prose"] for r in mixes}) == 5
    fit = kb.mixture_fit(MIX_PROJECT)
    assert set(fit.sources) == {"prose", "code"} and len(fit.runs) == 5

    # the notes, written from the runs, and linked to the runs they name
    notes = {p.name: p.read_text() for p in (SHIPPED / "notes").glob("*.md")}
    assert set(notes) == {"postmortem-lr1-divergence.md", "sweep-summary.md"}
    for run_id in ("d1-lr1", "d2-lr1"):
        step = records[run_id]["failure"]["step"]
        assert f"`{run_id}`" in notes["postmortem-lr1-divergence.md"]
        assert f"diverged at step {step} " in notes["postmortem-lr1-divergence.md"]
    assert f"{records['d2-lr0.001']['summary']['val/loss']:.3f}" in notes["sweep-summary.md"]


# ---- kb demo --no-serve: built once, then again -------------------------------------------------

@pytest.mark.slow
def test_demo_twice_adds_nothing_the_second_time(tmp_path, capsys):
    home = tmp_path / "home"
    first = demo_json(home, capsys)
    n_runs = len(read_records(SHIPPED))
    assert first["ingest"]["added"] > n_runs and not first["ingest"]["failed"]
    assert first["diverged"] == ["d1-lr1", "d2-lr1"]
    assert first["projects"][MIX_PROJECT] == 5 and first["projects"][PROJECT] >= n_runs - 5   # + the job's runs
    assert any(a["factor"] == "config.pos" for a in first["ablations"])
    assert len(first["hypotheses"]) >= 2
    job = first["job"]
    assert job["status"] == "done" and job["result"]["outcome"] in ("better", "worse", "inconclusive")
    statuses = {h["id"]: h["status"] for h in first["hypotheses"]}
    assert statuses[job["hypothesis"]] == "done" and "proposed" in statuses.values()
    assert first["search"] and first["timings"]["load"] > 0

    second = demo_json(home, capsys)
    assert second["ingest"]["added"] == second["ingest"]["updated"] == 0
    assert second["ingest"]["unchanged"] == first["ingest"]["added"]
    assert second["counts"]["runs"] == first["counts"]["runs"]
    assert second["hypotheses"] == [{**h, "status": statuses[h["id"]]} for h in first["hypotheses"]]
    assert second["job"]["jobs"] == job["jobs"] and second["job"]["result"] == job["result"]


@pytest.mark.slow
def test_fresh_trains_the_history_again_with_the_proxy_trainer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KB_DEMO_STEPS", "8")
    home = tmp_path / "home"
    out = demo_json(home, capsys, "--fresh")
    trained = home / "demo_history"
    records = read_records(trained)
    assert set(records) == set(read_records(SHIPPED))           # the same runs, trained again here
    completed = [r for r in records.values() if r["status"] == "completed"]
    assert completed and all(r["summary"]["steps"] == 8 == r["config"]["max_steps"] for r in completed)
    assert {r["id"] for r in records.values() if r["status"] == "diverged"} == {"d1-lr1", "d2-lr1"}
    assert out["diverged"] == ["d1-lr1", "d2-lr1"]
    assert out["ingest"]["added"] > len(records) and out["timings"]["train"] > 0
    assert (trained / "notes" / "postmortem-lr1-divergence.md").exists()
    # what was loaded is the home's history, not the package's: its source is the home's file
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    with KnowledgeBase.open(Settings(home=home)) as k:
        assert k.run("d1-lr0.001").summary["steps"] == 8
    assert out["job"] is None or out["job"]["status"] == "done"


@pytest.mark.slow
def test_plain_demo_serves_the_ui_until_sigterm(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    env.pop("KB_DATABASE_URL", None)
    env.pop("KB_DEMO_STEPS", None)
    proc = subprocess.Popen([KB, "--home", str(tmp_path / "home"), "demo", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        url = None
        while url is None:
            try:
                line = lines.get(timeout=400)
            except queue.Empty:
                pytest.fail("kb demo printed no URL:\n" + "".join(err))
            if line.startswith("open http"):
                url = line.split()[1]
        assert url.endswith("/ui/")
        with urllib.request.urlopen(url, timeout=60) as page:
            assert page.status == 200 and "<html" in page.read(2000).decode().lower()
        base = url.removesuffix("/ui/")
        with urllib.request.urlopen(f"{base}/api/runs?project={PROJECT}", timeout=60) as resp:
            runs = json.loads(resp.read())
        assert {"d1-lr1", "d2-lr1", "d1-rope-s0"} <= {r["id"] for r in runs}
        assert any(line.startswith("[") and "loading the package's demo history" in line for line in err)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, "".join(err)
