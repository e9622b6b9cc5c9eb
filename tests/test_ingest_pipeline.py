"""A big ingest read and prepared by worker processes (ingest.pipeline) leaves exactly the store,
report and order that reading in the writing process does, on real SQLite and Postgres: the
same runs, fields, curves, ablations, failures with their line numbers, and the same errors.

The thresholds are lowered here so that small inputs go through the workers and a JSONL file is
cut into many slices; the processes, pipes and databases are the real ones."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from ingest import native, pipeline, tensorboard, wandb
from ingest.detect import resolve
from kb.ablation_store import snapshot
from kb.models import Run
from tests.test_ingest_wandb import wandb_dir  # noqa: F401 - the offline runs, written once by wandb

DATA = Path(__file__).parent / "data"


def records(n: int) -> list[dict]:
    """Runs of a small sweep (ablations form among them), with curves long enough to slice."""
    out = []
    for i in range(n):
        lr = [1e-3, 3e-4, 1e-4][i % 3]
        losses = [[s * 10, 10.0 - 0.01 * s - lr * 1000 + 0.001 * (i % 5), 1700000000.0 + s] for s in range(60)]
        out.append({"id": f"run-{i:03d}", "project": f"sweep-{i % 2}", "name": f"lr-{lr}-{i}",
                    "config": {"optim": {"lr": lr}, "model": {"n_layer": 4 + (i % 2) * 2}, "seed": i % 4},
                    "metrics": {"train/loss": losses, "val/loss": losses[::6]}})
    return out


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def sweep_lines(n: int = 48) -> list[str]:
    lines = [json.dumps(r) for r in records(n)]
    lines.insert(7, "{not json")                                   # a line that is no JSON at all
    lines.insert(20, json.dumps({"id": "bad-metric", "metrics": {"loss": [[0, "high"]]}}))    # fails validation
    lines.insert(30, "")                                           # a blank line: skipped, still counted
    lines.append(json.dumps({**records(1)[0], "name": "again"}))   # run-000 again, changed: updated
    return lines


def state(kb) -> dict:
    """Everything the ingest left that a reader sees: each run whole, and each project's ablations."""
    with kb.engine.connect() as conn:
        ids = sorted(conn.execute(select(Run.id)).scalars())
        projects = sorted(set(conn.execute(select(Run.project)).scalars()))
        ablations = {p: snapshot(conn, p) for p in projects}
    runs = {}
    for rid in ids:
        data = kb.run(rid).as_dict()
        data["source"].pop("ingested_at")
        runs[rid] = data
    for snap in ablations.values():
        for a in snap["ablations"].values():
            a.pop("computed_at", None)
    return {"runs": runs, "ablations": ablations, "counts": kb.count()}


def ingest_both(kb_factory, *targets, **options):
    """(report, state) of the same ingest read in this process and through two workers."""
    out = []
    for workers in (0, 2):
        kb = kb_factory(workers)
        before = pipeline_runs[0]
        report = kb.ingest(*targets, index=False, **options)
        assert pipeline_runs[0] - before == (1 if workers else 0)     # the workers did read it
        out.append((report.as_dict() | {"ids": report.ids}, state(kb)))
    return out


pipeline_runs = [0]


@pytest.fixture
def small_pipeline(monkeypatch):
    monkeypatch.setattr(pipeline, "MIN_BYTES", 1)
    monkeypatch.setattr(native, "SLICE_BYTES", 4000)
    monkeypatch.setattr(tensorboard, "PART_RUNS", 2)
    monkeypatch.setattr(native.RecordsReader, "PART_RUNS", 5)
    monkeypatch.setattr(pipeline, "CHUNK_RUNS", 5)
    # pytest's own helper threads (xdist's channel) hold none of the locks a worker takes
    monkeypatch.setattr(pipeline, "_threads_in_the_way", lambda: False)
    real = pipeline.run

    def counted(*args, **kwargs):
        pipeline_runs[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "run", counted)


@pytest.fixture
def kb_factory(tmp_path, database_url, small_pipeline):
    """A new store per call (a second schema or file beside the first), workers as asked."""
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    from tests.conftest import database

    opened, contexts = [], []

    def make(workers: int):
        folder = tmp_path / f"kb-{len(opened)}"
        folder.mkdir()
        if len(opened) == 0:
            url = database_url
        else:
            ctx = database("postgres" if database_url.startswith("postgresql") else "sqlite", folder)
            url = ctx.__enter__()
            contexts.append(ctx)
        kb = KnowledgeBase.open(Settings(home=folder / "home", database_url=url, ingest_workers=workers))
        opened.append(kb)
        return kb
    yield make
    for kb in opened:
        kb.close()
    for ctx in contexts:
        ctx.__exit__(None, None, None)


def test_a_sliced_jsonl_file_gives_the_same_store_report_and_order(kb_factory, tmp_path):
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines())
    assert len(pipeline.tasks_for(resolve(str(path)).reads)) > 5          # it really is cut into slices
    (report, store), (piped_report, piped_store) = ingest_both(kb_factory, str(path))
    assert piped_report == report
    assert piped_store == store
    # line numbers are the file's, whichever slice the line was in
    assert [(f["line"], f.get("field")) for f in report["failed"]] == [(8, ""), (21, "metrics.loss.0.1")]
    assert report["added"] == 48 and report["updated"] == 1
    assert any(snap["ablations"] for snap in store["ablations"].values())


def test_records_given_as_a_list_give_the_same_store_report_and_order(kb_factory):
    """KnowledgeBase.ingest_records: a list is cut into parts the forked workers read where it
    lies; a generator is read once, in line. Bad records are reported by their index."""
    given = records(30)
    given.insert(4, ["not", "a", "record"])
    given.insert(11, {"id": "bad-metric", "metrics": {"loss": [[0, "high"]]}})
    given.append({**records(1)[0], "name": "again"})                  # run-000 again, changed: updated
    out = []
    for workers, batch in ((0, given), (2, given), (2, iter(given))):
        kb = kb_factory(workers)
        before = pipeline_runs[0]
        report = kb.ingest_records(batch, source="sweep", index=False)
        assert pipeline_runs[0] - before == (1 if workers and isinstance(batch, list) else 0)
        out.append((report.as_dict() | {"ids": report.ids}, state(kb)))
    (report, store), piped, streamed = out
    assert piped == (report, store) and streamed == (report, store)
    assert [(f["source"], f["line"], f["field"]) for f in report["failed"]] == [
        ("sweep", 5, ""), ("sweep", 12, "metrics.loss.0.1")]
    assert report["added"] == 30 and report["updated"] == 1
    assert any(snap["ablations"] for snap in store["ablations"].values())


def test_a_walk_of_mixed_real_files_gives_the_same_store_and_report(kb_factory, tmp_path):
    folder = tmp_path / "walk"
    shutil.copytree(DATA / "logs", folder / "logs")
    (folder / "native").mkdir()
    write_jsonl(folder / "native" / "runs.jsonl", sweep_lines(12))
    (folder / "model.safetensors").write_bytes(b"\x00" * 4096)          # not a run
    (report, store), (piped_report, piped_store) = ingest_both(kb_factory, str(folder))
    assert piped_report == report
    assert piped_store == store
    assert report["added"] > 12 and report["skipped"] and store["counts"]["notes"]


def test_a_tensorboard_tree_read_in_parts_gives_the_same_store(kb_factory, tmp_path):
    """Runs written by torch's SummaryWriter: plain scalars, an add_hparams sweep (its trials
    folded into runs of their own) and a run whose hparams sit in a child folder."""
    from torch.utils.tensorboard import SummaryWriter
    root = tmp_path / "exp"
    for i in range(5):
        with SummaryWriter(root / f"lr-{i}") as w:
            for step in range(30):
                w.add_scalar("train/loss", 5.0 / (1 + step) + 0.1 * i, step, walltime=1.7e9 + step)
            if i == 2:
                w.add_hparams({"lr": 0.01 * i, "depth": 4}, {"hparam/val_loss": 1.0 + i})
    with SummaryWriter(root / "sweep") as w:
        for i, lr in enumerate((0.1, 0.2, 0.3)):
            w.add_hparams({"lr": lr}, {"hparam/loss": 1.5 + i}, run_name=f"trial{i}")
    assert len(pipeline.tasks_for(resolve(str(root)).reads)) > 2       # the tree is read in parts
    (report, store), (piped_report, piped_store) = ingest_both(kb_factory, str(root))
    assert piped_report == report
    assert piped_store == store
    assert report["added"] == 8 and not report["failed"]


def test_an_mlflow_store_read_by_a_worker_gives_the_same_store(kb_factory, tmp_path):
    """A store written by MLflow's own client, read through its client in a forked worker."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("gpt-small", artifact_location=str(tmp_path / "artifacts"))
    for i, lr in enumerate((1e-3, 3e-4, 1e-3)):
        run = client.create_run(exp, run_name=f"lr-{lr}-{i}", start_time=1_700_000_000_000)
        client.log_batch(run.info.run_id, params=[Param("lr", str(lr)), Param("seed", str(i))],
                         metrics=[Metric("val/loss", 4.0 - 0.1 * s - lr, 1_700_000_000_000 + s, s) for s in range(20)])
        client.set_terminated(run.info.run_id, "FINISHED")
    (report, store), (piped_report, piped_store) = ingest_both(kb_factory, uri)
    assert piped_report == report
    assert piped_store == store
    assert report["added"] == 3


def test_a_wandb_folder_read_in_parts_gives_the_same_store(kb_factory, wandb_dir, monkeypatch):  # noqa: F811
    """Offline runs written by the wandb client (tests/test_ingest_wandb.py), one part per run."""
    monkeypatch.setattr(wandb, "PART_RUNS", 1)
    root = str(wandb_dir["root"])
    assert len(pipeline.tasks_for(resolve(root).reads)) == len(wandb_dir["written"]) >= 2
    (report, store), (piped_report, piped_store) = ingest_both(kb_factory, root)
    assert piped_report == report
    assert piped_store == store
    assert report["added"] == len(wandb_dir["written"])


def test_project_override_reaches_the_workers(kb_factory, tmp_path):
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines(12))
    (_, store), (_, piped_store) = ingest_both(kb_factory, str(path), project="forced")
    assert piped_store == store
    assert {r["project"] for r in piped_store["runs"].values()} == {"forced"}


def test_an_error_in_a_worker_is_raised_in_the_caller(kb_factory, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines(12))

    def broken(*args, **kwargs):
        raise OSError("disk gone")
    monkeypatch.setattr(native, "read_lines", broken)
    kb = kb_factory(2)
    with pytest.raises(OSError, match="disk gone"):
        kb.ingest(str(path), index=False)
    assert not pipeline.multiprocessing.active_children()        # the workers are stopped


def test_a_worker_that_dies_is_reported_not_waited_for(kb_factory, tmp_path, monkeypatch):
    import os
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines(12))
    monkeypatch.setattr(native, "read_lines", lambda *a, **k: os._exit(3))
    monkeypatch.setattr(pipeline, "POLL_S", 0.05)
    kb = kb_factory(2)
    with pytest.raises(RuntimeError, match="exit code 3"):
        kb.ingest(str(path), index=False)
    assert not pipeline.multiprocessing.active_children()


def test_small_inputs_and_busy_processes_read_in_line(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines(4))
    reads = resolve(str(path)).reads
    assert pipeline.worth_it(reads, None) == 0                  # far below MIN_BYTES
    monkeypatch.setattr(pipeline, "MIN_BYTES", 1)
    monkeypatch.setattr(pipeline, "_threads_in_the_way", lambda: False)
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: 2)
    assert pipeline.worth_it(reads, None) == 2
    assert pipeline.worth_it(reads, 0) == 0                     # KB_INGEST_WORKERS=0
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: 64)
    assert pipeline.worth_it(reads, None) == pipeline.DEFAULT_MAX  # one writer keeps up with no more
    assert pipeline.worth_it(reads, 8) == 8                     # unless asked
    monkeypatch.setattr(pipeline, "_threads_in_the_way", lambda: True)
    assert pipeline.worth_it(reads, None) == 0                  # a fork would copy another thread mid-step


def test_a_writer_that_stops_early_ends_its_workers_whatever_sigterm_does_here(tmp_path):
    """The writer stops reading while its worker is blocked on a full queue: terminate() must end
    the worker though this process ignores SIGTERM (as kb serve does while it serves, and as a
    handler a test left behind did in CI, where the join then waited forever)."""
    import signal
    import time
    path = write_jsonl(tmp_path / "runs.jsonl", sweep_lines(2000))       # far more than the queue holds
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        outcomes = pipeline.run(resolve(str(path)).reads, 1, {}, None)
        next(outcomes)
        time.sleep(0.5)                   # the worker fills its queue and blocks on the next put
        started = time.monotonic()
        outcomes.close()                  # the writer's finally: terminate, join
        assert time.monotonic() - started < pipeline.END_S      # ended by SIGTERM, not killed after the wait
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not pipeline.multiprocessing.active_children()
