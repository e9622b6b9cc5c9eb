"""Property tests (hypothesis) for the table ingester (CSV, TSV, Parquet), on SQLite and Postgres.

The property (issue 7): every data row of a generated table either goes in and reads back
through KnowledgeBase exactly as its cells say, or is refused naming the file, its line
(Parquet: `row-N`) and its column; a row built only from what a table may hold always goes in,
and no row takes another with it. What a cell says is the table ingester's documented typing,
restated here: integers, decimals and true/false are typed, the rest is text (stripped); an
empty cell is no value; NaN, infinities and integers past 64 bits are spelled as
kb.records.json_safe spells them ("NaN", "Infinity", the digits).

    pytest tests/test_fuzz_table.py -q                                # sized for CI
    KB_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_table.py -q         # or: pytest --long
"""
from __future__ import annotations

import csv
import io
import math
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kb.records import MAX_NAME
from kb.vocab import column_target, fold
from tests.fuzzing import examples

FUZZ = settings(max_examples=examples(15), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
INT64 = 2**63 - 1
DELIMITERS = ",;\t|"
FIELD_WORDS = {"id", "name", "project", "status", "tags", "tag", "notes", "started at", "ended at", "parent",
               "run id", "run name", "run", "state"}

# ---- cells: (text written, value it reads back as, whether it can be stored) ------------------------


@dataclass(frozen=True)
class Cell:
    text: str
    value: object               # None: no value (the key is absent)
    ok: bool = True             # False: the row holding it must be refused


def spelled(x: float):
    if math.isnan(x):
        return "NaN"
    return x if math.isfinite(x) else ("Infinity" if x > 0 else "-Infinity")


def as_int(v: int):
    return v if -INT64 - 1 <= v <= INT64 else str(v)


def plain_text(delimiter: str):
    """Text that no typing rule reads as a number or a bool: no digits, no nan/inf/true/false word.
    The other delimiters stay out, so sniffing the file's own one is never ambiguous."""
    others = "".join(d for d in DELIMITERS if d != delimiter)
    chars = st.characters(categories=["L", "Zs", "P", "S"], exclude_characters=others + "\ufeff")
    return st.text(chars, min_size=1, max_size=12).filter(
        lambda t: t.strip().lower().lstrip("+-") not in {"nan", "inf", "infinity", "true", "false"})


def cells(delimiter: str):
    ints = st.integers(-2**70, 2**70).map(lambda v: Cell(str(v), as_int(v)))
    floats = st.floats(allow_nan=False, allow_infinity=False).map(lambda x: Cell(repr(x), x))
    bools = st.tuples(st.booleans(), st.sampled_from([str.lower, str.upper, str.title])).map(
        lambda b: Cell(b[1](str(b[0])), b[0]))
    texts = plain_text(delimiter).map(lambda t: Cell(t, t.strip() or None))
    odd = st.sampled_from([
        Cell("", None), Cell("  ", None), Cell("007", "007"), Cell("+5", 5), Cell(" 42 ", 42), Cell("1.", 1.0),
        Cell(".5", 0.5), Cell("3E-4", 3e-4), Cell("nan", "NaN"), Cell("-inf", "-Infinity"),
        Cell("Infinity", "Infinity"), Cell("1e999", "Infinity"), Cell("9" * 5000, "9" * 5000),
        Cell("1\u0662", "1\u0662"), Cell("two\nlines", "two\nlines"), Cell('say "hi"', 'say "hi"'),
        Cell("x" * 200_000, "x" * 200_000),                 # past csv's 128 KiB default, within a record's text
    ])
    hostile = st.sampled_from([Cell("a\x00b", "a\x00b", ok=False), Cell("caf\udce9", None, ok=False)])
    return st.one_of(ints, floats, bools, texts, odd, hostile)


def scale_cells():
    """(cell, scale.params it reads back as or None when refused, config.params it also keeps)."""
    good = st.integers(0, 10**15).map(lambda v: (Cell(str(v), v), v)) | st.sampled_from([
        (Cell("70B", "70B"), 70_000_000_000), (Cell("1.4e9", 1.4e9), 1_400_000_000),
        (Cell("2.5", 2.5), 2)])
    bad = st.sampled_from([(Cell("lots", "lots", ok=False), None), (Cell("nan", "NaN", ok=False), None),
                           (Cell(str(2**64), str(2**64), ok=False), None), (Cell("1e400B", "1e400B", ok=False), None)])
    return good | bad


STATUSES = {"completed": "completed", "Finished": "completed", "FAILED": "failed", "crashed": "failed",
            "diverged": "diverged", "killed": "killed", "preempted": "killed", "running": "running"}

# ---- columns -----------------------------------------------------------------------------------------


def config_names(delimiter: str):
    """Column names the vocabulary does not know, so each goes to config under its own name."""
    return plain_text(delimiter).map(str.strip).filter(
        lambda c: c and column_target(c) is None and fold(c) not in FIELD_WORDS
        and not c.startswith(("scale.", "summary.", "config.", "#")))


@dataclass
class Table:
    delimiter: str
    columns: list[str]
    rows: list[list[Cell]]                      # one Cell per column, in column order
    extra: dict[int, str] = field(default_factory=dict)     # row index -> a surplus trailing cell
    short: dict[int, int] = field(default_factory=dict)     # row index -> trailing cells left out
    header_error: str | None = None             # the column the header is refused for


@st.composite
def tables(draw):
    delimiter = draw(st.sampled_from(DELIMITERS))
    names = draw(st.lists(config_names(delimiter), max_size=4, unique=True))
    known = draw(st.lists(st.sampled_from(["lr", "val_loss", "params", "tags", "status"]), unique=True))
    columns = ["name", *names, *known]
    header_error = None
    if draw(st.integers(0, 9)) == 0:            # a header a table cannot have: one name twice
        columns.append(draw(st.sampled_from(columns)))
        header_error = columns[-1]
    if draw(st.booleans()):                     # a name past the limit: only rows that fill it are refused
        columns.append("k" * (MAX_NAME + 1))
    if draw(st.integers(0, 3)) == 0:            # pandas' unnamed index column: whatever it holds is dropped
        columns.insert(0, "")
    body = cells(delimiter)
    rows = []
    for i in range(draw(st.integers(1, 5))):
        row = []
        for c in columns:
            if c == "name":
                row.append(Cell(f"row-{i}", f"row-{i}"))
            elif c == "":
                row.append(draw(body | st.just(Cell("caf\udce9", None))))
            elif c == "params":
                cell, params = draw(scale_cells())
                row.append(Cell(cell.text, (params, cell.value), cell.ok))
            elif c == "tags":
                tag = plain_text(delimiter).map(str.strip).filter(lambda t: t and not set(t) & set(",;"))
                tags = draw(st.lists(tag, max_size=3))
                row.append(Cell(", ".join(tags), tags or None))
            elif c == "status":
                word = draw(st.sampled_from([*STATUSES, "exploded"]))
                row.append(Cell(word, STATUSES.get(word), word in STATUSES))
            else:
                row.append(draw(body))
        rows.append(row)
    extra = {i: draw(st.sampled_from(["", "surplus"])) for i in range(len(rows)) if draw(st.integers(0, 5)) == 0}
    tail = len(columns) - columns.index("name") - 1
    short = {i: draw(st.integers(1, tail)) for i in range(len(rows)) if tail and i not in extra
             and draw(st.integers(0, 5)) == 0}
    return Table(delimiter, columns, rows, extra, short, header_error)


# ---- writing and reading back ------------------------------------------------------------------------

def write_csv(tmp_path, table: Table, newline: str, bom: bool, comments: bool, quoting: int, tsv: bool) -> tuple:
    """The file, its header's line number, and each data row's first line number."""
    suffix = ".tsv" if table.delimiter == "\t" and tsv else ".csv"     # a tab-separated .csv is sniffed
    path = tmp_path / f"{uuid.uuid4().hex}{suffix}"
    head = f"# exported for a test{newline}{newline}" if comments else ""
    out, lines = [head], head.count(newline)

    # csv.writer quotes a cell holding "\n" only when "\n" ends its lines: with "\r" it would write
    # the newline bare, and the file would say something else than the cells
    quoting = csv.QUOTE_ALL if newline == "\r" else quoting

    def emit(cells: list[str]) -> int:
        nonlocal lines
        buf = io.StringIO()
        csv.writer(buf, delimiter=table.delimiter, lineterminator=newline, quoting=quoting).writerow(cells)
        out.append(buf.getvalue())
        first = lines + 1
        lines += len(list(io.StringIO(buf.getvalue(), newline="")))
        return first

    header = emit(table.columns)
    starts = []
    for i, row in enumerate(table.rows):
        written = [c.text for c in row][:len(row) - table.short.get(i, 0)]
        starts.append(emit(written + ([table.extra[i]] if i in table.extra else [])))
        if i % 2:
            emit([""] * len(table.columns))    # a blank spreadsheet row: skipped, never a run
    data = "".join(out).encode("utf-8", "surrogateescape")      # "\udce9" becomes the byte 0xe9
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
    return path.resolve(), header, starts


def same(a, b) -> bool:
    """JSON equality with types kept apart (1, 1.0 and true are three values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def expected(table: Table, row: list[Cell], short: int) -> tuple[dict, set[str]]:
    """What the row reads back as ({config, summary, scale, tags, status}), and the columns that
    must refuse it (empty: it must go in). The last `short` cells were not written."""
    want = {"config": {}, "summary": {}, "scale": {}, "tags": [], "status": "completed"}
    refuse = set()
    for column, cell in list(zip(table.columns, row))[:len(row) - short]:
        if column in ("name", ""):
            continue
        if not cell.ok:
            refuse.add(column)
        elif cell.value is None:
            continue
        elif len(column) > MAX_NAME:
            refuse.add(column)
        elif column == "params":
            want["scale"]["params"], want["config"]["params"] = cell.value
        elif column in ("tags", "status"):
            want[column] = cell.value
        elif column == "val_loss":
            want["summary"][column] = cell.value
        else:
            want["config"][column] = cell.value
    return want, refuse


def check(kb, table: Table, path, header: int, starts: list[int], report, project: str) -> None:
    for f in report.failed:
        assert f["source"] == str(path) and f["error"] and "\n" not in f["error"], f
    if table.header_error:
        assert report.added == 0 and len(report.failed) == 1, report.failed
        assert (report.failed[0]["line"], report.failed[0]["field"]) == (header, table.header_error)
        return
    failed = {f["line"]: f for f in report.failed}
    assert len(failed) == len(report.failed), report.failed          # one failure per bad row
    runs = {r.name: r for r in kb.runs(project=project)}
    for i, (row, line) in enumerate(zip(table.rows, starts)):
        want, refuse = expected(table, row, table.short.get(i, 0))
        surplus = table.extra.get(i) == "surplus"
        name = f"row-{i}"
        if refuse or surplus or not want["config"]:        # summary alone is no run: config or metrics
            assert name not in runs, (name, row)
            f = failed.pop(line, None)
            assert f is not None, (line, row, report.failed)
            if surplus:
                assert f["field"] == "", f                 # a surplus cell has no column
            elif refuse:
                assert f["field"] in refuse, (f, refuse)
            continue
        assert line not in failed, (failed[line], row)
        run = runs[name]
        scale = {k: v for k, v in run.scale.items() if v is not None}
        got = {"config": run.config, "summary": run.summary, "scale": scale, "tags": run.tags, "status": run.status}
        assert same(got, want), (got, want)
    assert not failed, failed
    assert report.added == len(runs)


@FUZZ
@given(table=tables(), newline=st.sampled_from(["\n", "\r\n", "\r"]), bom=st.booleans(), comments=st.booleans(),
       quoting=st.sampled_from([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]), tsv=st.booleans())
def test_every_csv_row_reads_back_exactly_or_is_refused_alone(kb, tmp_path, table, newline, bom, comments, quoting,
                                                               tsv):
    path, header, starts = write_csv(tmp_path, table, newline, bom, comments, quoting, tsv)
    project = f"p-{uuid.uuid4().hex[:8]}"
    report = kb.ingest(str(path), format="table", project=project, index=False)
    check(kb, table, path, header, starts, report, project)


# ---- Parquet ----------------------------------------------------------------------------------------

text_values = st.text(st.characters(exclude_categories=["Cs"]), max_size=10)


@st.composite
def parquet_columns(draw):
    """{column: (arrow type, [values], [expected config value or None, ok])} for a few typed columns."""
    import pyarrow as pa

    n = draw(st.integers(1, 5))
    kinds = {
        "int64": (pa.int64(), st.integers(-2**63, INT64), lambda v: (v, True)),
        "float64": (pa.float64(), st.floats(), lambda v: (spelled(v), True)),
        "bool": (pa.bool_(), st.booleans(), lambda v: (v, True)),
        "string": (pa.string(), text_values | st.just("a\x00b"),
                   lambda v: (v if v.strip() else None, "\x00" not in v)),
        "list": (pa.list_(pa.int64()), st.lists(st.integers(-5, 5), max_size=3), lambda v: (v, True)),
    }
    columns = {}
    for name in draw(st.lists(config_names(","), min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(sorted(kinds)))
        arrow, values, expect = kinds[kind]
        vals = draw(st.lists(st.none() | values, min_size=n, max_size=n))
        columns[name] = (arrow, vals, [(None, True) if v is None else expect(v) for v in vals])
    return n, columns


@FUZZ
@given(drawn=parquet_columns(), start=st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
       tags=st.lists(st.none() | st.sampled_from(["a", "b c", " "]), max_size=3))
def test_every_parquet_row_reads_back_exactly_or_is_refused_alone(kb, tmp_path, drawn, start, tags):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, columns = drawn
    path = (tmp_path / f"{uuid.uuid4().hex}.parquet").resolve()
    data = {"name": pa.array([f"row-{i}" for i in range(n)])}
    data |= {c: pa.array(vals, arrow) for c, (arrow, vals, _) in columns.items()}
    data["started_at"] = pa.array([start.replace(tzinfo=timezone.utc)] * n, pa.timestamp("us", tz="UTC"))
    data["tags"] = pa.array([tags] * n, pa.list_(pa.string()))
    pq.write_table(pa.table(data), path)
    project = f"p-{uuid.uuid4().hex[:8]}"
    report = kb.ingest(str(path), project=project, index=False)
    runs = {r.name: r for r in kb.runs(project=project)}
    failed = {f["field"].split(".", 1)[0]: f for f in report.failed}
    assert len(failed) == len(report.failed) and all(f["source"] == str(path) for f in report.failed), report.failed
    for i in range(n):
        want = {c: exp[i][0] for c, (_, _, exp) in columns.items() if exp[i][0] is not None}
        bad = {c for c, (_, _, exp) in columns.items() if not exp[i][1]}
        if bad or not want:
            f = failed.pop(f"row-{i + 1}")
            assert not bad or f["field"].split(".", 1)[1] in bad, f
            assert f"row-{i}" not in runs
            continue
        run = runs[f"row-{i}"]
        assert same(run.config, want), (run.config, want)
        assert run.tags == [t.strip() for t in tags if t and t.strip()]
        assert run.started_at.replace(tzinfo=timezone.utc) == start.replace(tzinfo=timezone.utc)
    assert not failed, failed
