"""Tables of runs (CSV, TSV, Parquet) through the real KnowledgeBase: one run per row.

tests/data/chinchilla_points.csv is Epoch AI's reconstruction of the 245 runs in Hoffmann et
al. 2022, Figure 4 (see tests/data/README.md for its origin; test data only).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.detect import resolve
from ingest.table import parse_mapping
from kb.errors import InvalidRecord

DATA = Path(__file__).parent / "data"
CHINCHILLA = DATA / "chinchilla_points.csv"
KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")

SWEEP = [
    ["name", "lr", "batch_size", "seed", "val_loss", "status", "tags", "notes"],
    ["lr-1e-4", "1e-4", "256", "0", "3.41", "completed", "sweep, baseline", ""],
    ["lr-3e-4", "3e-4", "256", "0", "3.28", "completed", "sweep", "best"],
    ["lr-1e-3", "1e-3", "512", "1", "3.35", "finished", "sweep", ""],
    ["lr-3e-3", "3e-3", "512", "1", "NaN", "diverged", "sweep;unstable", "loss NaN at 1200"],
]


def write_table(path: Path, rows: list[list[str]], delimiter: str = ",", head: str = "") -> Path:
    with open(path, "w", newline="") as fh:
        fh.write(head)
        csv.writer(fh, delimiter=delimiter).writerows(rows)
    return path


def by_name(k) -> dict:
    return {r.name: r for r in k.runs()}


@pytest.mark.slow        # ~6 s: 245 runs, one transaction each
def test_chinchilla_table_is_245_runs_with_scale_and_loss(kb):
    with open(CHINCHILLA) as fh:
        rows = list(csv.DictReader(fh))
    report = kb.ingest(str(CHINCHILLA), index=False)
    assert (report.added, report.failed) == (245, [])
    runs = kb.runs()
    assert len(runs) == 245
    for r in runs:
        assert set(r.scale) >= {"params", "tokens", "flops"} and isinstance(r.scale["params"], int)
        assert isinstance(r.summary["loss"], float)
    first = by_name(kb)["chinchilla_points row 1"]
    assert first.scale["params"] == round(float(rows[0]["params_N"]))        # 6795600349.289497 -> int
    # exactly, and a float on Postgres too (jsonb would hand back the integer it equals)
    assert first.scale["flops"] == float(rows[0]["compute_C"]) and isinstance(first.scale["flops"], float)
    assert first.summary["loss"] == float(rows[0]["loss"])
    assert first.config["excluded_by_epoch"] == 1
    big = kb.runs(where="scale.params > 1e9")
    assert len(big) == sum(float(r["params_N"]) > 1e9 for r in rows) > 0
    assert len(kb.runs(where="config.excluded_by_epoch = 1")) == 5
    again = kb.ingest(str(CHINCHILLA), index=False)
    assert (again.added, again.updated, again.unchanged) == (0, 0, 245)


def test_a_row_keeps_its_run_when_the_file_changes(kb, tmp_path):
    path = write_table(tmp_path / "sweep.csv", SWEEP)
    kb.ingest(str(path), index=False)
    ids = {r.name: r.id for r in kb.runs()}
    changed = [row[:] for row in SWEEP]
    changed[2][4] = "3.27"
    write_table(path, changed)
    report = kb.ingest(str(path), index=False)
    assert (report.added, report.updated, report.unchanged) == (0, 1, 3)
    assert {r.name: r.id for r in kb.runs()} == ids
    assert by_name(kb)["lr-3e-4"].summary["val_loss"] == 3.27


def test_sweep_spreadsheet_columns_go_to_config_summary_and_fields(kb, tmp_path):
    path = write_table(tmp_path / "sweep.csv", SWEEP)
    report = kb.ingest(str(path), project="sweeps", index=False)
    assert (report.added, report.failed) == (4, [])
    runs = by_name(kb)
    best = runs["lr-3e-4"]
    assert best.config == {"lr": 3e-4, "batch_size": 256, "seed": 0}
    assert best.summary["val_loss"] == 3.28 and best.status == "completed" and best.project == "sweeps"
    assert best.tags == ["sweep"]
    assert runs["lr-1e-4"].tags == ["sweep", "baseline"]
    assert runs["lr-1e-3"].status == "completed"                  # W&B's "finished"
    bad = runs["lr-3e-3"]
    assert bad.status == "diverged" and bad.tags == ["sweep", "unstable"]
    assert bad.summary.get("val_loss") in (None, "NaN")            # as json_safe stores NaN
    assert kb.run(bad.id).notes == "loss NaN at 1200"
    assert {r.name for r in kb.runs(where="config.lr > 5e-4")} == {"lr-1e-3", "lr-3e-3"}
    assert {r.name for r in kb.runs(where="status = 'diverged'")} == {"lr-3e-3"}


def test_cells_are_typed(kb, tmp_path):
    path = write_table(tmp_path / "cells.csv", [
        ["name", "int", "float", "exp", "flag", "code", "huge", "inf", "text", "empty"],
        ["r", " 42 ", "0.5", "-3E-4", "TRUE", "007", str(2**70), "-inf", "cosine", ""],
    ])
    assert kb.ingest(str(path), index=False).failed == []
    config = kb.runs()[0].config
    assert config == {"int": 42, "float": 0.5, "exp": -3e-4, "flag": True, "code": "007",
                      "huge": str(2**70), "inf": "-Infinity", "text": "cosine"}     # as json_safe stores them


def test_tsv_and_semicolon_csv_read_like_csv(kb, tmp_path):
    write_table(tmp_path / "a.csv", SWEEP)
    tsv = write_table(tmp_path / "b.tsv", SWEEP, delimiter="\t")
    # a European spreadsheet: `;` between cells, a decimal comma, and comment lines above the header
    euro = [row[:] for row in SWEEP]
    for row in euro[1:]:
        row[1] = f"{float(row[1]):.4f}".replace(".", ",")      # 3e-4 -> 0,0003
        row[4] = row[4].replace(".", ",")
    semi = write_table(tmp_path / "c.csv", euro, delimiter=";", head="# exported from the sheet\n#\n")
    assert [r.ingester.name for r in resolve(str(tsv)).reads] == ["table"]
    assert [r.ingester.name for r in resolve(str(semi)).reads] == ["table"]
    kb.ingest(str(tmp_path / "a.csv"), project="csv", index=False)
    kb.ingest(str(tsv), project="tsv", index=False)
    report = kb.ingest(str(semi), project="semi", index=False)
    assert report.failed == []
    got = {p: {r.name: (r.config, r.summary.get("val_loss"), r.status, r.tags)
               for r in kb.runs(project=p)} for p in ("csv", "tsv", "semi")}
    assert got["csv"] == got["tsv"] == got["semi"] and len(got["csv"]) == 4
    lines = {r.name: kb.run(r.id).source["uri"] for r in kb.runs(project="semi")}
    assert lines["lr-1e-4"] == f"{semi.resolve()}#row-1"


def test_parquet_table(kb, tmp_path):
    from datetime import datetime, timezone

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "runs.parquet"
    pq.write_table(pa.table({
        "run_name": ["small", "large"],
        "n_params": pa.array([124_000_000, 1_300_000_000], pa.int64()),
        "train_tokens": ["2.5B", "26B"],                        # a published table's way of writing it
        "val/loss": [3.28, None],
        "lr": [6e-4, 2e-4],
        "tags": [["gpt2"], ["gpt2", "xl"]],
        "started_at": [datetime(2024, 5, 1, tzinfo=timezone.utc), None],
    }), path)
    assert [r.ingester.name for r in resolve(str(path)).reads] == ["table"]
    report = kb.ingest(str(path), index=False)
    assert (report.added, report.failed) == (2, [])
    runs = by_name(kb)
    small, large = runs["small"], runs["large"]
    assert small.scale["params"] == 124_000_000 and small.scale["tokens"] == 2_500_000_000
    assert large.scale["tokens"] == 26_000_000_000
    assert small.summary["val/loss"] == 3.28 and "val/loss" not in large.summary
    assert small.config["lr"] == 6e-4 and large.tags == ["gpt2", "xl"]
    assert small.started_at is not None and small.started_at.year == 2024
    assert kb.ingest(str(path), index=False).unchanged == 2


def test_map_overrides_and_drops_columns(kb, tmp_path):
    path = write_table(tmp_path / "paper.csv", [
        ["run", "size", "lr", "final", "host", "group"],
        ["a", "1.2e8", "0.0006", "3.3", "node-1", "x"],
        ["b", "3.5e8", "0.0003", "3.1", "node-2", "y"],
    ])
    mapping = parse_mapping(["size=scale.params", "lr=config.optim.lr", "final=summary.val/loss",
                             "host=-", "group=tags"])
    report = kb.ingest(str(path), mapping=mapping, index=False)
    assert (report.added, report.failed) == (2, [])
    a = by_name(kb)["a"]                          # `run` is a name column without --map
    assert a.scale["params"] == 120_000_000 and a.config["optim"] == {"lr": 6e-4}
    assert a.summary["val/loss"] == 3.3 and a.tags == ["x"]
    assert "host" not in a.config and "lr" not in a.config
    assert [r.name for r in kb.runs(where="summary.val/loss < 3.2")] == ["b"]


def test_map_errors_name_the_file_and_column(kb, tmp_path):
    path = write_table(tmp_path / "paper.csv", [["size", "loss"], ["1e8", "3.3"]])
    report = kb.ingest(str(path), mapping={"tokens": "scale.tokens"}, index=False)
    assert report.added == 0
    [failed] = report.failed
    assert failed["source"] == str(path.resolve()) and failed["field"] == "tokens"
    assert "lacks" in failed["error"] and "size, loss" in failed["error"]
    for bad in (["size"], ["=scale.params"], ["size=scale.bogus"], ["size=config."], ["a=-", "a=name"]):
        with pytest.raises(InvalidRecord):
            parse_mapping(bad)
    jsonl = tmp_path / "runs.jsonl"
    jsonl.write_text(json.dumps({"config": {"a": 1}}) + "\n")
    with pytest.raises(InvalidRecord, match="table"):          # nothing read is a table
        kb.ingest(str(jsonl), mapping={"a": "config.b"}, index=False)
    assert kb.runs() == []
    # two columns landing on one key is ambiguous: the file is refused, naming the second
    clash = write_table(tmp_path / "clash.csv", [["N", "params", "loss"], ["1", "2", "3"]])
    [failed] = kb.ingest(str(clash), index=False).failed
    assert failed["field"] == "params" and "scale.params" in failed["error"]


def test_bad_rows_are_rejected_and_the_rest_go_in(kb, tmp_path):
    path = write_table(tmp_path / "sweep.csv", [
        ["name", "params", "lr", "status"],
        ["ok-1", "1e8", "3e-4", "completed"],
        ["bad-params", "lots", "3e-4", "completed"],
        ["bad-status", "1e8", "1e-3", "exploded"],
        ["too-wide", "1e8", "1e-3", "completed", "surplus"],
        ["", "", "", ""],                                       # a spreadsheet's empty tail row
        ["ok-2", "2e8", "1e-3", ""],
    ])
    report = kb.ingest(str(path), index=False)
    assert report.added == 2 and {r.name for r in kb.runs()} == {"ok-1", "ok-2"}
    failed = {(f["line"], f["field"]) for f in report.failed}
    assert failed == {(3, "params"), (4, "status"), (5, "")}
    assert all(f["source"] == str(path.resolve()) for f in report.failed)
    assert by_name(kb)["ok-2"].status == "completed"


def test_detection_leaves_wandb_exports_to_wandb(tmp_path):
    wandb_csv = write_table(tmp_path / "project.csv", [["name", "config", "summary"],
                                                      ["a", '{"lr": 1}', '{"loss": 2}']])
    plain = write_table(tmp_path / "runs.csv", SWEEP)
    header_only = write_table(tmp_path / "empty.csv", [SWEEP[0]])
    assert [r.ingester.name for r in resolve(str(wandb_csv)).reads] == ["wandb"]
    assert [r.ingester.name for r in resolve(str(plain)).reads] == ["table"]
    assert [r.ingester.name for r in resolve(str(wandb_csv), "table").reads] == ["table"]
    from ingest.table import TableIngester
    assert TableIngester().detect(str(header_only)) == 0
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    assert TableIngester().detect(str(tmp_path / "fake.parquet")) == 0


@pytest.mark.slow        # ~10 s: two `kb` subprocesses
def test_cli_ingest_with_map(tmp_path, database_url):
    path = write_table(tmp_path / "points.csv", [["N", "D", "loss"], ["1e8", "2e9", "3.4"],
                                                 ["4e8", "8e9", "2.9"]])
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")

    def kb(*args):
        return subprocess.run([KB, *args], capture_output=True, text=True, env=env, timeout=300)

    out = kb("ingest", str(path), "--map", "loss=summary.val/loss", "--no-index", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) | {"skipped": []} == {"added": 2, "updated": 0, "unchanged": 0,
                                                        "failed": [], "skipped": []}
    runs = json.loads(kb("runs", "--where", "summary.val/loss < 3", "--json").stdout)
    assert [(r["scale"]["params"], r["scale"]["tokens"]) for r in runs] == [(400_000_000, 8_000_000_000)]
    bad = kb("ingest", str(path), "--map", "loss", "--no-index")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "COLUMN=KEY" in bad.stderr


# ---- hostile input (issue 7): what fuzzing found, one case each ------------------------------------

def test_bytes_that_are_not_utf8_refuse_their_row_not_the_file(kb, tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_bytes(b"name,lr,note\nok-1,0.1,fine\nbad,0.2,caf\xe9\nok-2,0.3,\xff\n")
    (tmp_path / "header.csv").write_bytes(b"name,n\xf6te\nok,1\n")
    report = kb.ingest(str(path), index=False)
    assert {r.name for r in kb.runs()} == {"ok-1"}
    assert {(f["line"], f["field"]) for f in report.failed} == {(3, "note"), (4, "note")}
    [failed] = kb.ingest(str(tmp_path / "header.csv"), index=False).failed
    assert (failed["line"], failed["field"], failed["error"]) == (1, "n\ufffdte", "the header is not UTF-8")


def test_a_quote_never_closed_is_refused_on_its_line_and_the_rows_after_it_go_in(kb, tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_text('name,lr,note\nok-1,0.1,fine\nbad,0.2,"unclosed\nok-2,0.3,x\nok-3,0.4,"a, b"\n')
    report = kb.ingest(str(path), index=False)
    assert [(f["line"], f["error"]) for f in report.failed] == [
        (3, "a quoted cell that starts on this line is never closed")]
    assert {r.name: r.config["note"] for r in kb.runs()} == {"ok-1": "fine", "ok-2": "x", "ok-3": "a, b"}


def test_long_cells_huge_integers_and_a_long_column_name(kb, tmp_path):
    long_name = "k" * 201
    path = write_table(tmp_path / "t.csv", [
        ["name", "notes_text", "digits", long_name],
        ["a", "x" * 200_000, "9" * 5000, ""],                    # past csv's 128 KiB cell, past int()'s 4,300 digits
        ["b", "y", "12", "1"],                                   # fills the column no key can be named after
    ])
    report = kb.ingest(str(path), index=False)
    [run] = kb.runs()
    assert run.config == {"notes_text": "x" * 200_000, "digits": "9" * 5000}
    [failed] = report.failed
    assert (failed["line"], failed["field"]) == (3, long_name) and "200" in failed["error"]


def test_sniffing_ignores_a_spreadsheets_trailing_delimiters(kb, tmp_path):
    path = tmp_path / "euro.csv"
    path.write_text("name;lr;seed\nr1;0,5;1;\nr2;0,25;2;;\n")
    assert kb.ingest(str(path), index=False).failed == []
    assert {r.name: r.config for r in kb.runs()} == {"r1": {"lr": 0.5, "seed": 1}, "r2": {"lr": 0.25, "seed": 2}}


def test_an_error_in_a_key_with_dots_names_its_own_column(kb, tmp_path):
    path = write_table(tmp_path / "t.csv", [["name", "a", "a.b"], ["r", "1", "x\x00y"]])
    [failed] = kb.ingest(str(path), index=False).failed
    assert failed["field"] == "a.b" and "NUL" in failed["error"]


def test_parquet_values_python_cannot_hold_refuse_their_row(kb, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "runs.parquet"
    pq.write_table(pa.table({
        "name": ["far", "near"], "lr": [0.1, 0.2],
        "when": pa.array([10**12, 0], pa.timestamp("s")),        # year 33658: no Python datetime
        "tags": pa.array([["a"], ["b", None]], pa.list_(pa.string())),      # a null item is no tag
    }), path)
    report = kb.ingest(str(path), index=False)
    assert [(f["field"], f["line"]) for f in report.failed] == [("row-1.when", None)]
    [run] = kb.runs()
    assert run.name == "near" and run.config == {"lr": 0.2, "when": "1970-01-01T00:00:00"} and run.tags == ["b"]
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:-20])
    [failed] = kb.ingest(str(broken), format="table", index=False).failed
    assert failed["error"].startswith("not a readable Parquet file") and "\n" not in failed["error"]


@pytest.mark.slow        # ~10 s: two `kb` subprocesses
def test_cli_hostile_folder_exits_2_naming_file_line_and_column(tmp_path, database_url):
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "sweep.csv").write_bytes(b"name,lr,params\nok,0.1,1e8\nbad-bytes,\xff,1e8\nbad-params,0.2,lots\n"
                                       b'open,0.3,"1e8\nok-2,0.4,2e8\n')
    (folder / "train.log").write_bytes(b"\xef\xbb\xbf" + b"\x00" * 8 + b"step 1e999: loss 2\nstep 1: loss 2.5\n"
                                       + b"{" * 5000 + b"\n" + b"x" * 300_000 + b"\n")
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")
    out = subprocess.run([KB, "ingest", str(folder), "--no-index", "--json"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 2, out.stderr
    report = json.loads(out.stdout)
    csv_path = str(folder / "sweep.csv")
    assert report["added"] == 3                                  # ok, ok-2 and the log
    assert {(f["source"], f["line"], f["field"]) for f in report["failed"]} == {
        (csv_path, 3, "lr"), (csv_path, 4, "params"), (csv_path, 5, "")}
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"error: {csv_path}:") for line in lines), out.stderr
    runs = json.loads(subprocess.run([KB, "runs", "--json"], capture_output=True, text=True, env=env,
                                     timeout=300).stdout)
    assert sorted(r["name"] for r in runs) == ["ok", "ok-2", "train"]


@pytest.mark.slow        # ~5 s: a `kb` subprocess
def test_cli_error_for_a_column_named_with_a_line_break_is_one_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b'name,"two\nlines",lr\nr1,\x00,0.1\n')
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    out = subprocess.run([KB, "ingest", str(path), "--no-index"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2 and "NUL" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
