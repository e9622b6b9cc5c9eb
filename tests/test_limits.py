"""Storage limits of the native record, the same on SQLite and Postgres (README, "Limits").

Each test here reproduces one finding of issue 7 (it failed before the fix, on the store named):
a value either goes in and reads back exactly, or its record is rejected with file, line, field
and the limit; either way the records around it in the batch are stored.

    pytest tests/test_limits.py -q        # KB_TEST_DATABASE_URL=postgresql://... for Postgres too
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kb.records import MAX_DEPTH, MAX_KEY, MAX_NAME

GOOD = {"config": {"optim": {"lr": 3e-4}}, "metrics": {"loss": [[0, 2.0], [10, 1.5]]}}


def batch(kb, tmp_path, middle, name="batch.jsonl"):
    """Ingest good / middle / good as three lines; the report and the ids of the good ones."""
    lines = [json.dumps(dict(GOOD, id=f"{name}:before")), middle if isinstance(middle, str) else json.dumps(middle),
             json.dumps(dict(GOOD, id=f"{name}:after"))]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return kb.ingest(str(path), index=False), path


def assert_rejected(report, path, field, *words):
    assert report.added == 2, report.failed
    [failure] = report.failed
    assert (failure["source"], failure["line"], failure["field"]) == (str(path), 2, field), failure
    for w in words:
        assert w in failure["error"], failure


def random_text(n: int, seed: int = 0) -> str:
    """Text no compressor shrinks: random CJK characters, 3 bytes each in UTF-8."""
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(n))


# ---- 1: long strings (Postgres: "index row requires 11480 bytes, maximum size is 8191") ------

def test_a_one_megabyte_config_string_is_stored_and_read_back(kb, tmp_path):
    blob = "x" * 1_000_000
    report, _ = batch(kb, tmp_path, {"id": "long", "config": {"blob": blob, "lr": 1e-3}})
    assert (report.added, report.failed) == (3, [])
    assert kb.run("long").config == {"blob": blob, "lr": 1e-3}
    assert [r.id for r in kb.runs(where="config.lr = 1e-3")] == ["long"]


def test_incompressible_text_of_a_few_kb_is_found_by_equality(kb, tmp_path):
    text = random_text(3000)               # 9,000 bytes: past a Postgres btree row at any compression
    report, _ = batch(kb, tmp_path, {"id": "cjk", "config": {"prompt": text}, "summary": {"sample": text}})
    assert (report.added, report.failed) == (3, [])
    run = kb.run("cjk")
    assert run.config["prompt"] == text and run.summary["sample"] == text
    assert [r.id for r in kb.runs(where=f"config.prompt = '{text}'")] == ["cjk"]
    assert [r.id for r in kb.runs(where=f"config.prompt = '{text[:-1]}'")] == []


def test_names_and_key_paths_at_their_limits_fit_postgres_index_rows(kb, tmp_path):
    """The widest names allowed, in 4-byte characters: run id, project, tag and metric name of
    MAX_NAME characters and a config key path of MAX_KEY, all in index rows on Postgres."""
    wide = "\U0001F600"
    seg = wide * ((MAX_KEY - len('config."".""')) // 2)
    record = {"id": wide * MAX_NAME, "project": wide * MAX_NAME, "tags": [wide * MAX_NAME],
              "config": {seg: {seg: random_text(2000)}}, "metrics": {wide * MAX_NAME: [[0, 1.0]]}}
    report, _ = batch(kb, tmp_path, record)
    assert (report.added, report.failed) == (3, [])
    run = kb.run(wide * MAX_NAME)
    assert run.config == record["config"] and run.metrics == record["metrics"] and run.tags == record["tags"]


@pytest.mark.parametrize("record,field", [
    ({"id": "i" * (MAX_NAME + 1), "config": {"a": 1}}, "id"),
    ({"project": "p" * (MAX_NAME + 1), "config": {"a": 1}}, "project"),
    ({"config": {"a": 1}, "tags": ["ok", "t" * (MAX_NAME + 1)]}, "tags.1"),
    ({"metrics": {"m" * (MAX_NAME + 1): [[0, 1.0]]}}, "metrics." + "m" * 40),
    ({"config": {"k" * (MAX_NAME + 1): 1}}, "config"),
])
def test_a_name_past_its_limit_is_rejected_naming_it(kb, tmp_path, record, field):
    report, path = batch(kb, tmp_path, record)
    assert_rejected(report, path, field, f"the limit is {MAX_NAME}")


def test_a_key_path_past_its_limit_is_rejected_naming_it(kb, tmp_path):
    seg = "k" * 150
    report, path = batch(kb, tmp_path, {"config": {seg: {seg: {seg: 1}}}})
    assert_rejected(report, path, f"config.{seg}.{seg}.{seg}"[:197] + "...", f"longer than {MAX_KEY}")


# ---- 2: NUL (Postgres: "text fields cannot contain NUL (0x00) bytes", and the batch aborted) ---

@pytest.mark.parametrize("record,field", [
    ({"config": {"a": "x\u0000y"}}, "config.a"),
    ({"config": {"a\u0000": 1}}, "config"),
    ({"config": {"a": 1}, "name": "\u0000"}, "name"),
    ({"config": {"a": 1}, "notes": "before\u0000after"}, "notes"),
    ({"config": {"a": 1}, "tags": ["\u0000"]}, "tags.0"),
    ({"metrics": {"lo\u0000ss": [[0, 1.0]]}}, "metrics.lo\u0000ss"),
    ({"config": {"a": 1}, "summary": {"note": ["\u0000"]}}, "summary.note.0"),
    ({"config": {"a": 1}, "failure": {"kind": "oom", "message": "\u0000"}}, "failure.message"),
    ({"config": {"a": 1}, "code": {"entrypoint": "\u0000"}}, "code.entrypoint"),
])
def test_nul_is_rejected_alike_on_both_stores_and_the_batch_goes_on(kb, tmp_path, record, field):
    report, path = batch(kb, tmp_path, record)
    assert_rejected(report, path, field, "NUL")


def test_a_note_with_a_stray_nul_past_its_head_goes_in_on_both_stores(kb, tmp_path):
    path = tmp_path / "postmortem.md"
    path.write_text("# Postmortem\n\n" + "words " * 2000 + "\x00 after the NUL\n")
    report = kb.ingest(str(path), index=False)
    assert report.added > 0 and report.failed == []


# ---- 4: nesting (RecursionError, and the next record lost) ------------------------------------

@pytest.mark.parametrize("opener,closer", [("[", "]"), ('{"a":', "}")])
def test_json_nested_5000_levels_is_rejected_and_the_next_line_stored(kb, tmp_path, opener, closer):
    deep = '{"config": {"x": ' + opener * 5000 + "1" + closer * 5000 + "}}"
    report, path = batch(kb, tmp_path, deep)
    assert_rejected(report, path, "", f"deeper than {MAX_DEPTH} levels")
    (tmp_path / "deep.json").write_text(deep)
    only = kb.ingest(str(tmp_path / "deep.json"), index=False)
    assert only.added == 0 and f"deeper than {MAX_DEPTH} levels" in only.failed[0]["error"]


def nested(levels: int):
    value = 1
    for _ in range(levels):             # the config object itself is the first level
        value = {"n": value}
    return value


def test_nesting_up_to_the_limit_is_kept_and_one_more_level_is_rejected(kb, tmp_path):
    report, _ = batch(kb, tmp_path, {"id": "deep", "config": nested(MAX_DEPTH)})
    assert (report.added, report.failed) == (3, [])
    assert kb.run("deep").config == nested(MAX_DEPTH)
    report, path = batch(kb, tmp_path, {"config": nested(MAX_DEPTH + 1)}, name="b2.jsonl")
    assert_rejected(report, path, "config" + ".n" * MAX_DEPTH, f"deeper than {MAX_DEPTH} levels")


# ---- 5: dates at the calendar's edge (OverflowError, batch aborted) ----------------------------

@pytest.mark.parametrize("when", ["9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+01:00"])
def test_a_time_outside_the_calendar_in_utc_is_rejected_naming_the_field(kb, tmp_path, when):
    report, path = batch(kb, tmp_path, {"config": {"a": 1}, "started_at": when})
    assert_rejected(report, path, "started_at", "years 1 to 9999")


@pytest.mark.parametrize("when,utc", [
    ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00+00:00"),
    ("9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59.999999+00:00"),
    ("9999-12-31T23:59:59+05:00", "9999-12-31T18:59:59+00:00"),
    ("0001-01-01T05:00:00+05:00", "0001-01-01T00:00:00+00:00"),
])
def test_times_at_the_edge_of_the_calendar_read_back_in_utc(kb, tmp_path, when, utc):
    report, _ = batch(kb, tmp_path, {"id": "edge", "config": {"a": 1}, "ended_at": when})
    assert (report.added, report.failed) == (3, [])
    assert kb.run("edge").ended_at.isoformat() == utc


# ---- numbers: one behaviour on both stores ------------------------------------------------------

def test_numbers_at_the_edges_read_back_exactly(kb, tmp_path):
    config = {"max": 2**63 - 1, "min": -2**63, "big": 1.7976931348623157e308, "tiny": 5e-324, "neg0": -0.0}
    curve = [[0, 1.7976931348623157e308], [2**63 - 1, 5e-324, 1.7e9]]
    report, _ = batch(kb, tmp_path, {"id": "edges", "config": config, "metrics": {"m": curve}})
    assert (report.added, report.failed) == (3, [])
    run = kb.run("edges")
    assert run.config == config and all(type(run.config[k]) is type(v) for k, v in config.items())
    assert math.copysign(1, run.config["neg0"]) == -1
    assert run.metrics["m"] == curve
    assert [r.id for r in kb.runs(where="config.max > 9e18")] == ["edges"]


@pytest.mark.parametrize("line,field,words", [
    ('{"config": {"a": 9223372036854775808}}', "config.a", ["64 bits"]),
    ('{"config": {"a": -9223372036854775809}}', "config.a", ["64 bits"]),
    ('{"config": {"a": 1e400}}', "config.a", ["not finite"]),
    ('{"metrics": {"m": [[9223372036854775808, 1.0]]}}', "metrics.m.0.0", ["out of range"]),
    ('{"metrics": {"m": [[-1, 1.0]]}}', "metrics.m.0.0", ["out of range"]),
    ('{"metrics": {"m": [[0, 1' + "0" * 400 + ']]}}', "metrics.m.0.1", ["range of a float"]),
    ('{"config": {"a": 1}, "scale": {"params": 99999999999999999999}}', "scale.params", ["64 bits"]),
])
def test_numbers_out_of_range_are_rejected_naming_the_field(kb, tmp_path, line, field, words):
    report, path = batch(kb, tmp_path, line)
    assert_rejected(report, path, field, *words)


# ---- 12: lax types in curve points ----------------------------------------------------------------

@pytest.mark.parametrize("point,field,words", [
    ([True, 1.0], "metrics.loss.0.0", ["a step is an integer", "true"]),
    ([0, True], "metrics.loss.0.1", ["not a valid number", "true"]),
    (["5", "1.5"], "metrics.loss.0.0", ["a step is an integer", '"5"']),
    ([5, "1.5"], "metrics.loss.0.1", ["not a valid number", '"1.5"']),
    ([5.0, 1.5], "metrics.loss.0.0", ["a step is an integer", "5.0"]),
    ([0, 1.0, "1700000000"], "metrics.loss.0.2", ["wall time", "finite number or null"]),
    ([0, 1.0, False], "metrics.loss.0.2", ["wall time"]),
    ([0, "nan"], "metrics.loss.0.1", ["not a valid number"]),
])
def test_curve_points_take_strict_types(kb, tmp_path, point, field, words):
    report, path = batch(kb, tmp_path, {"metrics": {"loss": [point]}})
    assert_rejected(report, path, field, *words)


# ---- 13: curve values keep their meaning on the way back -------------------------------------------

CURVE = [[0, None], [1, float("nan")], [2, float("inf")], [3, float("-inf")], [4, 1.5, None], [5, 1.25, 1.7e9],
         [6, None, None], [7, float("nan"), None], [8, "NaN"], [9, "-Infinity", 3.0]]
AS_JSON = [[0, None], [1, "NaN"], [2, "Infinity"], [3, "-Infinity"], [4, 1.5, None], [5, 1.25, 1.7e9],
           [6, None, None], [7, "NaN", None], [8, "NaN"], [9, "-Infinity", 3.0]]


def same_point(a, b) -> bool:
    return len(a) == len(b) and all(x == y or (isinstance(x, float) and isinstance(y, float) and
                                               math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def test_null_nan_and_infinities_read_back_apart(kb, tmp_path):
    path = tmp_path / "curve.jsonl"
    path.write_text(json.dumps({"id": "c", "status": "completed", "metrics": {"acc": CURVE}}) + "\n")
    assert kb.ingest(str(path), index=False).added == 1
    got = kb.run("c").metrics["acc"]
    want = [[p[0], {"NaN": math.nan, "-Infinity": -math.inf}.get(p[1], p[1]), *p[2:]] for p in CURVE]
    assert all(same_point(g, w) for g, w in zip(got, want)) and len(got) == len(want), got
    assert kb.run("c").as_dict()["metrics"]["acc"] == AS_JSON


def test_null_and_nan_are_different_content(kb, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "c", "metrics": {"acc": [[0, 1.0], [1, None]]}}) + "\n")
    assert kb.ingest(str(path), index=False).added == 1
    path.write_text(json.dumps({"id": "c", "metrics": {"acc": [[0, 1.0], [1, float("nan")]]}}) + "\n")
    assert kb.ingest(str(path), index=False).updated == 1
    assert math.isnan(kb.run("c").metrics["acc"][1][1])


KB = shutil.which("kb") or str(Path(sys.executable).parent / "kb")


def test_kb_show_json_spells_non_finite_values_and_keeps_null(tmp_path, database_url):
    path = tmp_path / "curve.jsonl"
    path.write_text(json.dumps({"id": "c", "status": "completed", "metrics": {"acc": CURVE}}) + "\n")
    env = dict(os.environ, KB_HOME=str(tmp_path / "home"), KB_DATABASE_URL=database_url, HF_HUB_OFFLINE="1")
    subprocess.run([KB, "ingest", str(path), "--no-index"], env=env, check=True, capture_output=True, timeout=300)
    shown = subprocess.run([KB, "show", "c", "--json", "--points"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["metrics"]["acc"] == AS_JSON
    brief = subprocess.run([KB, "show", "c", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(brief.stdout)["metrics"]["acc"] == {"points": 10, "first": [0, None],
                                                          "last": [9, "-Infinity", 3.0]}


# ---- 14: messages ---------------------------------------------------------------------------------

def test_a_lone_surrogate_is_rejected_naming_the_field(kb, tmp_path):
    report, path = batch(kb, tmp_path, '{"config": {"opt": {"name": "adam\\ud800"}}}')
    assert_rejected(report, path, "config.opt.name", "lone surrogate", "\\ud800")
    assert "serializ" not in report.failed[0]["error"]


def test_a_point_of_four_items_is_named_for_what_it_is(kb, tmp_path):
    report, path = batch(kb, tmp_path, {"metrics": {"loss": [[0, 1.0], [0, 1, 2, 3]]}})
    assert_rejected(report, path, "metrics.loss.1", "[step, value] or [step, value, wall_time]", "4 items")


def test_a_utf8_byte_order_mark_is_skipped(kb, tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(dict(GOOD, id="jsonl")).encode() + b"\r\n")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(dict(GOOD, id="json")).encode())
    report = kb.ingest(str(tmp_path / "bom.jsonl"), str(tmp_path / "bom.json"), index=False)
    assert (report.added, report.failed) == (2, [])
    assert kb.run("jsonl").config == kb.run("json").config == GOOD["config"]


def test_a_record_holding_keys_named_state_and_history_is_read_as_a_record(kb, tmp_path):
    """Found by the fuzz tests: such a .json was taken for a W&B export, and its curves were lost."""
    record = {"id": "h", "config": {"optimizer": {"state": "adam"}, "history": 3}, "summary": {"acc": 0.5},
              "metrics": {"loss": [[0, 1.0], [1, 0.5]]}}
    (tmp_path / "one.json").write_text(json.dumps(record))
    (tmp_path / "many.json").write_text(json.dumps([dict(record, id="h2")]))
    report = kb.ingest(str(tmp_path / "one.json"), str(tmp_path / "many.json"), index=False)
    assert (report.added, report.failed) == (2, [])
    assert kb.run("h").metrics == kb.run("h2").metrics == record["metrics"]


# ---- found by the fuzz tests in the ablation refresh ---------------------------------------------

def test_an_ablation_over_huge_losses_does_not_end_the_ingest(kb, tmp_path):
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{seed}-lr{lr}", "config": {"lr": lr, "seed": seed},
                                        "summary": {"val/loss": 1.5e308}}) + "\n" for lr in (1, 2) for seed in (0, 1)))
    assert kb.ingest(str(path), index=False).added == 4
