"""Format detection: each source goes to its ingester; unknown or ambiguous paths get clear errors."""
from __future__ import annotations

import json

import pytest

from ingest.detect import resolve
from kb.errors import UnknownFormat


def names(target, fmt=None):
    return [read.ingester.name for read in resolve(str(target), fmt).reads]


def test_each_kind_of_file_finds_its_ingester(tmp_path):
    (tmp_path / "runs.jsonl").write_text(json.dumps({"config": {"a": 1}}) + "\n")
    (tmp_path / "postmortem.md").write_text("# Postmortem\n\nThe run `lr-3e-3` diverged.\n")
    (tmp_path / "train.log").write_text("".join(f"iter {i}: loss {5 - i * 0.1:.3f}, time 10ms\n" for i in range(10)))
    assert names(tmp_path / "runs.jsonl") == ["native"]
    assert names(tmp_path / "postmortem.md") == ["notes"]
    assert names(tmp_path / "train.log") == ["log"]
    assert sorted(names(tmp_path)) == ["log", "native", "notes"]        # a mixed folder is walked


def test_unknown_file_lists_the_formats(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(UnknownFormat) as err:
        resolve(str(blob))
    message = str(err.value)
    assert "weights.bin" in message
    for fmt in ("native", "mlflow", "wandb", "tensorboard", "hf-trainer", "log", "notes"):
        assert fmt in message


def test_format_override_and_unknown_format(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("plain text about a run\n")
    assert names(notes, "notes") == ["notes"]
    with pytest.raises(UnknownFormat, match="unknown format 'csv'; known:"):
        resolve(str(notes), "csv")


def test_missing_path(tmp_path):
    with pytest.raises(UnknownFormat, match="no such file"):
        resolve(str(tmp_path / "nope"))


def test_a_walk_accounts_for_every_file(tmp_path):
    """Every file a walk visits is read, failed (it looked like a run) or skipped (with why)."""
    exp = tmp_path / "gpt-small"
    exp.mkdir()
    (exp / "train.log").write_text("".join(f"iter {i}: loss {5 - i * 0.1:.3f}, time 10ms\n" for i in range(10)))
    (exp / "crashed.log").write_text("loading data\nsetting up the model\n")        # a log with nothing in it
    (exp / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    (exp / "ckpt_1000.pt").write_bytes(b"\0" * 64)
    (exp / "train.py").write_text("import torch\n")
    (tmp_path / "sweep.yaml").write_text("lr: [1e-3, 3e-4]\n")
    plan = resolve(str(tmp_path))
    assert [(r.ingester.name, r.project) for r in plan.reads] == [("log", "gpt-small")]
    assert [f["source"] for f in plan.failed] == [str(exp / "crashed.log")]
    assert "no step/metric lines" in plan.failed[0]["error"]
    skipped = {s["source"].rsplit("/", 1)[-1]: s["reason"] for s in plan.skipped}
    assert skipped == {"loss.png": "image", "ckpt_1000.pt": "checkpoint or tensor file",
                       "train.py": "source code", "sweep.yaml": "configuration file (not a run by itself)"}


def test_event_files_below_a_mixed_folder_do_not_hide_its_other_files(tmp_path):
    """TensorBoard claimed any folder with event files somewhere below, so a folder holding a
    sweep CSV, notes and a tb/ tree was read as one TensorBoard tree and the rest vanished
    without a word: the walk now claims the tb/ tree alone and reads the others."""
    from torch.utils.tensorboard import SummaryWriter

    for run in ("run-a", "run-b"):
        with SummaryWriter(str(tmp_path / "tb" / run)) as w:
            w.add_scalar("eval/loss", 3.0, 10)
    (tmp_path / "sweep.csv").write_text("name,lr,loss\nr1,0.001,3.2\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "postmortem.md").write_text("# Postmortem\n\nThe lr=1 run went NaN.\n")
    plan = resolve(str(tmp_path))
    assert sorted((r.ingester.name, r.source.rsplit("/", 1)[-1]) for r in plan.reads) == [
        ("notes", "postmortem.md"), ("table", "sweep.csv"), ("tensorboard", "tb")]
    assert (plan.failed, plan.skipped) == ([], [])
    assert names(tmp_path / "tb") == ["tensorboard"]            # a tree of event folders is still one read


def test_a_folder_with_no_runs_is_an_error(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\0" * 8)
    with pytest.raises(UnknownFormat, match="no runs or notes in this folder"):
        resolve(str(tmp_path))
