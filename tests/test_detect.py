"""Format detection: each source goes to its ingester; unknown or ambiguous paths get clear errors."""
from __future__ import annotations

import json

import pytest

from ingest.detect import resolve
from kb.errors import UnknownFormat


def names(target, fmt=None):
    return [ing.name for _, ing in resolve(str(target), fmt)]


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
