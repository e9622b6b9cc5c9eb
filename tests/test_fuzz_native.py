"""Property tests (hypothesis) for the native record and JSONL framing, on SQLite and Postgres.

The property (issue 7): every generated record either goes in and reads back exactly as given,
or is rejected naming its file and line (and its field, where it is a JSON object), leaving
nothing of itself behind; the other records of the batch are stored whatever their neighbours
hold. Valid records (built only from what the contract allows) must all go in: that keeps the
first property from passing by rejecting everything.

    pytest tests/test_fuzz_native.py -q                 # sized for CI
    KB_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_native.py -q     # or: pytest --long
"""
from __future__ import annotations

import json
import math
import uuid
from datetime import datetime, timedelta, timezone

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kb.errors import NotFound
from kb.records import text_problem
from tests.fuzzing import examples

FUZZ = settings(max_examples=examples(25), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])

# ---- what the contract allows ---------------------------------------------------------------------

NAMED = ["lr", "learning_rate", "batch_size", "n_layer", "d_model", "seq_len", "block_size", "seed", "params",
         "tokens", "warmup", "val/loss", "val_loss", "train/loss", "loss", "grad_norm", "a.b", 'q"uote', "0", ""]
chars = st.characters(exclude_characters="\x00", exclude_categories=["Cs"])
text = st.text(chars, max_size=12)
key = st.sampled_from(NAMED) | text
int64 = st.integers(-2**63, 2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
leaf = st.none() | st.booleans() | int64 | finite | text
json_value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(key, kids, max_size=3),
                          max_leaves=8)
mapping = st.dictionaries(key, json_value, max_size=5)

value = finite | st.sampled_from([None, math.nan, math.inf, -math.inf, "NaN", "Infinity", "-Infinity"])
step = st.integers(0, 2**63 - 1) | st.integers(0, 1000)
point = st.tuples(step, value).map(list) | st.tuples(step, value, st.none() | finite).map(list)
metrics = st.dictionaries(st.sampled_from(NAMED[:16]) | text.filter(bool), st.lists(point, max_size=6), max_size=3)
zone = st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: timezone(timedelta(minutes=m)))
moment = st.datetimes(min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 30), timezones=zone)
name = st.text(chars, min_size=1, max_size=20).filter(str.strip)

optional = {
    "project": name, "name": name, "status": st.sampled_from(["completed", "failed", "diverged", "running", "killed"]),
    "summary": mapping, "tags": st.lists(name, max_size=3), "notes": st.text(chars, max_size=40),
    "parent": name, "hypothesis": name, "started_at": moment, "ended_at": moment, "meta": mapping,
    "scale": st.fixed_dictionaries({}, optional={"params": st.integers(0, 2**63 - 1), "flops": finite,
                                                 "tokens": st.integers(0, 2**63 - 1)}),
    "failure": st.fixed_dictionaries({"kind": st.sampled_from(["oom", "diverged", "nccl_timeout", "killed"])},
                                     optional={"step": st.integers(0, 10**6), "message": st.text(chars, max_size=20)}),
    "code": st.fixed_dictionaries({}, optional={"git_commit": text, "entrypoint": text}),
}
valid_record = st.fixed_dictionaries({"config": mapping, "metrics": metrics}, optional=optional).filter(
    lambda r: r["config"] or any(r["metrics"].values()))       # a curve without points is no content

# ---- what a hostile or unlucky user feeds it -------------------------------------------------------

hostile_text = st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", "\U0001F600" * 201, "y" * 3000,
                                "\u2028", "\ufeff", "\r", "'; drop table run; --"]) | st.text(max_size=8)
hostile_leaf = (hostile_text | st.sampled_from([2**63, -2**63 - 1, 10**400, math.inf, -math.inf, math.nan]))
too_deep = st.integers(60, 70).map(lambda n: json.loads("[" * n + "1" + "]" * n)) | st.just({"k": [[[[[[1]]]]]]})
hostile_point = st.sampled_from([[True, 1.0], [0, True], ["5", "1.5"], [0, 1, 2, 3], [], [0], 5, None, [0, "x"],
                                 [1.5, 1.0], [-1, 1.0], [2**63, 1.0], [0, 1.0, math.nan], [0, 1.0, "t"],
                                 [0, 10**400], [0, "nan"], [0, {"v": 1}]])
hostile_time = st.sampled_from(["9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+01:00", "not a date",
                                "2024-13-01", 10**20, -1, "0000-01-01T00:00:00Z", "", True])


@st.composite
def hostile_record(draw, unknown_keys: bool = True):
    """A valid record with one part made hostile (or not: some come through unharmed)."""
    record = draw(valid_record)
    where = draw(st.sampled_from(["config", "summary", "meta", "metrics", "point", "id", "project", "name",
                                  "tags", "notes", "time", "key", "type", "deep", "none"]))
    bad = draw(hostile_leaf | too_deep)
    if where in ("config", "summary", "meta"):
        record[where] = {**record.get(where, {}), draw(key): bad}
    elif where == "point":
        record["metrics"] = {**record["metrics"], draw(name): [[0, 1.0], draw(hostile_point)]}
    elif where == "metrics":
        record["metrics"] = {**record["metrics"], draw(hostile_text): [[0, 1.0]]}
    elif where in ("id", "project", "name", "notes"):
        record[where] = draw(hostile_text)
    elif where == "tags":
        record["tags"] = [draw(hostile_text)]
    elif where == "time":
        record[draw(st.sampled_from(["started_at", "ended_at"]))] = draw(hostile_time)
    elif where == "key":
        record["config"] = {**record["config"], draw(hostile_text): 1}
    elif where == "type":
        field = draw(st.sampled_from(["config", "metrics", "tags", "status", "scale", "failure"]
                                     + ["bogus"] * unknown_keys))
        record[field] = draw(st.sampled_from([[1], "x", 1, None, {"x": 1}]))
    elif where == "deep":
        record["config"] = {**record["config"], "deep": draw(too_deep)}
    return record


# ---- reading back ----------------------------------------------------------------------------------

SPELLED = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def same(a, b) -> bool:
    """JSON equality with types kept apart (1, 1.0 and true are three values) and NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def as_point(p: list) -> list:
    v = SPELLED.get(p[1], p[1]) if isinstance(p[1], str) else p[1]
    return [p[0], None if v is None else float(v), *p[2:]]


def utc(t) -> str:
    t = t if isinstance(t, datetime) else datetime.fromisoformat(t)
    return (t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)).isoformat()


def assert_reads_back(kb, record: dict) -> None:
    run = kb.run(record["id"])
    assert same(run.config, record["config"]), (run.config, record["config"])
    curves = {k: pts for k, pts in record["metrics"].items() if pts}     # an empty curve is no curve
    assert list(run.metrics) == list(curves), (list(run.metrics), list(curves))
    for k, pts in curves.items():
        assert same(run.metrics.get(k, []), [as_point(p) for p in pts]), (k, run.metrics.get(k), pts)
    for k, v in record.get("summary", {}).items():
        assert same(run.summary[k], v), (k, run.summary[k], v)
    for k, v in record.get("scale", {}).items():
        assert same(run.scale[k], v)
    assert run.project == record.get("project", "default")
    assert run.name == record.get("name", record["id"])
    assert run.tags == record.get("tags", []) and run.notes == record.get("notes", "")
    assert same(run.meta, record.get("meta", {})) and run.code == record.get("code", {})
    assert (run.parent, run.hypothesis) == (record.get("parent"), record.get("hypothesis"))
    if "status" in record:
        assert run.status == record["status"]
    for when in ("started_at", "ended_at"):
        if when in record:
            assert utc(getattr(run, when)) == utc(record[when])
    if record.get("failure"):
        reported = [f for f in run.failures if f["origin"] == "reported"][0]
        assert reported["kind"] == record["failure"]["kind"]
        assert reported["message"] == record["failure"].get("message", "")
    shown = run.as_dict()["metrics"]                    # the `kb show --json` shape
    for k, pts in curves.items():
        assert shown[k] == [[p[0], _spelled(as_point(p)[1]), *p[2:]] for p in pts]


def _spelled(v):
    if v is None or math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")


def to_line(record: dict) -> bytes:
    return json.dumps(record, default=datetime.isoformat).encode()     # ASCII: "\\ud800" stays an escape


def is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def ingest_lines(kb, tmp_path, lines: list[bytes], newline: bytes = b"\n", bom: bool = False, final: bool = True):
    path = tmp_path / f"{uuid.uuid4().hex}.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + newline.join(lines) + (newline if final else b""))
    return path, kb.ingest(str(path), index=False)


def check_batch(kb, path, report, lines: list[bytes], records: dict[int, dict], must_store: set[int]) -> None:
    """records: line number -> the record written there (junk lines have none)."""
    failed = {f["line"]: f for f in report.failed}
    assert len(failed) == len(report.failed), report.failed           # one failure per bad line
    for f in report.failed:
        assert f["source"] == str(path) and f["error"] and "\n" not in f["error"], f
        assert not f["error"].startswith("Error serializing"), f
    stored = 0
    for lineno, line in enumerate(lines, start=1):
        record = records.get(lineno)
        if lineno in failed:
            assert lineno not in must_store, (failed[lineno], record)
            f = failed[lineno]
            if record is not None and is_object(line) and "`config` or `metrics`" not in f["error"] \
                    and "deeper than" not in f["error"]:
                assert f["field"], f                       # a JSON object's problem has a place
            if record is not None and isinstance(record.get("id"), str) and not text_problem(record["id"]):
                try:
                    kb.run(record["id"])
                    raise AssertionError(f"line {lineno} was rejected but run {record['id']!r} exists")
                except NotFound:
                    pass
        elif record is not None:
            assert_reads_back(kb, record)
            stored += 1
        else:
            assert not line.strip(), (lineno, line)       # junk is rejected unless it is blank
    assert report.added == stored


def unique_ids(records: list[dict]) -> list[dict]:
    """Each example writes into the same store: ids carry the example's own prefix."""
    tag = uuid.uuid4().hex[:8]
    for i, r in enumerate(records):
        r["id"] = f"{tag}-{i}-{r['id']}" if isinstance(r.get("id"), str) else f"{tag}-{i}"
    return records


# ---- the properties --------------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
def test_valid_records_all_go_in_and_read_back_exactly(kb, tmp_path, data):
    records = unique_ids(data.draw(st.lists(valid_record, min_size=1, max_size=4)))
    lines = [to_line(r) for r in records]
    path, report = ingest_lines(kb, tmp_path, lines)
    assert report.failed == []
    check_batch(kb, path, report, lines, dict(enumerate(records, start=1)), set(range(1, len(lines) + 1)))


@FUZZ
@given(data=st.data())
def test_hostile_records_are_stored_exactly_or_rejected_alone(kb, tmp_path, data):
    drawn = data.draw(st.lists(st.tuples(st.just(False), hostile_record()) | st.tuples(st.just(True), valid_record),
                               min_size=2, max_size=5))
    records = unique_ids([r for _, r in drawn])
    lines = [to_line(r) for r in records]
    path, report = ingest_lines(kb, tmp_path, lines)
    valid = {i for i, (ok, _) in enumerate(drawn, start=1) if ok}
    check_batch(kb, path, report, lines, dict(enumerate(records, start=1)), valid)


random_junk = (st.binary(max_size=40) | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")))
junk = (random_junk.filter(lambda b: b'"config"' not in b and b'"metrics"' not in b)     # never a record
        | st.sampled_from([b"[1, 2]", b"null", b'"x"', b"{}", b"{", b'{"config": {}}', b"\xef\xbb\xbf{}",
                           b"\x00", b"  ", b"\t\r", b'{"config": {"a": 1}} trailing', b"[" * 300 + b"]" * 300,
                           b'{"metrics": {"m": [' + b"[" * 5000 + b"]" * 5000 + b"]}}"]))
junk = junk.map(lambda b: b.replace(b"\n", b" "))


@FUZZ
@given(data=st.data(), newline=st.sampled_from([b"\n", b"\r\n"]), bom=st.booleans(), final=st.booleans())
def test_jsonl_framing_keeps_every_good_line(kb, tmp_path, data, newline, bom, final):
    kinds = data.draw(st.lists(st.sampled_from(["record", "junk", "blank"]), min_size=1, max_size=8))
    records = unique_ids([data.draw(valid_record) for k in kinds if k == "record"])
    lines, by_line, it = [], {}, iter(records)
    for lineno, kind in enumerate(kinds, start=1):
        if kind == "record":
            by_line[lineno] = next(it)
            lines.append(to_line(by_line[lineno]))
        elif kind == "blank":
            lines.append(data.draw(st.sampled_from([b"", b" ", b"\t", b"  \r"])))
        else:
            lines.append(data.draw(junk))
    path, report = ingest_lines(kb, tmp_path, lines, newline=newline, bom=bom, final=final)
    lines = [line.rstrip(b"\r") if newline == b"\r\n" else line for line in lines]
    check_batch(kb, path, report, lines, by_line, set(by_line))


@FUZZ
@given(data=st.data())
def test_a_json_list_file_keeps_every_good_record(kb, tmp_path, data):
    # no keys a record lacks: a list holding such an object may be another tracker's export
    # (a W&B export's "history"), which that tracker's reader claims
    drawn = st.lists(hostile_record(unknown_keys=False) | valid_record, min_size=1, max_size=4)
    records = unique_ids(data.draw(drawn))
    path = tmp_path / f"{uuid.uuid4().hex}.json"
    path.write_bytes(b"[" + b",\n".join(to_line(r) for r in records) + b"]")
    report = kb.ingest(str(path), index=False)
    failed = {f["field"].split(".")[0]: f for f in report.failed}
    assert all(f["source"] == str(path) and f["error"] for f in report.failed), report.failed
    for i, record in enumerate(records):
        if f"[{i}]" in failed:
            continue
        try:
            assert_reads_back(kb, record)
        except AssertionError as exc:
            raise AssertionError(f"record [{i}] ({report}): {exc}") from None
    assert report.added + len(report.failed) == len(records), report
