"""SQL -> vector index: ingest indexes, a lost index is rebuilt on open, reindex works, writers
never need the index (another process holding it leaves the runs pending, then indexed)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from kb.api import KnowledgeBase
from kb.errors import IndexBusy, IndexDamaged

RUNS = [
    {"id": "lr-3e-3", "project": "p", "name": "lr 3e-3 diverged", "status": "diverged",
     "config": {"optim": {"lr": 3e-3}}, "failure": {"kind": "diverged", "step": 1200, "message": "loss is NaN"},
     "notes": "loss exploded to NaN right after warmup"},
    {"id": "lr-3e-4", "project": "p", "name": "lr 3e-4 baseline", "config": {"optim": {"lr": 3e-4}},
     "summary": {"val/loss": 3.1}, "notes": "stable baseline, smooth curve"},
    {"id": "data-mix", "project": "q", "name": "code-heavy data mixture", "config": {"data": {"code": 0.4}},
     "notes": "more code in the mixture improved humaneval"},
]


# every record is a point: the 3 runs, the diverged run's failure, and project p's lr ablation
POINTS = 5


def write(tmp_path, runs=RUNS):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return str(path)


def top(k, text, **filters):
    return [h.payload["ref_id"] for h in k.search(text, limit=3, **filters)]


def test_ingest_indexes_and_search_finds_by_meaning(kb, tmp_path):
    kb.ingest(write(tmp_path))
    assert kb.pending_index() == 0
    assert top(kb, "which run blew up with NaN loss?")[0] == "lr-3e-3"
    assert top(kb, "data mixture with more code")[0] == "data-mix"
    assert top(kb, "NaN loss", project="q") == ["data-mix"]


def test_failures_and_ablations_are_points_of_their_own(kb, tmp_path):
    kb.ingest(write(tmp_path))
    assert kb.index.count() == POINTS
    failure = kb.search("the loss went NaN", limit=1, kind="failure")[0].payload
    assert failure["kind"] == "failure" and failure["project"] == "p" and failure["status"] == "diverged"
    assert failure["ref_id"] == str(kb.run("lr-3e-3").failures[0]["id"])
    ablation = kb.search("learning rate varied, val/loss compared", limit=1, kind="ablation")[0].payload
    assert ablation["ref_id"] == kb.run("lr-3e-4").ablations[0]["id"]
    # the run rewritten: its failure's new row replaces the old point, no stale one stays
    changed = [dict(RUNS[0], failure={"kind": "diverged", "step": 900, "message": "grad norm inf"})]
    kb.ingest(write(tmp_path, changed))
    from kb.indexer import expected_fingerprints
    assert kb.index.fingerprints() == expected_fingerprints(kb.engine) and kb.index.count() == POINTS


def test_search_within_a_query(kb, tmp_path):
    """`where` intersects the query language with the vector hits: only matching runs come back."""
    kb.ingest(write(tmp_path))
    assert top(kb, "which run blew up with NaN loss?", where="status != 'diverged'")[0] != "lr-3e-3"
    assert set(top(kb, "loss", where="lr <= 3e-4 or project = 'q'")) == {"lr-3e-4", "data-mix"}
    assert top(kb, "loss", where="lr > 1") == []
    assert top(kb, "loss", where="status = 'diverged'", kind="note") == []


def test_deleted_index_folder_is_rebuilt_on_open(settings, tmp_path):
    with KnowledgeBase.open(settings) as k:
        k.ingest(write(tmp_path))
        assert k.index.count() == POINTS
    shutil.rmtree(settings.home / "qdrant")
    with KnowledgeBase.open(settings) as k:
        assert k.index.count() == POINTS       # opening the index reconciled it with SQL
        assert k.pending_index() == 0
        assert top(k, "exploded to NaN")[0] == "lr-3e-3"


def test_reindex_rebuilds_from_sql(kb, tmp_path):
    kb.ingest(write(tmp_path))
    report = kb.reindex()
    assert report.indexed == POINTS and kb.index.count() == POINTS
    assert top(kb, "smooth stable baseline")[0] == "lr-3e-4"


def test_changed_run_updates_its_vector(kb, tmp_path):
    kb.ingest(write(tmp_path))
    changed = [dict(RUNS[2], notes="tokenizer bug: loss exploded to NaN at step 10")]
    report = kb.ingest(write(tmp_path, changed))
    assert report.updated == 1 and kb.index.count() == POINTS
    assert set(top(kb, "tokenizer bug")[:1]) == {"data-mix"}


def test_writers_work_while_another_process_holds_the_index(settings, tmp_path):
    """A real second process holds the embedded index; ingest commits SQL and leaves it pending."""
    if settings.qdrant_url:
        return
    settings.home.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kb.settings import Settings
        from kb.vectors import open_index
        idx = open_index(Settings(home={str(settings.home)!r}, database_url={settings.database_url!r}), 384)
        print("held", flush=True)
        sys.stdin.readline()
        idx.close()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with KnowledgeBase.open(settings) as k:
            report = k.ingest(write(tmp_path))
            assert report.added == 3 and report.pending_index == 4     # the runs and the ablation
            assert len(k.runs()) == 3
    finally:
        holder.communicate("\n", timeout=60)
    with KnowledgeBase.open(settings) as k:       # the next holder indexes what is pending
        assert k.index.count() == POINTS and k.pending_index() == 0


def test_cli_ingest_of_unchanged_runs_restores_a_deleted_index(settings, tmp_path):
    import os
    env = dict(os.environ, KB_HOME=str(settings.home), KB_DATABASE_URL=settings.database_url)
    kb_bin = shutil.which("kb") or str(__import__("pathlib").Path(sys.executable).parent / "kb")
    path = write(tmp_path)
    subprocess.run([kb_bin, "ingest", path], env=env, check=True, capture_output=True)
    shutil.rmtree(settings.home / "qdrant")
    out = subprocess.run([kb_bin, "ingest", path, "--json"], env=env, check=True, capture_output=True, text=True)
    assert json.loads(out.stdout)["unchanged"] == 3
    with KnowledgeBase.open(settings) as k:
        assert k.pending_index() == 0 and k._open_index().count() == POINTS


# ---- a damaged index (finding 9), readers beside a holder (finding 15) --------------------------

def _segment_files(root, name):
    return [p for p in (root / "segments").rglob(name) if p.is_file()]


def _garbage(path, seed=0):
    import random
    path.write_bytes(random.Random(seed).randbytes(max(path.stat().st_size, 64)))


DAMAGE = {
    # the engine's config unreadable
    "config-garbage": lambda root: _garbage(root / "edge_config.json"),
    # truncated storage headers: qdrant-edge panics in Rust while loading (a BaseException)
    "truncated-status": lambda root: [p.write_bytes(b"") for p in _segment_files(root, "status.dat")],
    # the write-ahead log overwritten
    "wal-garbage": lambda root: [_garbage(p) for p in (root / "wal").iterdir()],
    # a piece of the folder deleted
    "config-missing": lambda root: (root / "edge_config.json").unlink(),
    # our own sidecar (which model built the vectors) unreadable
    "meta-garbage": lambda root: root.with_name("kb.json").write_text("{not json"),
    # every file of the folder truncated to nothing
    "all-empty": lambda root: [p.write_bytes(b"") for p in root.rglob("*") if p.is_file()],
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_index_fails_cleanly_ingest_still_commits_and_reindex_rebuilds(settings, tmp_path, damage):
    """Search says to run `kb reindex` (never a Rust panic or a bare engine error), an ingest commits
    its runs and leaves them queued for indexing, and reindex rebuilds the index from SQL."""
    with KnowledgeBase.open(settings) as k:
        k.ingest(write(tmp_path))
        assert k.index.count() == POINTS
    DAMAGE[damage](settings.qdrant_path / settings.collection)
    late = [{"id": "late", "project": "p", "name": "late run", "config": {"optim": {"lr": 1e-3}},
             "notes": "tokenizer bug made the loss explode"}]
    with KnowledgeBase.open(settings) as k:
        with pytest.raises(IndexDamaged, match="kb reindex"):
            k.search("exploded to NaN")
        report = k.ingest(write(tmp_path, late))
        assert report.added == 1 and k.run("late").id == "late"
        assert k.pending_index() == 2     # stale: the run and the ablation it joined (its id kept) wait
        from kb.indexer import expected_fingerprints
        assert k.reindex().indexed == len(expected_fingerprints(k.engine)) == POINTS + 1
        assert_index_equals_sql(k)
        assert top(k, "tokenizer bug")[0] == "late" and k.pending_index() == 0


def assert_index_equals_sql(k):
    """The same ids, each with the hash of the text SQL holds for it now."""
    from kb.indexer import expected_fingerprints
    assert k.index.fingerprints() == expected_fingerprints(k.engine)


def test_vectors_overwritten_with_garbage_are_rebuilt_by_reindex(kb, tmp_path, settings):
    """Damage the engine cannot see (garbage vectors load fine): reindex does not trust the folder."""
    kb.ingest(write(tmp_path))
    kb.release_index()
    for p in _segment_files(settings.qdrant_path / settings.collection, "chunk_0.mmap"):
        _garbage(p, seed=3)
    kb.reindex()
    assert_index_equals_sql(kb)
    assert top(kb, "which run blew up with NaN loss?")[0] == "lr-3e-3"
    assert top(kb, "data mixture with more code")[0] == "data-mix"


HOLDER = """
import select, sys
import numpy as np
from kb.settings import Settings
from kb.vectors import VectorPoint, open_index
idx = open_index(Settings(home=sys.argv[1], database_url=sys.argv[2]), 384)
print("held", flush=True)
rng, i = np.random.default_rng(0), 0
# "write": an indexer at work until told to stop, upserts and deletes (each flushed) in another project
while sys.argv[3] == "write" and not select.select([sys.stdin], [], [], 0)[0]:
    idx.upsert([VectorPoint(f"run:junk{i + j}", rng.standard_normal(384),
                            {"kind": "run", "project": "junk", "ref_id": f"junk{i + j}"}) for j in range(32)])
    if i:
        idx.delete([f"run:junk{i - 32}"])
    i += 32
sys.stdin.readline()
idx.close()
"""


@pytest.mark.parametrize("holder_mode", ["idle", "write"])
def test_search_works_while_another_process_holds_the_index(settings, tmp_path, holder_mode):
    """A reader never fails because a writer holds (and is writing) the embedded index: it searches a
    private copy of what has been indexed."""
    with KnowledgeBase.open(settings) as k:
        k.ingest(write(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(settings.home), settings.database_url, holder_mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for _ in range(3):                                  # each a fresh copy, taken mid-write
            with KnowledgeBase.open(settings) as k:
                assert top(k, "which run blew up with NaN loss?", project="p")[0] == "lr-3e-3"
        with KnowledgeBase.open(settings) as k:
            with pytest.raises(IndexBusy):
                k.index                                     # the folder itself stays the holder's
            report = k.ingest(write(tmp_path, [dict(RUNS[0], id="new-run", notes="a brand new run")]))
            # queued for the holder: the run, and the ablation it joined (its id kept)
            assert report.added == 1 and report.pending_index == 2
            assert top(k, "data mixture with more code", project="q") == ["data-mix"]
    finally:
        holder.communicate("\n", timeout=120)
    assert holder.returncode == 0


def test_record_texts_take_more_ids_than_postgres_has_parameters(engine):
    """The scale benchmark's 100,000-run sync once sent one IN list of 85,646 run ids (an
    ablation card's run names) and Postgres refused it (65,535 parameters at most): every
    reader of records by id goes IN list by IN list, on both databases alike."""
    from sqlmodel import Session

    from kb.record_texts import ablation_texts, failure_texts, note_texts, run_texts
    many = [f"absent-{i}" for i in range(70_000)]
    with Session(engine) as s:
        assert list(run_texts(s, many)) == []
        assert list(note_texts(s, many)) == []
        assert list(ablation_texts(s, many)) == []
        assert list(failure_texts(s, [str(i) for i in range(70_000)])) == []
        assert list(failure_texts(s, run_ids=many)) == []
