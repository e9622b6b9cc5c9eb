"""SQL -> vector index: ingest indexes, a lost index is rebuilt on open, reindex works, writers
never need the index (another process holding it leaves the runs pending, then indexed)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

from kb.api import KnowledgeBase

RUNS = [
    {"id": "lr-3e-3", "project": "p", "name": "lr 3e-3 diverged", "status": "diverged",
     "config": {"optim": {"lr": 3e-3}}, "failure": {"kind": "diverged", "step": 1200, "message": "loss is NaN"},
     "notes": "loss exploded to NaN right after warmup"},
    {"id": "lr-3e-4", "project": "p", "name": "lr 3e-4 baseline", "config": {"optim": {"lr": 3e-4}},
     "summary": {"val/loss": 3.1}, "notes": "stable baseline, smooth curve"},
    {"id": "data-mix", "project": "q", "name": "code-heavy data mixture", "config": {"data": {"code": 0.4}},
     "notes": "more code in the mixture improved humaneval"},
]


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
        assert k.index.count() == 3
    shutil.rmtree(settings.home / "qdrant")
    with KnowledgeBase.open(settings) as k:
        assert k.index.count() == 3            # opening the index reconciled it with SQL
        assert k.pending_index() == 0
        assert top(k, "exploded to NaN")[0] == "lr-3e-3"


def test_reindex_rebuilds_from_sql(kb, tmp_path):
    kb.ingest(write(tmp_path))
    report = kb.reindex()
    assert report.indexed == 3 and kb.index.count() == 3
    assert top(kb, "smooth stable baseline")[0] == "lr-3e-4"


def test_changed_run_updates_its_vector(kb, tmp_path):
    kb.ingest(write(tmp_path))
    changed = [dict(RUNS[2], notes="tokenizer bug: loss exploded to NaN at step 10")]
    report = kb.ingest(write(tmp_path, changed))
    assert report.updated == 1 and kb.index.count() == 3
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
            assert report.added == 3 and report.pending_index == 3
            assert len(k.runs()) == 3
    finally:
        holder.communicate("\n", timeout=60)
    with KnowledgeBase.open(settings) as k:       # the next holder indexes what is pending
        assert k.index.count() == 3 and k.pending_index() == 0


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
        assert k.pending_index() == 0 and k._open_index().count() == 3
