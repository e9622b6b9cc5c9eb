"""Native run records: a `.json` file holding one record (or a list), or `.jsonl` holding one per line."""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from pydantic_core import from_json

from ingest.base import TOO_DEEP, read_json_file, register, rejected
from kb.errors import InvalidRecord
from kb.records import Item, Parsed, Rejected, RunRecord, parse_run


@register("native")
class NativeIngester:
    def detect(self, target: str) -> int:
        path = Path(target)
        if path.is_file() and path.suffix in (".jsonl", ".ndjson"):
            return 90
        if path.is_file() and path.suffix == ".json":
            return _json_score(path)
        return 0

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target)
        if path.suffix == ".json":
            yield from self._read_json(path)
            return
        yield from read_lines(path)

    def parts(self, target: str) -> list[tuple[int, int, int]] | None:
        """A big JSONL file's slices (first byte, end byte, line number of the first), cut at line ends."""
        path = Path(target)
        if path.suffix not in (".jsonl", ".ndjson") or not path.is_file() or path.stat().st_size <= SLICE_BYTES:
            return None
        return list(_slices(path))

    def read_part(self, target: str, part: tuple[int, int, int]) -> Iterator[Item]:
        return read_lines(Path(target), *part)

    def _read_json(self, path: Path) -> Iterator[Item]:
        data, error = read_json_file(path)
        if error:
            yield error
            return
        uri = str(path.resolve())
        if isinstance(data, list):
            # a list of records: each is reported by its index, as lines are meaningless here
            for i, item in enumerate(data):
                yield _validated(path, uri, None, item, prefix=f"[{i}]")
        else:
            yield _validated(path, uri, 1, data)


def read_lines(path: Path, start: int = 0, end: int | None = None, first_line: int = 1) -> Iterator[Item]:
    """The records of a JSONL file's lines, or of the bytes [start, end) of it, which begin at
    line `first_line` (ingest.pipeline reads a big file in such slices)."""
    with path.open("rb") as fh:
        fh.seek(start)
        raw = fh.read() if end is None else fh.read(end - start)
    if start == 0:
        raw = raw.removeprefix(codecs.BOM_UTF8)      # an editor's byte-order mark is no record
    uri = str(path.resolve())       # once per file: per record it was a twentieth of the reading
    for lineno, line in enumerate(raw.split(b"\n"), start=first_line):
        if not line.strip():
            continue
        yield _parse(path, uri, lineno, line)


def _slices(path: Path) -> Iterator[tuple[int, int, int]]:
    with path.open("rb") as fh:
        start, line = 0, 1
        while block := fh.read(SLICE_BYTES):
            if not block.endswith(b"\n"):
                block += fh.readline()          # a slice ends where its last line does
            yield start, start + len(block), line
            line += block.count(b"\n")
            start += len(block)


def _parse(path: Path, uri: str, lineno: int, line: bytes) -> Item:
    try:
        # pydantic's JSON parser, ~3x faster than json.loads on a run's curves and the same values;
        # any line it refuses goes the json.loads way below, which names what is wrong
        data = from_json(line)
    except ValueError as exc:
        if "recursion limit" in str(exc):      # ~200 levels: far past what a record may hold
            return rejected(path, TOO_DEEP, line=lineno)
    else:
        return _validated(path, uri, lineno, data)
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return rejected(path, f"not UTF-8 (byte {exc.start} of the line)", line=lineno)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return rejected(path, f"invalid JSON: {exc.msg} (column {exc.colno})", line=lineno)
    except RecursionError:
        return rejected(path, TOO_DEEP, line=lineno)
    return _validated(path, uri, lineno, data)


def _validated(path: Path, uri: str, lineno: int | None, data, prefix: str = "") -> Item:
    try:
        record = parse_run(data)
    except InvalidRecord as exc:
        field = f"{prefix}.{exc.field}" if prefix and exc.field else (prefix or exc.field)
        return rejected(path, exc.error, line=lineno, field=field)
    return Parsed(record, "native", uri, lineno)


SLICE_BYTES = 2**20         # a big JSONL file's parts: ~30 runs of 600 points (smaller evened the workers' ends)
RECORD_KEYS = frozenset(RunRecord.model_fields)
SNIFF_BYTES = 64 * 2**20        # past this, a .json is not parsed twice to be recognised


def _json_score(path: Path) -> int:
    """How sure it is that a .json file holds native records. 0 unless its head has a record's
    keys (HF's config.json has none; a trainer state has log_history). 85, past a W&B export's
    80, when every object in it (the one, or each in its list) has a record's keys only, config
    or metrics among them: a record that holds a key named "state" or "history" is still a
    record. Else 60."""
    try:
        if path.stat().st_size > SNIFF_BYTES:
            return 60 if _looks_native(path.open("rb").read(4096)) else 0
        raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError:
        return 0
    if not _looks_native(raw[:4096]):
        return 0
    try:
        data = from_json(raw)
    except ValueError:
        return 60
    items = data if isinstance(data, list) else [data]
    certain = items and all(isinstance(i, dict) and i.keys() <= RECORD_KEYS and ("config" in i or "metrics" in i)
                            for i in items)
    return 85 if certain else 60


def _looks_native(head: bytes) -> bool:
    return any(f'"{k}"'.encode() in head for k in ("metrics", "config", "summary")) and b'"log_history"' not in head


class RecordsReader:
    """Native records already in memory as dicts (KnowledgeBase.ingest_records), read as an
    ingester reads a file: record i is line i of `source`, and a list of them is cut into parts
    for the ingest workers (forked, they read the caller's list where it lies)."""

    options: frozenset[str] = frozenset()
    PART_RUNS = 32

    def __init__(self, records: Iterable, source_kind: str = "native"):
        self.records, self.source_kind = records, source_kind

    def read(self, source: str) -> Iterator[Item]:
        for i, data in enumerate(self.records, start=1):
            yield self._parsed(source, i, data)

    def parts(self, source: str) -> list[tuple[int, int]] | None:
        if not isinstance(self.records, Sequence):
            return None         # a generator is read once, in order, where it is
        n = len(self.records)
        return [(a, min(n, a + self.PART_RUNS)) for a in range(0, n, self.PART_RUNS)]

    def read_part(self, source: str, part: tuple[int, int]) -> Iterator[Item]:
        for i in range(*part):
            yield self._parsed(source, i + 1, self.records[i])

    def approx_bytes(self) -> int:
        """What the records would take as JSONL, roughly (~30 bytes a curve point, 1 KB the
        rest), for the workers' threshold; 0 for a generator, which they cannot cut."""
        if not isinstance(self.records, Sequence):
            return 0
        points = sum(len(curve) for r in self.records if isinstance(r, dict) and isinstance(r.get("metrics"), dict)
                     for curve in r["metrics"].values() if isinstance(curve, (list, tuple)))
        return 30 * points + 1024 * len(self.records)

    def _parsed(self, source: str, i: int, data) -> Item:
        try:
            return Parsed(parse_run(data), self.source_kind, source, i)
        except InvalidRecord as exc:
            return Rejected(exc.at(source, i))
