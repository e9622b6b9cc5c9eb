"""Tables of runs: a CSV, TSV or Parquet file whose every row is one run.

Sweep spreadsheets and published tables (a scaling-law paper's model size, tokens and final
loss) go in without code. The first row names the columns (lines starting with `#` above it
are comments); each column goes to one place in the native record:

  id, name, project, status (or state), tags, notes,   the record's own fields; tags split on
  started_at, ended_at, parent                         `,` or `;`
  scale.X, summary.X, config.a.b                       there, as named (a table kb wrote)
  a scale quantity: params, N, tokens, D, compute, C   scale.params|tokens|flops|gpus|gpu_hours,
                                                       and config.<column> too: a row's size and
                                                       data are what its run was configured with
  a metric: loss, val_loss, eval/accuracy, ...         summary.<column>
  anything else: lr, batch_size, seed, my_flag         config.<column>

as `kb.vocab.column_target` names them. `--map COLUMN=KEY` overrides one column: KEY is
`scale.params`, `summary.val/loss` (one flat key), `config.optim.lr` (nested), a record field
(`name`, `tags`, ...) or `-` to drop the column.

Cells are typed: integers, decimals (with exponents; `3,5e-4` too in a `;`-separated file),
true/false; anything else is text. An empty cell is no value. NaN, inf and integers past 64
bits are stored as kb.records.json_safe writes them (the strings "NaN", "Infinity", digits).
Scale cells must be numbers (`70B`, `1.4T` read as 7e10, 1.4e12); params, tokens and gpus are
rounded to integers. A `.csv` file's delimiter is sniffed (`,`, `;`, tab or `|`); `.tsv` is tabs.

Run name: the name (else id) column, else `<file stem> row <n>`, n counting data rows from 1.
Source URI `<abs file>#row-<n>`: a row keeps its run on re-ingest. A bad row is rejected
naming its line (Parquet: `row-<n>`) and column; the other rows go in.

    kb ingest points.csv            kb ingest sweep.tsv --map val=summary.val/loss --map host=-
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from ingest.base import register, rejected
from kb.errors import InvalidRecord
from ingest.table_csv import header_index, not_utf8, printable, rows, sniff, text_lines
from kb.records import MAX_NAME, Item, Parsed, json_safe, parse_run, text_problem
from kb.vocab import column_target, fold

SUFFIXES = {".csv", ".tsv", ".parquet", ".pq"}
FIELDS = ("id", "name", "project", "status", "tags", "notes", "started_at", "ended_at", "parent")
FIELD_COLUMNS = {fold(f): f for f in FIELDS} | {"run id": "id", "run name": "name", "run": "name",
                                                "state": "status", "tag": "tags"}
SCALE_KEYS = {"params": int, "tokens": int, "gpus": int, "flops": float, "gpu_hours": float}
# W&B's run states and common spreadsheet words for the contract's statuses
STATUS_WORDS = {"finished": "completed", "done": "completed", "success": "completed",
                "succeeded": "completed", "crashed": "failed", "error": "failed",
                "preempted": "killed", "cancelled": "killed", "canceled": "killed"}
SIZE_UNITS = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}

# ASCII digits only: `\d` alone would read "1٢" (an Arabic-Indic two) as 12
INT = re.compile(r"[+-]?(0|[1-9]\d*)", re.A)          # "007" is a code, kept as text
FLOAT = re.compile(r"[+-]?((0|[1-9]\d*)(\.\d*)?|\.\d+)([eE][+-]?\d+)?", re.A)
DECIMAL_COMMA = re.compile(r"[+-]?\d+,\d+([eE][+-]?\d+)?", re.A)
NONFINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}
SIZED = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([kKmMbBtT])", re.A)
MISSING = object()

Target = tuple[str, tuple[str, ...]]       # ("scale" | "summary" | "config" | "field" | "drop", path)


@register("table")
class TableIngester:
    options = frozenset({"mapping"})

    def detect(self, target: str) -> int:
        path = Path(target)
        if not path.is_file() or path.suffix.lower() not in SUFFIXES:
            return 0
        # below a W&B CSV export (80), which is a table too but of JSON cells
        return 50 if _has_rows(path) else 0

    def read(self, target: str, mapping: dict[str, str] | None = None) -> Iterator[Item]:
        path = Path(target).expanduser().resolve()
        try:
            overrides = {col: parse_target(key) for col, key in (mapping or {}).items()}
        except InvalidRecord as exc:
            yield rejected(path, exc.error, field=exc.field)
            return
        if path.suffix.lower() in (".parquet", ".pq"):
            yield from _read_parquet(path, overrides)
        else:
            yield from _read_text(path, overrides)


def parse_mapping(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`COLUMN=KEY` strings (the CLI's --map) as {column: key}; InvalidRecord on a bad one."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        column, eq, key = pair.rpartition("=")      # a key never holds "=", a column might
        if not eq or not column.strip() or not key.strip():
            raise InvalidRecord(f"{pair!r} is not COLUMN=KEY", field="--map")
        column, key = column.strip(), key.strip()
        if column in mapping:
            raise InvalidRecord(f"column {column!r} mapped twice", field="--map")
        parse_target(key)
        mapping[column] = key
    return mapping


def parse_target(key: str) -> Target:
    """Where a --map key puts a column; InvalidRecord naming the key when it is nowhere."""
    if key == "-":
        return "drop", ()
    if key in FIELDS:
        return "field", (key,)
    space, _, rest = key.partition(".")
    if space == "scale" and rest in SCALE_KEYS:
        return "scale", (rest,)
    if space == "summary" and rest:
        return "summary", (rest,)        # metric names are flat keys: `val/loss`, `eval.acc`
    if space == "config" and rest and all(rest.split(".")):
        return "config", tuple(rest.split("."))
    raise InvalidRecord(f"cannot map to {key!r}: use scale.{{{','.join(SCALE_KEYS)}}}, summary.KEY, "
                        f"config.KEY[.KEY...], one of {', '.join(FIELDS)}, or - to drop", field="--map")


# -- columns ----------------------------------------------------------------------------------

def _plan(columns: list[str], overrides: dict[str, Target]) -> dict[str, Target]:
    """{column: target} for every named column; InvalidRecord when the columns cannot all go in."""
    seen: set[str] = set()
    for c in columns:
        if c and c in seen:
            raise InvalidRecord("column appears twice in the header", field=c)
        seen.add(c)
    missing = [c for c in overrides if c not in seen]
    if missing:
        raise InvalidRecord(f"--map names a column this table lacks; its columns: "
                            f"{', '.join(c for c in columns if c)}", field=missing[0])
    # an unnamed column is pandas' row index (`df.to_csv()`): nothing to keep
    plan = {c: overrides.get(c) or _auto(c) for c in columns if c}
    owner: dict[Target, str] = {}
    for column, target in plan.items():
        if target[0] == "drop":
            continue
        if target in owner:
            raise InvalidRecord(f"columns {owner[target]!r} and {column!r} both go to "
                                f"{_dotted(target)}; --map one of them elsewhere", field=column)
        owner[target] = column
    paths = sorted(t[1] for t in owner if t[0] == "config")
    for a, b in zip(paths, paths[1:]):
        if b[:len(a)] == a:
            raise InvalidRecord(f"config.{'.'.join(a)} cannot be a value and hold "
                                f"config.{'.'.join(b)}", field=owner[("config", b)])
    return plan


def _auto(column: str) -> Target:
    if (f := FIELD_COLUMNS.get(fold(column))) is not None:
        return "field", (f,)
    if column.startswith(("scale.", "summary.", "config.")):
        try:
            return parse_target(column)
        except InvalidRecord:
            pass
    found = column_target(column)
    if found and found.startswith("scale."):
        return "scale", (found.split(".", 1)[1],)
    if found and found.startswith("summary."):
        return "summary", (column,)
    return "config", (column,)     # nothing is dropped: an unknown column is a setting


def _dotted(target: Target) -> str:
    space, path = target
    return path[0] if space == "field" else f"{space}.{'.'.join(path)}"


# -- rows -------------------------------------------------------------------------------------

def _unusable(plan: dict[str, Target]) -> dict[str, str]:
    """{column: why} for the columns whose name cannot be a stored key (past the name limit, a
    NUL): a row that fills one is refused naming it, and the rows that leave it empty go in."""
    out = {}
    for column, (space, path) in plan.items():
        keys = path if space in ("config", "summary") else (column,) if space == "scale" else ()
        for key in keys:
            if problem := text_problem(key, MAX_NAME):
                out[column] = f"the column name {problem}"
                break
    return out


def _record(plan: dict[str, Target], cells: dict[str, Any], typed: Callable[[Any], Any],
            default_name: str, unusable: dict[str, str]) -> dict:
    """The native record of one row. `cells` are raw (CSV text, Parquet values); `typed` turns a
    raw cell into a number, bool or text, or MISSING. `unusable`: see _unusable."""
    config: dict = {}
    scale: dict = {}
    summary: dict = {}
    fields: dict = {}
    inputs: dict = {}       # scale cells, kept in config too: a run needs a config, ablations compare them
    for column, (space, path) in plan.items():
        raw = cells.get(column, MISSING)
        if raw is MISSING or raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        if space == "field":
            fields[path[0]] = _field(path[0], raw)
            continue
        if space == "drop":
            continue
        if column in unusable:
            raise InvalidRecord(unusable[column], field=column)
        value = typed(raw)
        if value is MISSING:
            continue
        if space == "scale":
            scale[path[0]] = _scale(path[0], value, column)
            if not column.startswith("scale."):    # kb's own export has its config columns
                inputs[column] = json_safe(value)
        elif space == "summary":
            summary[path[0]] = json_safe(value)
        else:
            node = config
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = json_safe(value)
    for column, value in inputs.items():
        config.setdefault(column, value)
    native = {"config": config, "scale": scale, "summary": summary, **fields}
    native.setdefault("name", fields.get("id") or default_name)
    return native


def _field(name: str, raw: Any) -> Any:
    if name == "tags":
        items = raw if isinstance(raw, (list, tuple)) else re.split(r"[,;]", str(raw))
        return [str(t).strip() for t in items if t is not None and str(t).strip()]
    if name in ("started_at", "ended_at") and not isinstance(raw, str):
        return raw                      # a Parquet timestamp
    text = str(raw).strip()
    if name == "status":
        return STATUS_WORDS.get(text.lower(), text.lower())
    return text


def _scale(key: str, value: Any, column: str) -> int | float:
    if isinstance(value, str) and (m := SIZED.fullmatch(value.strip())):
        value = float(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRecord(f"scale.{key} needs a number, got {value!r}", field=column)
    if not math.isfinite(value):
        raise InvalidRecord(f"scale.{key} needs a finite number, got {value!r}", field=column)
    # a table read off a plot holds 6795600349.289497 parameters; a count is an integer
    return round(value) if SCALE_KEYS[key] is int else float(value)


def _validated(path: Path, plan: dict[str, Target], native: dict, uri: str,
               line: int | None, where: str = "") -> Item:
    try:
        record = parse_run(native)
    except InvalidRecord as exc:
        return rejected(path, exc.error, line=line, field=where + _column_of(plan, exc.field))
    return Parsed(record, "table", uri, line)


def _column_of(plan: dict[str, Target], field: str) -> str:
    """The column behind a record field named in a validation error (the file's own name for it).
    Keys may hold dots (columns `a` and `a.b`): the longest target that names the field wins."""
    best, length = field, -1
    for column, target in plan.items():
        dotted = _dotted(target)
        if (field == dotted or field.startswith(dotted + ".")) and len(dotted) > length:
            best, length = column, len(dotted)
    return best


# -- CSV and TSV ------------------------------------------------------------------------------

def _read_text(path: Path, overrides: dict[str, Target]) -> Iterator[Item]:
    try:
        lines, undecodable = text_lines(path.read_bytes())
    except OSError as exc:
        yield rejected(path, f"cannot read: {exc.strerror or exc}")
        return
    first = header_index(lines)
    delimiter = "\t" if path.suffix.lower() == ".tsv" else sniff(lines, first)
    found = rows(lines, first, delimiter)
    head, header, error = next(found, (first + 1, None, None))
    if error or not header:
        yield rejected(path, f"header row: {error}" if error else "empty table: no header row", line=head)
        return
    columns = [c.strip() for c in header]
    if undecodable and (bad := next((c for c in columns if not_utf8(c)), None)) is not None:
        yield rejected(path, "the header is not UTF-8", line=head, field=printable(bad))
        return
    try:
        plan = _plan(columns, overrides)
    except InvalidRecord as exc:
        yield rejected(path, exc.error, line=head, field=exc.field)
        return
    unusable = _unusable(plan)
    # in a `;`-separated file a comma is the decimal mark (European spreadsheets)
    typed = _typed_decimal_comma if delimiter == ";" else _typed
    n = 0
    for line, cells, error in found:
        if error:
            n += 1
            yield rejected(path, error, line=line)
            continue
        if not any(c.strip() for c in cells):          # blank lines, a spreadsheet's `,,,` tail
            continue
        n += 1
        if len(cells) > len(columns) and any(c.strip() for c in cells[len(columns):]):
            yield rejected(path, f"{len(cells)} cells, but the header names {len(columns)} columns",
                           line=line)
            continue
        row = dict(zip(columns, cells))
        if undecodable and (bad := next((c for c, (space, _) in plan.items()
                                         if space != "drop" and not_utf8(row.get(c, ""))), None)) is not None:
            yield rejected(path, "the cell is not UTF-8", line=line, field=bad)
            continue
        try:
            native = _record(plan, row, typed, f"{_text(path.stem)} row {n}", unusable)
        except InvalidRecord as exc:
            yield rejected(path, exc.error, line=line, field=exc.field)
            continue
        yield _validated(path, plan, native, f"{_text(str(path))}#row-{n}", line)
    if not n:
        yield rejected(path, "no data rows under the header", line=head)


def _text(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (kept by the OS as surrogate escapes, which
    no store holds) written as `\\xff`, so a row's run name and source stay unique and stable."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _typed(cell: str) -> Any:
    s = cell.strip()
    if not s:
        return MISSING
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if INT.fullmatch(s):
        try:
            return int(s)
        except ValueError:            # past Python's 4,300-digit conversion limit: json_safe's text of it
            return s.lstrip("+")
    if FLOAT.fullmatch(s) or low in NONFINITE:
        return float(low)
    return s


def _typed_decimal_comma(cell: str) -> Any:
    s = cell.strip()
    if DECIMAL_COMMA.fullmatch(s):
        return float(s.replace(",", "."))
    return _typed(s)


def _has_rows(path: Path) -> bool:
    """A header and at least one data row (Parquet: at least one row)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            with open(path, "rb") as fh:
                if fh.read(4) != b"PAR1":
                    return False
            import pyarrow.parquet as pq
            return pq.read_metadata(path).num_rows > 0
        except Exception:          # pyarrow raises several kinds for a file that is not Parquet
            return False
    try:
        with open(path, encoding="utf-8-sig", errors="replace", newline="") as fh:
            text = fh.read(65536)
    except OSError:
        return False
    lines = text.splitlines()
    return sum(1 for ln in lines[header_index(lines):] if ln.strip()) >= 2


# -- Parquet ----------------------------------------------------------------------------------

def _read_parquet(path: Path, overrides: dict[str, Target]) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        columns = list(table.schema_arrow.names)
    except (OSError, pa.ArrowException) as exc:
        yield rejected(path, f"not a readable Parquet file: {_one_line(exc)}")
        return
    try:
        plan = _plan([c.strip() for c in columns], overrides)
    except InvalidRecord as exc:
        yield rejected(path, exc.error, field=exc.field)
        return
    unusable = _unusable(plan)
    n = 0
    batches = table.iter_batches(batch_size=4096)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as exc:        # a damaged page: what came before it is in
            yield rejected(path, f"the rows from here on cannot be read: {_one_line(exc)}", field=f"row-{n + 1}")
            break
        if batch is None:
            break
        for cells, unreadable in _batch_rows(batch, plan):
            n += 1
            where = f"row-{n}."        # Parquet has no lines: the row, as in the source URI
            if unreadable:
                column, error = unreadable
                yield rejected(path, f"the value has no Python equivalent: {error}", field=where + column)
                continue
            try:
                native = _record(plan, cells, _parquet_value, f"{_text(path.stem)} row {n}", unusable)
            except InvalidRecord as exc:
                yield rejected(path, exc.error, field=where + exc.field)
                continue
            yield _validated(path, plan, native, f"{_text(str(path))}#row-{n}", None, where)
    if not n:
        yield rejected(path, "no rows")


def _batch_rows(batch, plan: dict[str, Target]) -> Iterator[tuple[dict[str, Any], tuple[str, str] | None]]:
    """({column: value}, None) per row of a record batch, or (cells, (column, why)) for a row
    holding a value Python cannot represent (a timestamp past the year 9999) in a column it keeps."""
    import pyarrow as pa

    columns: dict[str, list] = {}
    broken: dict[int, tuple[str, str]] = {}
    for name, array in zip(batch.schema.names, batch.columns):
        name = name.strip()
        try:
            columns[name] = array.to_pylist()
        except (ArithmeticError, ValueError, pa.ArrowException):
            kept = plan.get(name, ("drop",))[0] != "drop"
            values = []
            for i in range(len(array)):           # only a column that failed whole goes value by value
                try:
                    values.append(array[i].as_py())
                except (ArithmeticError, ValueError, pa.ArrowException) as exc:
                    values.append(None)
                    if kept:
                        broken.setdefault(i, (name, _one_line(exc)))
            columns[name] = values
    for i in range(batch.num_rows):
        yield {c: values[i] for c, values in columns.items()}, broken.get(i)


def _one_line(exc: Exception) -> str:
    """An exception's message as one line of at most 300 characters (Arrow's span several)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _parquet_value(value: Any) -> Any:
    # Parquet columns carry their own types: a string column's "3e-4" was meant as text
    return MISSING if value is None else value
