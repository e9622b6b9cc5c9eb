"""Native run records: a `.json` file holding one record (or a list), or `.jsonl` holding one per line."""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterator

from pydantic_core import from_json

from ingest.base import TOO_DEEP, read_json_file, register, rejected
from kb.errors import InvalidRecord
from kb.records import Item, Parsed, parse_run


@register("native")
class NativeIngester:
    def detect(self, target: str) -> int:
        path = Path(target)
        if path.is_file() and path.suffix in (".jsonl", ".ndjson"):
            return 90
        if path.is_file() and path.suffix == ".json":
            return 60 if _looks_native(path) else 0
        return 0

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target)
        if path.suffix == ".json":
            yield from self._read_json(path)
            return
        raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)      # an editor's byte-order mark is no record
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            yield _parse(path, lineno, line)

    def _read_json(self, path: Path) -> Iterator[Item]:
        data, error = read_json_file(path)
        if error:
            yield error
            return
        if isinstance(data, list):
            # a list of records: each is reported by its index, as lines are meaningless here
            for i, item in enumerate(data):
                yield _validated(path, None, item, prefix=f"[{i}]")
        else:
            yield _validated(path, 1, data)


def _parse(path: Path, lineno: int, line: bytes) -> Item:
    try:
        # pydantic's JSON parser, ~3x faster than json.loads on a run's curves and the same values;
        # any line it refuses goes the json.loads way below, which names what is wrong
        data = from_json(line)
    except ValueError as exc:
        if "recursion limit" in str(exc):      # ~200 levels: far past what a record may hold
            return rejected(path, TOO_DEEP, line=lineno)
    else:
        return _validated(path, lineno, data)
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
    return _validated(path, lineno, data)


def _validated(path: Path, lineno: int | None, data, prefix: str = "") -> Item:
    try:
        record = parse_run(data)
    except InvalidRecord as exc:
        field = f"{prefix}.{exc.field}" if prefix and exc.field else (prefix or exc.field)
        return rejected(path, exc.error, line=lineno, field=field)
    return Parsed(record, "native", str(path.resolve()), lineno)


def _looks_native(path: Path) -> bool:
    """A .json file is native if its top level has the record's keys (HF's config.json has not)."""
    try:
        head = path.read_text(errors="replace")[:4096]
    except OSError:
        return False
    return any(f'"{k}"' in head for k in ("metrics", "config", "summary")) and '"log_history"' not in head
