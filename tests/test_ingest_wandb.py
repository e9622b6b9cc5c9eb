"""The W&B ingester against runs written by wandb itself in offline mode (in a child process, so
the wandb service never lives in the test process), and against exports in the documented shape.

    pytest tests/test_ingest_wandb.py -q
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ingest.native import NativeIngester
from ingest.wandb import WandbIngester
from kb.records import Parsed, Rejected

ING = WandbIngester()
CONFIG = {"model": {"n_layer": 4, "d_model": 128, "tie": True}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
          "seed": 7, "dataset": "owt", "dropout": None,
          # a long list makes the run record span several 32 KiB blocks (first/middle/last chunks)
          "schedule": [i / 7 for i in range(9000)]}

WRITER = textwrap.dedent("""
    import json, math, sys, wandb
    out, spec = sys.argv[1], json.load(open(sys.argv[2]))
    written = []
    for r in spec:
        run = wandb.init(project=r["project"], name=r["name"], config=r["config"], tags=r["tags"],
                         notes=r["notes"])
        rows = {}
        for step in range(0, r["steps"] * 3, 3):
            row = {"train/loss": 10.0 / (step + 1) + 1e-3 * math.sin(step), "lr": 3e-4 * (1 - step / 1000),
                   "eval": {"acc": step / 1000}}
            if step % 30 == 0:
                row["val/loss"] = float("nan") if step == 60 and r["nan"] else 7.0 - step / 100
            wandb.log(row, step=step)
            rows[step] = row
        run.summary["best_val"] = 1.25
        run.config.update({"late_key": "added"})
        written.append({"id": run.id, "rows": {str(k): v for k, v in rows.items()}})
        wandb.finish(exit_code=r["exit_code"])
    json.dump(written, open(out, "w"))
""")
SPEC = [dict(project="proj-w", name="lr-3e-4", config=CONFIG, tags=["baseline", "ablation:norm"],
             notes="first", steps=300, exit_code=0, nan=True),
        dict(project="proj-w", name="crashy", config={"seed": 1}, tags=[], notes="", steps=5,
             exit_code=1, nan=False)]


@pytest.fixture(scope="session")
def wandb_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb_runs")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true",
               WANDB_DISABLE_GIT="true", WANDB_CONSOLE="off")
    began = time.time()
    (root / "spec.json").write_text(json.dumps(SPEC))
    subprocess.run([sys.executable, "-c", WRITER, str(root / "written.json"), str(root / "spec.json")],
                   env=env, check=True, capture_output=True, timeout=180, cwd=root)
    written = json.loads((root / "written.json").read_text())
    return {"root": root / "wandb", "written": written, "window": (began, time.time())}


def _parsed(items):
    parsed = [i for i in items if isinstance(i, Parsed)]
    return {i.record.meta["wandb_run_id"]: i for i in parsed}


def _expected_curves(rows: dict) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list] = {}
    for step, row in sorted(rows.items(), key=lambda kv: int(kv[0])):
        for key, value in row.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    curves.setdefault(f"{key}.{sub}", []).append((int(step), v))
            else:
                curves.setdefault(key, []).append((int(step), value))
    return curves


def test_offline_runs_read_back_exactly(wandb_dir):
    items = list(ING.read(str(wandb_dir["root"])))
    assert all(isinstance(i, Parsed) for i in items) and len(items) == 2   # latest-run link skipped
    runs = _parsed(items)
    first, second = (runs[w["id"]] for w in wandb_dir["written"])
    rec = first.record
    assert (rec.project, rec.name, rec.status) == ("proj-w", "lr-3e-4", "completed")
    assert rec.config == {**CONFIG, "late_key": "added"}
    assert rec.tags == ["baseline", "ablation:norm"] and rec.notes == "first"
    assert first.source_uri == str(next(wandb_dir["root"].glob(f"*-{rec.meta['wandb_run_id']}")).resolve())
    assert rec.meta["exit_code"] == 0 and rec.meta["wandb_version"].startswith(("0.", "1."))
    began, ended = wandb_dir["window"]
    assert began <= rec.started_at.timestamp() <= rec.ended_at.timestamp() <= ended

    expected = _expected_curves(wandb_dir["written"][0]["rows"])
    assert set(rec.metrics) == set(expected) == {"train/loss", "lr", "eval.acc", "val/loss"}
    for key, points in expected.items():
        got = rec.metrics[key]
        assert [p[0] for p in got] == [s for s, _ in points]
        for (_, value, _), (_, want) in zip(got, points):
            assert (math.isnan(value) and math.isnan(want)) or value == want
        walls = [p[2] for p in got]
        assert walls == sorted(walls) and began <= walls[0] and walls[-1] <= ended
    assert rec.summary["best_val"] == 1.25
    assert rec.summary["train/loss"] == expected["train/loss"][-1][1]
    assert not any(k.startswith("_") for k in rec.summary) and "_wandb" not in rec.config

    assert (second.record.name, second.record.status, second.record.meta["exit_code"]) == \
        ("crashy", "failed", 1)
    assert second.record.config == {"seed": 1, "late_key": "added"}


def test_one_run_folder_and_its_log_file(wandb_dir):
    folder = sorted(p for p in wandb_dir["root"].glob("offline-run-*"))[0]
    log = next(folder.glob("run-*.wandb"))
    assert ING.detect(str(wandb_dir["root"])) == 95
    assert ING.detect(str(folder)) == 95 and ING.detect(str(log)) == 95
    by_folder, by_file = list(ING.read(str(folder))), list(ING.read(str(log)))
    assert len(by_folder) == len(by_file) == 1
    assert by_folder[0].record.model_dump_json() == by_file[0].record.model_dump_json()
    assert by_folder[0].source_uri == by_file[0].source_uri == str(folder.resolve())


def _copy_run(wandb_dir, tmp_path) -> Path:
    run_id = wandb_dir["written"][0]["id"]
    src = next(wandb_dir["root"].glob(f"offline-run-*-{run_id}"))
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return next(dst.glob("run-*.wandb"))


def test_a_torn_log_keeps_what_was_written_before_the_tear(wandb_dir, tmp_path):
    log = _copy_run(wandb_dir, tmp_path)
    full = log.read_bytes()
    whole = _parsed(ING.read(str(log.parent)))
    (whole_rec,) = [p.record for p in whole.values()]
    log.write_bytes(full[: int(len(full) * 0.7)])        # a run still writing, or killed mid-write
    (item,) = list(ING.read(str(log.parent)))
    assert isinstance(item, Parsed)
    rec = item.record
    assert rec.status == "running" and "truncated" in rec.meta["log_problem"]
    assert rec.config == CONFIG          # the late config update was past the tear
    loss = rec.metrics["train/loss"]
    assert 0 < len(loss) < len(whole_rec.metrics["train/loss"])
    assert loss == whole_rec.metrics["train/loss"][: len(loss)]       # a prefix, point for point


def _chunk_at(data: bytes, near: int) -> tuple[int, int]:
    """(header position, body length) of the first chunk at or after byte `near`."""
    from ingest.wandb import BLOCK, CHUNK, FILE_HEADER
    pos = FILE_HEADER.size
    while True:
        room = BLOCK - pos % BLOCK
        if room < CHUNK.size:
            pos += room
            continue
        length = CHUNK.unpack_from(data, pos)[1]
        if pos >= near and length > 8:
            return pos, length
        pos += CHUNK.size + length


# The damaged byte is placed in a chunk's body or its length field, found by walking the chunks:
# a fixed offset lands on either depending on how wandb batched that run's history.
@pytest.mark.parametrize("where", ["body", "length"])
def test_a_corrupt_byte_costs_only_its_block(wandb_dir, tmp_path, where):
    log = _copy_run(wandb_dir, tmp_path)
    (whole,) = [p.record for p in _parsed(ING.read(str(log.parent))).values()]
    data = bytearray(log.read_bytes())
    pos, length = _chunk_at(data, int(len(data) * 0.85))   # inside the history, after the run record
    data[pos + 7 + length // 2 if where == "body" else pos + 5] ^= 0xFF   # 5: the length's high byte
    log.write_bytes(bytes(data))
    (item,) = list(ING.read(str(log.parent)))
    assert isinstance(item, Parsed) and "checksum mismatch" in item.record.meta["log_problem"]
    rec = item.record
    assert rec.status == "completed" and rec.config == whole.config      # the exit record survived
    loss, full = rec.metrics["train/loss"], whole.metrics["train/loss"]
    assert len(full) - 150 < len(loss) < len(full) and set(loss) < set(full)


def test_a_corrupt_run_record_is_rejected(wandb_dir, tmp_path):
    log = _copy_run(wandb_dir, tmp_path)
    data = bytearray(log.read_bytes())
    data[40_000] ^= 0xFF                                # the config spans the first blocks
    log.write_bytes(bytes(data))
    (item,) = list(ING.read(str(log.parent)))
    assert isinstance(item, Rejected) and "no run record" in item.error.error
    assert "checksum mismatch" in item.error.error


@pytest.mark.parametrize("keep", [0, 5, 7, 40])
def test_a_log_with_no_readable_run_is_rejected(wandb_dir, tmp_path, keep):
    log = _copy_run(wandb_dir, tmp_path)
    log.write_bytes(log.read_bytes()[:keep])
    (item,) = list(ING.read(str(log)))
    assert isinstance(item, Rejected) and item.error.source == str(log.resolve())
    assert "W&B log" in item.error.error or "no run record" in item.error.error


EXPORT = [
    {"name": "exp-a", "id": "abc123", "project": "proj-e", "state": "finished",
     "config": {"optim": {"lr": 1e-3}, "_wandb": {"cli_version": "0.31.0"}},
     "summary": {"val/loss": 3.5, "_step": 20, "_runtime": 12.5, "_wandb": {"runtime": 12},
                 "hist": {"_type": "histogram", "bins": [1, 2]}},
     "history": [{"_step": 0, "_timestamp": 1.7e9, "train/loss": 9.0, "_runtime": 0.1},
                 {"_step": 10, "_timestamp": 1.7e9 + 5, "train/loss": 4.0, "val/loss": 4.5},
                 {"_step": 20, "_timestamp": 1.7e9 + 9, "train/loss": 3.0, "val/loss": 3.5}],
     "tags": ["sweep"], "created_at": "2024-03-01T10:00:00Z"},
    {"name": "exp-b", "state": "crashed", "config": {"lr": {"value": 0.01, "desc": None},
                                                     "bs": {"value": 32}}, "summary": {}},
]


def test_json_export(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(EXPORT))
    assert ING.detect(str(path)) > NativeIngester().detect(str(path))
    a, b = list(ING.read(str(path)))
    assert (a.record.project, a.record.name, a.record.status) == ("proj-e", "exp-a", "completed")
    assert a.record.config == {"optim": {"lr": 1e-3}}
    assert a.record.summary == {"val/loss": 3.5}
    assert a.record.metrics == {"train/loss": [(0, 9.0, 1.7e9), (10, 4.0, 1.7e9 + 5), (20, 3.0, 1.7e9 + 9)],
                                "val/loss": [(10, 4.5, 1.7e9 + 5), (20, 3.5, 1.7e9 + 9)]}
    assert a.source_uri == f"{path.resolve()}#abc123" and a.record.tags == ["sweep"]
    assert b.record.status == "failed" and b.record.config == {"lr": 0.01, "bs": 32}


def test_csv_export_from_the_documented_pandas_recipe(tmp_path):
    import pandas as pd
    path = tmp_path / "project.csv"
    pd.DataFrame({"summary": [{"val/loss": 3.25, "_step": 99}, {"acc": 0.5}],
                  "config": [{"optim": {"lr": 3e-4}, "layers": [1, 2]}, {"seed": 2}],
                  "name": ["csv-a", "csv-b"]}).to_csv(path)
    assert ING.detect(str(path)) == 80
    a, b = list(ING.read(str(path)))
    assert (a.record.name, a.record.config, a.record.summary) == \
        ("csv-a", {"optim": {"lr": 3e-4}, "layers": [1, 2]}, {"val/loss": 3.25})
    assert b.record.config == {"seed": 2} and a.line == 2


def test_corrupt_exports_name_the_file_and_field(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[{"name": "x", "config": {"a": 1}, "summary": {}}')
    (item,) = list(ING.read(str(broken)))
    assert isinstance(item, Rejected) and item.error.source == str(broken.resolve())
    assert "invalid JSON" in item.error.error and item.error.line == 1

    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps([EXPORT[0], {"name": "bad", "config": [1, 2], "summary": {}},
                                 {"name": "bad-row", "config": {"a": 1}, "summary": {},
                                  "history": [{"_step": "x", "loss": 1}]},
                                 {"name": "bad-state", "config": {"a": 1}, "summary": {},
                                  "state": "exploded"}]))
    items = list(ING.read(str(mixed)))
    assert isinstance(items[0], Parsed)
    assert [(i.error.source, i.error.field) for i in items[1:]] == \
        [(str(mixed.resolve()), "[1].config"), (str(mixed.resolve()), "[2].history.0._step"),
         (str(mixed.resolve()), "[3].state")]

    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("name,config,summary\nok,\"{'a': 1}\",{}\nno,\"{'a': \",{}\n")
    ok, bad = list(ING.read(str(bad_csv)))
    assert isinstance(ok, Parsed) and isinstance(bad, Rejected)
    assert (bad.error.field, bad.error.line) == ("config", 3)


def test_folders_without_runs(tmp_path):
    assert ING.detect(str(tmp_path)) == 0
    (item,) = list(ING.read(str(tmp_path / "missing")))
    assert isinstance(item, Rejected) and not (tmp_path / "missing").exists()
    (item,) = list(ING.read(str(tmp_path)))
    assert isinstance(item, Rejected) and "no W&B runs" in item.error.error


def test_importing_the_module_does_not_import_wandb():
    code = "import ingest.wandb, sys; print('wandb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], check=True, timeout=60)
    assert out.stdout.strip() == "False"
