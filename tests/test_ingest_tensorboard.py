"""The TensorBoard ingester on event files written at test time by torch's SummaryWriter
(and tensorboard's own hparams summary): every point read back equals what was logged.

Run: pytest tests/test_ingest_tensorboard.py -q
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from ingest.tensorboard import TensorBoardIngester
from kb.records import Parsed, Rejected, content_hash

TB = TensorBoardIngester()
TAGS = ("train/loss", "val/loss", "lr")


def _value(tag: str, run: int, step: int) -> float:
    # at most 6 significant digits, so float32 storage gives back exactly this decimal
    base = {"train/loss": 4.0, "val/loss": 4.5, "lr": 0.001}[tag]
    return round(base / (1 + 0.1 * step + run), 5)


def _log(writer, run: int, steps, **kw) -> dict:
    """Log every tag at every step with an explicit wall time; returns what was written."""
    written = {t: [] for t in TAGS}
    for step in steps:
        for tag in TAGS:
            v, wall = _value(tag, run, step), 1.7e9 + 10.0 * step + run
            writer.add_scalar(tag, v, global_step=step, walltime=wall, **kw)
            written[tag].append([step, v, wall])
    return written


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """exp/ holding: a legacy-scalar run with add_hparams, a tensor-scalar run with text and a
    double-precision tag, a writer with three add_hparams trials, and a TF2-style run whose
    hparams (with a bool) sit in its own folder."""
    from tensorboard.plugins.hparams.summary_v2 import hparams_pb
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("tb") / "exp"
    expected: dict[str, dict] = {}

    with SummaryWriter(root / "lr-0.001") as w:                  # simple_value scalars
        metrics = _log(w, 0, range(0, 40, 2))
        w.add_hparams({"lr": 0.001, "batch": 32, "optim": "adam", "dropout": 0.1},
                      {"hparam/val_loss": 0.25, "hparam/acc": 0.75})
    expected["lr-0.001"] = {"metrics": metrics,
                            "config": {"lr": 0.001, "batch": 32, "optim": "adam", "dropout": 0.1},
                            "summary": {"hparam/val_loss": 0.25, "hparam/acc": 0.75}}

    with SummaryWriter(root / "group" / "lr-0.01") as w:         # tensor scalars (new_style)
        metrics = _log(w, 1, range(25), new_style=True)
        w.add_scalar("exact", 1 / 3, global_step=0, walltime=1.7e9, new_style=True, double_precision=True)
        w.add_text("notes", "warmup looked fine", global_step=3)
        w.add_histogram("weights", np.arange(10.0), global_step=0)
    metrics["exact"] = [[0, 1 / 3, 1.7e9]]
    expected["group/lr-0.01"] = {"metrics": metrics, "config": {}, "summary": {}}

    with SummaryWriter(root / "sweep") as w:                     # one writer, three trials
        for i, lr in enumerate((0.1, 0.2, 0.3)):
            w.add_hparams({"lr": lr}, {"hparam/loss": 1.5 + i}, run_name=f"trial{i}")
    for i, lr in enumerate((0.1, 0.2, 0.3)):
        expected[f"sweep/trial{i}"] = {"config": {"lr": lr}, "summary": {}}

    with SummaryWriter(root / "tf2-style") as w:                 # hparams in the run's own folder
        w.file_writer.add_summary(hparams_pb({"use_bias": True, "act": "gelu", "depth": 4}))
        metrics = _log(w, 2, range(5))
    expected["tf2-style"] = {"metrics": metrics,
                             "config": {"use_bias": True, "act": "gelu", "depth": 4}, "summary": {}}
    return root, expected


def _runs(target) -> dict[str, Parsed]:
    items = list(TB.read(str(target)))
    assert all(isinstance(i, Parsed) for i in items), [i for i in items if isinstance(i, Rejected)]
    return {i.record.name: i for i in items}


def test_tree_yields_one_run_per_log_folder(tree):
    root, expected = tree
    runs = _runs(root)
    assert set(runs) == set(expected)          # hparams children folded or kept; empty parent skipped
    for name, item in runs.items():
        assert item.source_kind == "tensorboard" and item.line is None
        assert item.source_uri == str((root / name).resolve())
        assert item.record.project == "exp"


def test_every_scalar_point_equals_what_was_written(tree):
    root, expected = tree
    runs = _runs(root)
    for name, exp in expected.items():
        if "metrics" not in exp:
            continue
        got = {k: [list(p) for p in v] for k, v in runs[name].record.metrics.items()}
        assert got == exp["metrics"], name
        # and as float32, what SummaryWriter stored, for every point
        for tag, pts in exp["metrics"].items():
            if tag != "exact":
                assert [np.float32(p[1]) for p in got[tag]] == [np.float32(p[1]) for p in pts]


def test_hparams_become_typed_config_and_metrics_summary(tree):
    root, expected = tree
    runs = _runs(root)
    for name, exp in expected.items():
        rec = runs[name].record
        assert rec.config == exp["config"], name
        for key, value in rec.config.items():
            assert type(value) is type(exp["config"][key]), (name, key)
        if exp["summary"]:
            assert rec.summary == exp["summary"], name
    folded = runs["lr-0.001"].record
    assert folded.meta["hparams_folder"] != "lr-0.001" and folded.status == "completed"
    # each trial of the sweep keeps its own metric value as a one-point series
    assert runs["sweep/trial2"].record.metrics["hparam/loss"][0][1] == 3.5


def test_text_goes_to_notes_and_other_plugins_are_named(tree):
    root, _ = tree
    rec = _runs(root)["group/lr-0.01"].record
    assert "warmup looked fine" in rec.notes and "step 3" in rec.notes
    assert rec.meta["other_tags"] == {"histo": ["weights"]}      # legacy histogram values


def test_run_folder_as_target_and_event_file_as_target(tree):
    root, expected = tree
    for target in (root / "group" / "lr-0.01",
                   next((root / "group" / "lr-0.01").glob("events.out.tfevents.*"))):
        (item,) = TB.read(str(target))
        assert item.record.name == "lr-0.01" and item.record.project == "group"
        assert {k: [list(p) for p in v] for k, v in item.record.metrics.items()} \
            == expected["group/lr-0.01"]["metrics"]


def test_reading_twice_gives_the_same_records(tree):
    root, _ = tree
    first = {n: content_hash(i.record, "tensorboard") for n, i in _runs(root).items()}
    second = {n: content_hash(i.record, "tensorboard") for n, i in _runs(root).items()}
    assert first == second


def test_detect(tree, tmp_path):
    root, _ = tree
    assert TB.detect(str(root / "lr-0.001")) == 80
    assert TB.detect(str(root)) == 60
    assert TB.detect(str(next((root / "sweep").glob("events.out.tfevents.*")))) == 80
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("no events here")
    assert TB.detect(str(tmp_path / "empty")) == 0
    assert TB.detect(str(tmp_path / "empty" / "sub" / "notes.txt")) == 0
    assert TB.detect(str(tmp_path / "missing")) == 0
    # a Trainer output folder also holds runs/ event files: hf-trainer's, not ours
    hf = tmp_path / "hf"
    shutil.copytree(root / "lr-0.001", hf / "runs" / "Jan01")
    (hf / "trainer_state.json").write_text("{}")
    assert TB.detect(str(hf)) == 0


def test_truncated_event_file_keeps_the_readable_prefix(tree, tmp_path):
    root, expected = tree
    run = tmp_path / "cut"
    shutil.copytree(root / "lr-0.001", run)
    event = next(run.glob("events.out.tfevents.*"))
    data = event.read_bytes()
    event.write_bytes(data[: len(data) // 2])
    (item,) = TB.read(str(run))
    assert isinstance(item, Parsed)
    got = item.record.metrics
    want = expected["lr-0.001"]["metrics"]
    n = len(got["train/loss"])
    assert 0 < n < len(want["train/loss"])
    for tag in TAGS:                           # a prefix of what was written, in order
        assert [list(p) for p in got[tag]] == want[tag][: len(got[tag])]
    assert "truncated or corrupt" in item.record.meta["warnings"][0]


def test_corrupt_byte_stops_at_the_bad_record(tree, tmp_path):
    root, expected = tree
    run = tmp_path / "flipped"
    shutil.copytree(root / "tf2-style", run)
    event = next(run.glob("events.out.tfevents.*"))
    data = bytearray(event.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF            # the CRC check catches it
    event.write_bytes(bytes(data))
    (item,) = TB.read(str(run))
    want = expected["tf2-style"]["metrics"]["train/loss"]
    got = [list(p) for p in item.record.metrics["train/loss"]]
    assert got == want[: len(got)] and len(got) < len(want)
    assert item.record.meta["warnings"]


def test_nothing_readable_is_a_clear_rejection(tree, tmp_path):
    root, _ = tree
    run = tmp_path / "stub"
    shutil.copytree(root / "group" / "lr-0.01", run)
    event = next(run.glob("events.out.tfevents.*"))
    event.write_bytes(event.read_bytes()[:5])
    (item,) = TB.read(str(run))
    assert isinstance(item, Rejected)
    assert item.error.source == str(run.resolve()) and "truncated" in item.error.error


def test_no_event_files_is_a_rejection_not_an_exception(tmp_path):
    (item,) = TB.read(str(tmp_path))
    assert isinstance(item, Rejected) and "no TensorBoard event files" in item.error.error


def test_restarted_writer_replaces_the_overlapping_steps(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    run = tmp_path / "restart"
    with SummaryWriter(run, filename_suffix=".a") as w:
        for s in range(10):
            w.add_scalar("loss", 10.0 - s, global_step=s, walltime=1.0 + s)
    with SummaryWriter(run, filename_suffix=".b") as w:      # resumed from the step-5 checkpoint
        for s in range(5, 8):
            w.add_scalar("loss", 100.0 + s, global_step=s, walltime=100.0 + s)
    (item,) = TB.read(str(run))
    assert [list(p) for p in item.record.metrics["loss"]] == \
        [[s, 10.0 - s, 1.0 + s] for s in range(5)] + [[s, 100.0 + s, 100.0 + s] for s in range(5, 8)]
    assert item.record.meta["purged_points"] == 5


def test_runs_store_and_reingest_changes_nothing(tree, engine):
    from sqlalchemy import func, select
    from kb.db import session
    from kb.models import MetricSeries
    from kb.runs import write_run

    root, expected = tree
    items = list(_runs(root).values())
    for want in ("added", "unchanged"):
        for item in items:
            with session(engine) as s, s.begin():
                outcome, _ = write_run(s, item.record, item.source_kind, item.source_uri)
            assert outcome == want
    with session(engine) as s:
        stored = s.scalar(select(func.sum(MetricSeries.points)))
    assert stored == sum(len(p) for i in items for p in i.record.metrics.values())
