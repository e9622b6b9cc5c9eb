"""The MLflow ingester against stores written by MLflow itself: a SQLite tracking store, a legacy
`mlruns/` file store, and Postgres when KB_TEST_DATABASE_URL names one.

    pytest tests/test_ingest_mlflow.py -q
"""
from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from ingest.mlflow import MlflowIngester, nest, typed
from kb.records import Parsed, Rejected

ING = MlflowIngester()
T0 = 1_700_000_000_123            # ms; odd milliseconds so /1000 must round-trip exactly
PARAMS = {"n_layer": 12, "optim.lr": 3e-4, "optim.betas": [0.9, 0.95], "optim.name": "adamw",
          "use_flash": True, "dropout": None, "tokenizer": ["bpe", "byte"], "sched": {"kind": "cos"},
          "model.tie": False, "warmup": "0042", "shape": (4, 8), "eps": 1e-8,
          "data": "owt", "data.shards": 8}
EXPECTED_CONFIG = {"n_layer": 12, "optim": {"lr": 3e-4, "betas": [0.9, 0.95], "name": "adamw"},
                   "use_flash": True, "dropout": None, "tokenizer": ["bpe", "byte"],
                   "sched": {"kind": "cos"}, "model": {"tie": False}, "warmup": "0042",
                   "shape": [4, 8], "eps": 1e-8, "data": "owt", "data.shards": 8}


def _curves():
    """(key, value, timestamp_ms, step) as logged; a NaN, a repeated step, and an unordered step."""
    pts = [("train/loss", 10.0 / (s + 1), T0 + 37 * s, s) for s in range(0, 300, 3)]
    pts += [("val/loss", 6.5 - s / 1000, T0 + 91 * s + 1, s) for s in range(0, 300, 50)]
    pts += [("val/loss", float("nan"), T0 + 99_999, 350), ("lr", 3e-4, T0 + 5, 7),
            ("lr", 2.5e-4, T0 + 6, 7), ("lr", 1e-4, T0 + 7, 2)]
    return pts


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite MLflow store with one run per status and one run that carries nothing."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("gpt-small", artifact_location=str(root / "artifacts"))
    other = client.create_experiment("other", artifact_location=str(root / "artifacts2"))
    ids = {}
    run = client.create_run(exp, run_name="lr-3e-4", start_time=T0,
                            tags={"ablation:norm": "", "baseline": "true", "team": "infra",
                                  "mlflow.note.content": "first try", "mlflow.user": "ada",
                                  "mlflow.source.git.commit": "abc123", "mlflow.source.name": "train.py"})
    for k, v in PARAMS.items():
        client.log_param(run.info.run_id, k, v)       # MLflow stores str(v)
    client.log_batch(run.info.run_id, metrics=[Metric(*p) for p in _curves()])
    client.set_terminated(run.info.run_id, "FINISHED", end_time=T0 + 600_000)
    ids["finished"] = run.info.run_id
    for status in ("FAILED", "KILLED", "RUNNING"):
        run = client.create_run(other, run_name=f"run-{status.lower()}", start_time=T0)
        client.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0, T0, 0)],
                         params=[Param("seed", "1")], tags=[RunTag("note", "x")])
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status)
        ids[status.lower()] = run.info.run_id
    ids["empty"] = client.create_run(other, run_name="empty").info.run_id
    return {"uri": uri, "path": root / "mlflow.db", "ids": ids, "client": client}


def _by_id(items):
    parsed = {i.record.meta["mlflow_run_id"]: i for i in items if isinstance(i, Parsed)}
    return parsed, [i for i in items if isinstance(i, Rejected)]


def _same_points(got, logged):
    assert len(got) == len(logged)
    for (step, value, wall), (s, v, ts) in zip(got, logged):
        assert step == s and wall == ts / 1000 and round(wall * 1000) == ts
        assert (math.isnan(value) and math.isnan(v)) or value == v


def test_params_come_back_typed_and_nested(store):
    parsed, _ = _by_id(list(ING.read(store["uri"])))
    assert parsed[store["ids"]["finished"]].record.config == EXPECTED_CONFIG


def test_every_logged_point_reads_back_exactly(store):
    parsed, _ = _by_id(list(ING.read(store["uri"])))
    metrics = parsed[store["ids"]["finished"]].record.metrics
    assert set(metrics) == {"train/loss", "val/loss", "lr"}
    for key in metrics:
        logged = sorted(((s, v, ts) for k, v, ts, s in _curves() if k == key),
                        key=lambda p: (p[2], p[0]))
        _same_points(metrics[key], logged)
        # the bulk SQL read agrees point for point with MLflow's own per-key history
        history = store["client"].get_metric_history(store["ids"]["finished"], key)
        _same_points(metrics[key], [(m.step, m.value, m.timestamp) for m in history])


def test_run_facts_status_and_tags(store):
    items = list(ING.read(store["uri"]))
    parsed, rejected = _by_id(items)
    ids = store["ids"]
    rec = parsed[ids["finished"]].record
    assert (rec.project, rec.name, rec.status) == ("gpt-small", "lr-3e-4", "completed")
    assert rec.tags == ["ablation:norm", "baseline"]
    assert rec.notes == "first try"
    assert rec.code.git_commit == "abc123" and rec.code.entrypoint == "train.py"
    assert rec.meta["user"] == "ada" and rec.meta["mlflow_tags"]["team"] == "infra"
    # records keep times in UTC (aware or naive, as kb.records decides): compare the instant
    assert rec.started_at.replace(tzinfo=timezone.utc) == datetime.fromtimestamp(T0 / 1000, tz=timezone.utc)
    assert (rec.ended_at - rec.started_at).total_seconds() == pytest.approx(600.0)
    assert rec.summary["lr"] == 2.5e-4          # MLflow's latest: largest step, then latest time
    assert parsed[ids["finished"]].source_uri == f"mlflow:sqlite:///{store['path']}#{ids['finished']}"
    assert {parsed[ids[s]].record.status for s in ("failed", "killed", "running")} == \
        {"failed", "killed", "running"}
    assert parsed[ids["failed"]].record.project == "other"
    # a run with neither params nor metrics is reported by its URI; the others still came through
    assert len(rejected) == 1 and ids["empty"] in rejected[0].error.source
    assert "config" in rejected[0].error.error


def test_rereading_gives_identical_records(store):
    first = [i.record.model_dump_json() for i in ING.read(store["uri"]) if isinstance(i, Parsed)]
    second = [i.record.model_dump_json() for i in ING.read(store["uri"]) if isinstance(i, Parsed)]
    assert first == second and len(first) == 4


def test_missing_store_is_rejected_and_not_created(tmp_path):
    missing = tmp_path / "nope.db"
    items = list(ING.read(f"sqlite:///{missing}"))
    assert len(items) == 1 and isinstance(items[0], Rejected)
    assert str(missing) in items[0].error.error and not missing.exists()
    folder = tmp_path / "mlruns"
    items = list(ING.read(str(folder)))
    assert len(items) == 1 and "not found" in items[0].error.error and not folder.exists()


def test_a_database_without_mlflow_tables_is_left_alone(tmp_path):
    path = tmp_path / "kb.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("create table run (id text)")
    items = list(ING.read(f"sqlite:///{path}"))
    assert len(items) == 1 and "not an MLflow tracking database" in items[0].error.error
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("select name from sqlite_master")] == ["run"]


def test_detect(store, tmp_path):
    assert ING.detect(store["uri"]) == 95
    assert ING.detect("postgresql+psycopg://u@h/db") == 95
    assert ING.detect(str(store["path"])) == 90      # an MLflow SQLite file given as a path
    (tmp_path / "kb.sqlite").write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    assert ING.detect(str(tmp_path / "kb.sqlite")) == 0
    assert ING.detect(str(tmp_path)) == 0


def test_typed_params():
    assert [typed(s) for s in ("12", "-3", "3e-4", "1.", "True", "false", "None", "null")] == \
        [12, -3, 3e-4, 1.0, True, False, None, None]
    assert typed("[1, 2]") == [1, 2] and typed("['a', 'b']") == ["a", "b"]
    assert typed("{'x': (1, 2)}") == {"x": [1, 2]} and typed('{"y": null}') == {"y": None}
    # non-finite numbers are spelled as every source stores them (kb.records.json_safe)
    assert [typed(s) for s in ("nan", "inf", "-inf", "1e999", "[NaN]")] == \
        ["NaN", "Infinity", "-Infinity", "Infinity", ["NaN"]]
    # what cannot be typed faithfully stays the text MLflow stored
    for text in ("007", "{1: 2}", "[1,", "", "adamw", str(2**64)):
        assert typed(text) == text


def test_nest_keeps_conflicting_keys_flat():
    assert nest({"a": 1, "a.b": 2, "x.y": 3, "x.z.w": 4, ".q": 5, "x.z.w.v": 6}) == \
        {"a": 1, "a.b": 2, "x": {"y": 3, "z": {"w": 4}}, ".q": 5, "x.z.w.v": 6}


MLRUNS_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=sys.argv[1])
    e = c.create_experiment("legacy")
    r = c.create_run(e, run_name="old-run")
    c.log_param(r.info.run_id, "optim.lr", 0.001)
    c.log_batch(r.info.run_id, metrics=[Metric("loss", 2.0 - s / 10, 1700000000000 + s, s)
                                        for s in range(20)])
    c.set_terminated(r.info.run_id, "FAILED")
    print(r.info.run_id)
""")


def test_mlruns_file_store(tmp_path, monkeypatch):
    # written in a child process so this process never caches a file store: the read must open it
    root = tmp_path / "mlruns"
    out = subprocess.run([sys.executable, "-c", MLRUNS_SCRIPT, root.as_uri()], check=True,
                         capture_output=True, text=True, timeout=120)
    run_id = out.stdout.strip().splitlines()[-1]
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert ING.detect(str(root)) == 90
    for target in (str(root), root.as_uri()):
        items = list(ING.read(target))
        parsed, rejected = _by_id(items)
        assert not rejected, rejected
        rec = parsed[run_id].record
        assert (rec.project, rec.name, rec.status) == ("legacy", "old-run", "failed")
        assert rec.config == {"optim": {"lr": 0.001}}
        _same_points(rec.metrics["loss"], [(s, 2.0 - s / 10, 1700000000000 + s) for s in range(20)])
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ


@pytest.mark.skipif(not os.environ.get("KB_TEST_DATABASE_URL"), reason="KB_TEST_DATABASE_URL not set")
def test_postgres_store():
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    from sqlalchemy import create_engine, text

    base = os.environ["KB_TEST_DATABASE_URL"]
    admin_url = base.replace("postgresql://", "postgresql+psycopg://", 1)
    schema = "mlflow_" + uuid.uuid4().hex[:10]
    admin = create_engine(admin_url)
    with admin.begin() as conn:
        conn.execute(text(f'create schema "{schema}"'))
    try:
        sep = "&" if "?" in admin_url else "?"
        uri = f"{admin_url}{sep}options=-csearch_path%3D{schema}"
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("pg", artifact_location="/tmp/kb-test-artifacts")
        run = client.create_run(exp, run_name="pg-run")
        client.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0 / (s + 1), T0 + s, s)
                                                   for s in range(50)])
        client.log_param(run.info.run_id, "batch", 64)
        client.set_terminated(run.info.run_id)
        # the plain postgresql:// spelling works too (psycopg 3 is chosen when psycopg2 is absent)
        plain = uri.replace("postgresql+psycopg://", "postgresql://", 1)
        parsed, rejected = _by_id(list(ING.read(plain)))
        assert not rejected
        rec = parsed[run.info.run_id].record
        assert rec.config == {"batch": 64} and rec.status == "completed"
        _same_points(rec.metrics["loss"], [(s, 1.0 / (s + 1), T0 + s) for s in range(50)])
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'drop schema "{schema}" cascade'))
        admin.dispose()


def test_importing_the_module_does_not_import_mlflow():
    code = "import ingest.mlflow, sys; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_a_database_password_never_reaches_a_message():
    (item,) = list(ING.read("postgresql+psycopg://kb:hunter2@127.0.0.1:1/mlflow"))
    assert isinstance(item, Rejected) and "cannot open the MLflow store" in item.error.error
    assert "hunter2" not in str(item.error) and "kb:***@127.0.0.1" in item.error.source
