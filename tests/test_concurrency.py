"""Concurrent writers: 8 real `kb ingest` processes into one project at once, on SQLite and on
Postgres. Every process exits 0, every run is stored once, and the project's ablations (rows,
members, the `ablations.*` fields runs are queried by) equal a recomputation from scratch.

Each writer ingests its share of the runs, then re-ingests part of it changed (other lrs,
other losses, a tag), so runs join and leave ablations that other writers are filling too.

    pytest tests/test_concurrency.py -q
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")
WRITERS = 8
RUNS = 600
WIDTHS = (256, 384, 512, 768, 1024)
LRS = (1e-4, 3e-4, 6e-4, 1e-3, 2e-3, 3e-3)
MIXES = ("web", "web+code", "code", "books", "wiki")


def record(i: int, changed: bool = False) -> dict:
    """Run i: one of 150 configurations (width x lr x mix), seed i // 150; a changed run moves to
    another lr (joining that lr's ablations) and gets another loss and a tag."""
    c = i % 150
    width, lr, mix = WIDTHS[c % 5], LRS[(c // 5) % 6], MIXES[c // 30]
    if changed:
        lr = LRS[((c // 5) + 1) % 6]
    loss = 3.0 + 0.1 * WIDTHS.index(width) - 0.05 * LRS.index(lr) + 0.01 * (i // 150) + (0.3 if changed else 0)
    tags = ["ablation:recipe"] if c < 10 or changed else []
    return {"id": f"r{i:04d}", "project": "p", "name": f"run {i}", "tags": tags,
            "config": {"model": {"d_model": width}, "optim": {"lr": lr}, "data": {"mix": mix},
                       "seed": i // 150},
            "metrics": {"val/loss": [[0, 9.0], [100, loss]]}}


@pytest.mark.slow
def test_eight_concurrent_writers_lose_nothing_and_leave_exact_ablations(tmp_path, database_url, engine):
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")
    scripts = []
    for w in range(WRITERS):
        mine = range(w, RUNS, WRITERS)
        first, second = tmp_path / f"w{w}-a.jsonl", tmp_path / f"w{w}-b.jsonl"
        first.write_text("".join(json.dumps(record(i)) + "\n" for i in mine))
        second.write_text("".join(json.dumps(record(i, changed=True)) + "\n" for i in mine if i % 5 == 0))
        scripts.append(f'"{KB}" ingest "{first}" --no-index --json && "{KB}" ingest "{second}" --no-index --json')
    # the schema exists already (the engine fixture migrated it): the writers race on runs only
    procs = [subprocess.Popen(["bash", "-c", s], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for s in scripts]
    outs = [p.communicate(timeout=600) for p in procs]
    failed = [(p.returncode, _cause(err)) for p, (_, err) in zip(procs, outs) if p.returncode != 0]
    assert failed == [], failed
    reports = [documents(out) for out, _ in outs]
    assert sum(r[0]["added"] for r in reports) == RUNS
    assert sum(r[1]["updated"] for r in reports) == RUNS // 5
    assert all(not r[0]["failed"] and not r[1]["failed"] for r in reports)

    from kb.models import Run
    with engine.connect() as conn:
        assert conn.execute(select(Run.id)).scalars().all().__len__() == RUNS
    stored = ablation_state(engine, "p")
    assert len(stored["ablations"]) > 80 and stored["fields"]      # the data really has ablations
    # every run is in its width, lr and mix ablations (the changed ones in the tag ablation too)
    members = {rid for a in stored["ablations"].values() for v in a["variants"] for rid in v["runs"]}
    assert len(members) == RUNS
    fresh = recomputed(engine, "p")
    assert stored == fresh


def _cause(stderr: str) -> str:
    """The line of a traceback that says what went wrong (the driver's error), else the last."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if "Error)" in ln or "Error:" in ln), lines[-1] if lines else "")[:300]


def documents(text: str) -> list:
    """The JSON documents printed one after another (`kb ingest --json` indents its report)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        doc, at = decoder.raw_decode(text, len(text) - len(text[at:].lstrip()))
        out.append(doc)
    return out


def ablation_state(engine, project: str) -> dict:
    """What a project's ablations left in SQL, less the time each was written."""
    from kb.ablation_store import snapshot
    with engine.connect() as conn:
        return snapshot(conn, project)


def recomputed(engine, project: str) -> dict:
    """The same after recomputing the project from scratch."""
    from kb.ablation_store import rebuild
    with engine.begin() as conn:
        rebuild(conn, project)
    return ablation_state(engine, project)
