"""Native JSON/JSONL ingest on real SQLite and Postgres: exact round trip, idempotency, bad input."""
from __future__ import annotations

import json
import math

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from kb.models import MetricSeries, Run, RunField

RECORD = {
    "id": "gpt-small-lr3e-4", "project": "gpt-small", "name": "lr-sweep-3e-4", "status": "completed",
    "config": {"model": {"n_layer": 12, "d_model": 768, "norm": "rmsnorm", "bias": False},
               "optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "data": {"batch_size": 512, "block_size": 1024}},
    "scale": {"params": 124_000_000, "tokens": 2_500_000_000, "flops": 1.9e18},
    "metrics": {"train/loss": [[0, 10.9, 1700000000.5], [100, 6.2, 1700000100.25], [200, 5.1, 1700000200.0]],
                "val/loss": [[100, 6.4], [200, 5.3]]},
    "summary": {"val/loss": 3.28, "hellaswag": 0.31},
    "tags": ["ablation:norm", "baseline"], "notes": "the reference run",
    "started_at": "2026-01-05T10:00:00+00:00", "ended_at": "2026-01-05T18:30:00Z",
    "code": {"git_commit": "abc123", "entrypoint": "train.py"},
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def store_state(kb):
    with Session(kb.engine) as s:
        return tuple(s.execute(select(func.count()).select_from(t)).scalar_one() for t in (Run, MetricSeries, RunField))


def test_round_trip_is_exact(kb, tmp_path):
    report = kb.ingest(str(write_jsonl(tmp_path / "runs.jsonl", [RECORD])), index=False)
    assert (report.added, report.failed) == (1, [])
    run = kb.run("gpt-small-lr3e-4")
    assert run.config == RECORD["config"]
    assert run.scale == RECORD["scale"]
    assert run.metrics == RECORD["metrics"]
    assert run.summary == {**RECORD["summary"], "train/loss": 5.1}   # given values win, finals fill in
    assert run.tags == RECORD["tags"] and run.notes == RECORD["notes"]
    assert run.status == "completed" and run.project == "gpt-small"
    assert run.started_at.isoformat() == "2026-01-05T10:00:00+00:00"
    assert run.code == {"git_commit": "abc123", "entrypoint": "train.py"}
    assert run.stats["train/loss"] == {"points": 3, "first_step": 0, "last_step": 200, "final": 5.1,
                                       "nonfinite": 0, "best": 5.1, "best_step": 200}
    assert run.source["kind"] == "native" and run.source["content_hash"]
    assert kb.run("lr-sweep-3e-4").id == run.id      # by unique name too


def test_nan_loss_round_trips_and_marks_divergence(kb, tmp_path):
    rec = {"id": "blowup", "config": {"optim": {"lr": 3e-3}},
           "metrics": {"train/loss": [[0, 10.0], [10, 7.0], [20, float("nan")], [30, float("inf")]]}}
    kb.ingest(str(write_jsonl(tmp_path / "r.jsonl", [rec])), index=False)
    run = kb.run("blowup")
    values = [p[1] for p in run.metrics["train/loss"]]
    assert values[:2] == [10.0, 7.0] and math.isnan(values[2]) and values[3] == math.inf
    assert run.status == "diverged"
    assert run.failures[0]["kind"] == "diverged" and run.failures[0]["step"] == 20


def test_reingest_is_idempotent_and_changes_are_updates(kb, tmp_path):
    records = [dict(RECORD, id=f"r{i}", config={"optim": {"lr": 1e-4 * (i + 1)}}) for i in range(5)]
    path = write_jsonl(tmp_path / "runs.jsonl", records)
    first = kb.ingest(str(path), index=False)
    before = store_state(kb)
    second = kb.ingest(str(path), index=False)
    assert (first.added, second.added, second.updated, second.unchanged) == (5, 0, 0, 5)
    assert store_state(kb) == before
    records[2]["summary"] = {**RECORD["summary"], "val/loss": 2.5}
    third = kb.ingest(str(write_jsonl(path, records)), index=False)
    assert (third.added, third.updated, third.unchanged) == (0, 1, 4)
    assert kb.run("r2").summary["val/loss"] == 2.5
    assert store_state(kb) == before


def test_records_without_id_get_stable_ids(kb, tmp_path):
    recs = [{"project": "p", "name": "a", "config": {"x": 1}}, {"config": {"x": 2}}]
    path = write_jsonl(tmp_path / "runs.jsonl", recs)
    ids = kb.ingest(str(path), index=False).ids
    assert kb.ingest(str(path), index=False).ids == ids
    assert ids[0].startswith("a-") and ids[1].startswith("run-")


BAD_LINES = [
    ('{"id": "t", "config": {"optim": {"lr": 3e-4}', "", "invalid JSON"),                        # truncated
    ('{"id": "w", "config": {}, "scale": {"params": "many"}}', "scale.params", "valid integer"),  # wrong type
    ('{"id": "u", "config": {"a": 1}, "hyperparams": {}}', "hyperparams", "unknown key"),
    ('{"id": "h", "config": {"optim": {"lr": 1e999}}}', "config.optim.lr", "not finite"),        # huge float
    ('{"id": "i", "config": {"a": 1}, "scale": {"params": 123456789012345678901234567890}}', "scale.params", "64 bits"),
    ('{"id": "s", "status": "exploded", "config": {"a": 1}}', "status", "completed"),
    ('{"id": "e", "name": "no content"}', "", "config` or `metrics"),
    ('{"id": "m", "metrics": {"loss": [[0, "x"]]}}', "metrics.loss.0.1", "valid number"),
    ('[1, 2]', "", "JSON object"),
]


@pytest.mark.parametrize("bad,field,message", BAD_LINES)
def test_bad_record_is_named_and_nothing_of_it_is_stored(kb, tmp_path, bad, field, message):
    good = [json.dumps(dict(RECORD, id="good-1")), bad, json.dumps(dict(RECORD, id="good-2"))]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(good) + "\n")
    report = kb.ingest(str(path), index=False)
    assert report.added == 2
    [failure] = report.failed
    assert failure["source"] == str(path) and failure["line"] == 2
    assert failure["field"] == field and message in failure["error"]
    assert {r.id for r in kb.runs()} == {"good-1", "good-2"}


def test_non_utf8_bytes_are_reported_with_their_line(kb, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(dict(RECORD, id="ok")).encode() + b'\n{"id": "bad", "name": "caf\xe9", "config": {}}\n')
    report = kb.ingest(str(path), index=False)
    assert report.added == 1 and report.failed[0]["line"] == 2 and "UTF-8" in report.failed[0]["error"]


def test_single_json_file_and_list_file(kb, tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(RECORD))
    (tmp_path / "many.json").write_text(json.dumps([dict(RECORD, id="x1"), {"id": "x2", "config": {}, "bogus": 1}]))
    one = kb.ingest(str(tmp_path / "one.json"), index=False)
    many = kb.ingest(str(tmp_path / "many.json"), index=False)
    assert one.added == 1 and many.added == 1
    assert many.failed[0]["field"] == "[1].bogus"


def test_failed_write_leaves_the_store_as_it_was(kb, tmp_path, monkeypatch):
    """A fault injected after the run row is written rolls the whole run back."""
    kb.ingest(str(write_jsonl(tmp_path / "a.jsonl", [dict(RECORD, id="before")])), index=False)
    before = store_state(kb)
    import kb.runs as runs_mod
    real_bulk = runs_mod.bulk_insert

    def failing_bulk(conn, table, columns, rows):
        if table == MetricSeries.__tablename__:
            raise RuntimeError("disk full")
        real_bulk(conn, table, columns, rows)

    monkeypatch.setattr(runs_mod, "bulk_insert", failing_bulk)
    with pytest.raises(RuntimeError):
        kb.ingest(str(write_jsonl(tmp_path / "b.jsonl", [dict(RECORD, id="after")])), index=False)
    assert store_state(kb) == before
    assert [r.id for r in kb.runs()] == ["before"]


def _rows_of(kb, run_id):
    with Session(kb.engine) as s:
        return tuple(s.execute(select(func.count()).select_from(t).where(t.run_id == run_id)).scalar_one()
                     for t in (MetricSeries, RunField)) + (int(s.get(Run, run_id) is not None),)


def fail_curves_of(monkeypatch, run_id: str, error: Exception) -> None:
    """The write of run_id's curves raises `error` (after its run row went in), in groups or alone."""
    import kb.runs as runs_mod
    real_bulk = runs_mod.bulk_insert

    def failing_bulk(conn, table, columns, rows):
        if table == MetricSeries.__tablename__ and any(r[0] == run_id for r in rows):
            raise error
        real_bulk(conn, table, columns, rows)

    monkeypatch.setattr(runs_mod, "bulk_insert", failing_bulk)


def test_a_failing_run_rolls_back_alone_inside_its_batch(kb, tmp_path, monkeypatch):
    """Runs share a transaction (a savepoint each): the one whose write fails, after its run row
    went in, leaves nothing behind, and the runs before and after it in the batch are stored."""
    fail_curves_of(monkeypatch, "b", ValueError("a bad curve"))
    report = kb.ingest(str(write_jsonl(tmp_path / "abc.jsonl", [dict(RECORD, id=i) for i in "abc"])), index=False)
    assert (report.added, [f["line"] for f in report.failed]) == (2, [2])
    assert _rows_of(kb, "b") == (0, 0, 0)
    assert _rows_of(kb, "a") == _rows_of(kb, "c") and _rows_of(kb, "a")[0] > 0
    assert sorted(r.id for r in kb.runs()) == ["a", "c"]


def test_an_error_that_ends_the_ingest_keeps_the_runs_before_it(kb, tmp_path, monkeypatch):
    fail_curves_of(monkeypatch, "c", RuntimeError("disk full"))
    with pytest.raises(RuntimeError):
        kb.ingest(str(write_jsonl(tmp_path / "abcd.jsonl", [dict(RECORD, id=i) for i in "abcd"])), index=False)
    assert sorted(r.id for r in kb.runs()) == ["a", "b"]
    assert _rows_of(kb, "c") == (0, 0, 0) and _rows_of(kb, "b") == _rows_of(kb, "a")


def test_promoted_columns_and_derived_scale(kb, tmp_path):
    rec = {"id": "derived", "config": {"model": {"n_layer": 2, "d_model": 64, "vocab_size": 256},
                                       "optim": {"lr": 1e-3}, "batch_size": 8, "block_size": 128},
           "metrics": {"loss": [[0, 5.0], [50, 3.0]]}}
    kb.ingest(str(write_jsonl(tmp_path / "d.jsonl", [rec])), index=False)
    run = kb.run("derived")
    assert run.scale == {"params": 12 * 2 * 64**2 + 256 * 64, "tokens": 8 * 128 * 50,
                         "flops": 6.0 * (12 * 2 * 64**2 + 256 * 64) * 8 * 128 * 50}
    with Session(kb.engine) as s:
        row = s.get(Run, "derived")
        assert (row.lr, row.batch_size, row.params) == (1e-3, 8, run.scale["params"])


def test_a_missing_second_path_fails_before_anything_is_written(kb, tmp_path):
    from kb.errors import UnknownFormat
    good = write_jsonl(tmp_path / "good.jsonl", [RECORD])
    with pytest.raises(UnknownFormat, match="nope.jsonl"):
        kb.ingest(str(good), str(tmp_path / "nope.jsonl"), index=False)
    assert kb.runs() == []


def test_a_run_reads_back_as_written_on_every_store(kb, tmp_path):
    """Key order and number types survive the store (Postgres keeps JSON text as written)."""
    config = {"zeta": 1, "alpha": {"y": 2.0, "b": [3, "x"]}, "big": 1.9e18, "exact": 10**18}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"id": "as-written", "config": config, "scale": {"flops": 1.9e18}}))
    kb.ingest(str(path), index=False)
    run = kb.run("as-written")
    assert run.config == config and list(run.config) == list(config) and list(run.config["alpha"]) == ["y", "b"]
    assert isinstance(run.config["big"], float) and isinstance(run.config["exact"], int)
    assert isinstance(run.config["alpha"]["y"], float) and isinstance(run.scale["flops"], float)


def test_bulk_insert_raises_sqlalchemys_integrity_error_on_both_databases(engine):
    """Postgres rows go in through COPY, past SQLAlchemy: a duplicate key must still reach the
    writer as IntegrityError (what it reports as a conflicting record), as SQLite's does."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from kb.db import bulk_insert
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE scratch (a INTEGER PRIMARY KEY, b TEXT)"))
    with pytest.raises(IntegrityError), engine.begin() as conn:
        bulk_insert(conn, "scratch", ("a", "b"), [(1, "x"), (1, "y")])
    with engine.begin() as conn:
        bulk_insert(conn, "scratch", ("a", "b"), [(1, "tab\there"), (2, "new\nline \\ and 'quote'")])
        assert conn.execute(text("SELECT b FROM scratch ORDER BY a")).scalars().all() == \
            ["tab\there", "new\nline \\ and 'quote'"]


def test_one_run_twice_in_one_batch_is_written_in_order(kb):
    """Runs are written in groups; a run that comes again later in the same group (an updated
    record appended to the file) is written after the first, as it would be one by one."""
    first = {"id": "twice", "project": "p", "config": {"lr": 1e-3}, "metrics": {"loss": [[0, 5.0], [10, 3.0]]}}
    second = dict(first, metrics={"loss": [[0, 5.0], [10, 2.5]]})
    other = {"id": "other", "project": "p", "config": {"lr": 3e-4}, "metrics": {"loss": [[0, 5.0]]}}
    report = kb.ingest_records([first, other, second, second], index=False)
    assert (report.added, report.updated, report.unchanged, report.failed) == (2, 1, 1, [])
    assert report.ids == ["twice", "other", "twice", "twice"]
    assert kb.run("twice").metrics["loss"][-1] == [10, 2.5]


def test_groups_notes_and_a_failing_run_keep_their_order_across_groups(kb, monkeypatch):
    """Runs go in GROUP_RUNS at a time (on Postgres, a group written by a thread while the next
    is prepared): a note after run 100 finds run 99 written already, a run whose write fails in
    the second group fails alone, and the report lists every record in the order given."""
    from kb.record_writer import GROUP_RUNS, IngestReport, RecordWriter
    from kb.records import NoteRecord, Parsed, parse_run
    fail_curves_of(monkeypatch, "r70", ValueError("a bad curve"))
    runs = [Parsed(parse_run({"id": f"r{i}", "project": "p", "config": {"lr": i * 1e-4, "seed": 0},
                              "metrics": {"loss": [[0, 5.0], [10, 4.0 - i / 1000]]}}), "native", "runs.jsonl", i + 1)
            for i in range(2 * GROUP_RUNS + 22)]
    note = Parsed(NoteRecord(id="n1", project="p", text="r99 was the best so far", mentions=["r99", "r120"]),
                  "notes", "notes.md", 1)
    report = IngestReport()
    with RecordWriter(kb.engine, report) as writer:
        for item in runs[:101] + [note] + runs[101:]:
            writer.add(item)
    expected = [f"r{i}" for i in range(101) if i != 70] + ["n1"] + [f"r{i}" for i in range(101, len(runs))]
    assert report.ids == expected
    assert (report.added, [f["line"] for f in report.failed]) == (len(runs), [71])
    assert "a bad curve" in report.failed[0]["error"]
    with Session(kb.engine) as s:
        from kb.models import Note
        assert s.get(Note, "n1").mentions == ["r99"]          # r120 came after the note
        assert s.execute(select(func.count()).select_from(Run)).scalar_one() == len(runs) - 1


def test_a_bulk_load_on_postgres_is_vacuumed_and_analyzed(kb, monkeypatch):
    """Past ANALYZE_AFTER runs, runfield and run are vacuumed (pages marked all-visible, so the
    (key, vtype, num) index that carries run_id answers alone) and analyzed, outside a transaction."""
    import kb.api as api
    from sqlalchemy import text
    if kb.engine.dialect.name != "postgresql":
        pytest.skip("Postgres's VACUUM")
    monkeypatch.setattr(api, "ANALYZE_AFTER", 2)
    kb.ingest_records([dict(RECORD, id=f"v{i}") for i in range(3)], index=False)
    with kb.engine.connect() as conn:
        done = dict(conn.execute(text("SELECT relname, last_vacuum IS NOT NULL AND last_analyze IS NOT NULL "
                                      "FROM pg_stat_user_tables WHERE schemaname = current_schema() "
                                      "AND relname IN ('runfield', 'run')")).all())
    assert done == {"runfield": True, "run": True}


def test_later_bulk_loads_vacuum_but_analyze_only_once_the_store_grew_a_tenth(kb):
    """Analyzing after every batch cost more than the vacuum; the ablation tables are analyzed too
    (the refresh's lookups planned a scan of the whole table per lookup without statistics)."""
    from kb.db import maintain_after_bulk_load
    if kb.engine.dialect.name != "postgresql":
        assert maintain_after_bulk_load(kb.engine, 5000) == []      # SQLite: nothing to look after
        return
    kb.ingest_records([dict(RECORD, id=f"g{i}") for i in range(40)], index=False)
    first = maintain_after_bulk_load(kb.engine, 40)           # the store's first statistics
    assert "VACUUM (ANALYZE) runfield" in first and "ANALYZE ablationsig" in first
    assert "VACUUM (ANALYZE) runterm" in first              # its GIN pending list merged, its terms' statistics
    assert maintain_after_bulk_load(kb.engine, 3) == ["VACUUM runfield", "VACUUM run", "VACUUM runterm"]   # 3 of 40
    assert "ANALYZE ablation" in maintain_after_bulk_load(kb.engine, 4)                     # a tenth
