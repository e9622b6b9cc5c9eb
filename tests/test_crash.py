"""Crashes: `kill -9` of a real `kb ingest` at random points of its writing and of its indexing, on
SQLite and Postgres. Afterwards the store is consistent (SQLite's integrity check passes; every run
is complete or absent, with all its curve points and fields, and queued for indexing), the next
ingest finishes the job, and the next open (or `kb reindex`, also after the index folder was
overwritten with garbage) makes the vector index equal to SQL: the same ids with the same hashes.

    pytest tests/test_crash.py -q          # KB_TEST_DATABASE_URL=postgresql://... for Postgres too
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from kb.api import KnowledgeBase
from kb.indexer import expected_fingerprints
from kb.models import IndexPending, MetricSeries, Run, RunField

pytestmark = pytest.mark.slow
KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")
RUNS = 300
# `kb ingest` with commits every 20 ms rather than every second: on a fast machine the default
# would store all RUNS in one commit, leaving no moment between commits for the kill to land in
OFTEN = ("import sys; from kb.db import WriteBatch; WriteBatch.BATCH_SECONDS = 0.02; "
         "from kb.cli import run; sys.argv[0] = 'kb'; run()")


def records(n: int = RUNS) -> list[dict]:
    rng = random.Random(0)
    return [{"id": f"r{i:04d}", "project": f"p{i % 3}", "name": f"run {i}",
             "config": {"optim": {"lr": rng.choice([1e-4, 3e-4, 1e-3])}, "model": {"n_layer": rng.choice([4, 8])},
                        "seed": i % 2},
             "metrics": {"train/loss": [[s, 10 / (1 + s) + rng.random()] for s in range(0, 400, 10)],
                         "val/loss": [[s, 9 / (1 + s) + rng.random()] for s in range(0, 400, 100)]},
             "notes": f"run {i} of the crash sweep"} for i in range(n)]


@pytest.fixture
def store(tmp_path, database_url):
    """KB_HOME with its SQLite inside (the embedded default), or Postgres; the records on disk."""
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    env.pop("KB_DATABASE_URL", None)
    if not database_url.startswith("sqlite"):
        env["KB_DATABASE_URL"] = database_url
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    from kb.settings import Settings
    settings = Settings(home=tmp_path / "home", database_url=env.get("KB_DATABASE_URL"))
    return env, path, settings


def count(engine, table) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def kill_when(proc: subprocess.Popen, ready, rng: random.Random, timeout: float = 600,
              delay: float = 0.5) -> bool:
    """SIGKILL `proc` a random moment (0-`delay` s) after `ready()` first holds; False if it ended first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            hit = ready()
        except Exception:           # noqa: BLE001 - the schema may not exist yet: not ready
            hit = False
        if hit:
            time.sleep(rng.uniform(0, delay))
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return True


def assert_consistent(settings, source: list[dict]) -> set[str]:
    """SQLite's own check, then every stored run exactly as its record (all points), no row of a run
    that is not stored, and every stored run either indexed or queued for it. Returns the ids."""
    if not settings.database_url:
        db = sqlite3.connect(settings.home / "kb.sqlite")
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        db.close()
    by_id = {r["id"]: r for r in source}
    with KnowledgeBase.open(settings) as k:
        stored = {r.id for r in k.runs()}
        assert stored <= set(by_id)
        for rid in stored:
            run = k.run(rid)
            want = by_id[rid]
            assert run.config == want["config"]
            assert {key: len(points) for key, points in run.metrics.items()} == \
                   {key: len(points) for key, points in want["metrics"].items()}
        with k.engine.connect() as conn:
            for table in (MetricSeries, RunField):
                orphans = conn.execute(select(func.count()).select_from(table)
                                       .where(table.run_id.not_in(select(Run.id)))).scalar_one()
                assert orphans == 0, table
            queued = set(conn.execute(select(IndexPending.ref_id).where(IndexPending.kind == "run")).scalars())
        indexed = {pid.split(":", 1)[1] for pid in _indexed(settings)}
        assert stored <= queued | indexed           # nothing stored that nobody will index
    return stored


def _indexed(settings) -> set[str]:
    """What the index holds, read from a copy: opening the index itself would index what is queued."""
    from kb.embed import embedding_dim
    from kb.vectors import open_index_copy
    if not (settings.qdrant_path / settings.collection).exists():
        return set()
    copy = open_index_copy(settings, embedding_dim(settings.embedding_model))
    try:
        return set(copy.fingerprints())
    finally:
        copy.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_during_ingest_leaves_runs_complete_or_absent(store, seed):
    env, path, settings = store
    rng = random.Random(seed)
    target = rng.randint(1, RUNS * 2 // 3)
    from kb.db import make_engine
    engine = make_engine(settings.sql_url)
    proc = subprocess.Popen([sys.executable, "-c", OFTEN, "ingest", str(path), "--no-index"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        killed = kill_when(proc, lambda: count(engine, Run) >= target, rng, delay=0.05)
    finally:
        engine.dispose()
    assert killed, f"ingest ended before {target} runs were stored: {proc.stderr.read()[-500:]!r}"
    source = records()
    stored = assert_consistent(settings, source)
    again = subprocess.run([KB, "ingest", str(path), "--no-index", "--json"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["unchanged"] == len(stored) and report["added"] == RUNS - len(stored)
    assert assert_consistent(settings, source) == {r["id"] for r in source}


def test_kill_during_indexing_then_next_open_and_reindex_restore_the_index(store):
    env, path, settings = store
    rng = random.Random(7)
    small = records(150)
    path.write_text("".join(json.dumps(r) + "\n" for r in small))
    assert subprocess.run([KB, "ingest", str(path), "--no-index"], env=env, capture_output=True).returncode == 0
    from kb.db import make_engine
    engine = make_engine(settings.sql_url)
    try:
        # 1. killed while `kb ingest` indexes (after its first batch of vectors is in)
        proc = subprocess.Popen([KB, "ingest", str(path)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        assert kill_when(proc, lambda: 0 < count(engine, IndexPending) < len(small), rng)
        assert_consistent(settings, small)
        with KnowledgeBase.open(settings) as k:       # the next open indexes what is left
            assert k.index.fingerprints() == expected_fingerprints(k.engine)
            assert k.pending_index() == 0

        # 2. the index folder overwritten with garbage, then `kb reindex` killed half-way
        shard = settings.qdrant_path / settings.collection
        for p in shard.rglob("*"):
            if p.is_file():
                p.write_bytes(rng.randbytes(max(p.stat().st_size // 2, 16)))
        proc = subprocess.Popen([KB, "reindex"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert kill_when(proc, lambda: 0 < count(engine, IndexPending) < len(small), rng)
        with KnowledgeBase.open(settings) as k:
            assert k.index.fingerprints() == expected_fingerprints(k.engine)

        # 3. garbage again, and `kb reindex` to the end
        for p in shard.rglob("*"):
            if p.is_file():
                p.write_bytes(rng.randbytes(64))
        done = subprocess.run([KB, "reindex", "--json"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        # every record is a point: the runs, and their failures and ablations
        assert json.loads(done.stdout) == {"indexed": len(expected_fingerprints(engine))} and len(small) < \
            len(expected_fingerprints(engine))
        with KnowledgeBase.open(settings) as k:
            assert k.index.fingerprints() == expected_fingerprints(k.engine)
            assert len(k.search("crash sweep run 42", limit=3)) == 3
    finally:
        engine.dispose()
