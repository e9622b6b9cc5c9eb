"""What an ingester is: a name, a detector and a reader that yields validated records.

Ingesters never touch the store. They turn a source (a file, a folder, a tracking
URI) into native records; `kb.api.KnowledgeBase.ingest` writes them, one
transaction per run, so every source shares one tested write path. What a reader yields
(`Parsed`, `Rejected`) is defined in kb.records, beside the records themselves.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Protocol

from kb.errors import InvalidRecord
from kb.records import MAX_DEPTH, Item, Rejected


class Ingester(Protocol):
    name: str
    options: frozenset[str]      # keyword options `read` takes (a table's `mapping`); most take none

    def detect(self, target: str) -> int:
        """How sure this ingester is that it reads `target` (a path or a URI): 0 (no) to 100."""

    def read(self, target: str, **options) -> Iterator[Item]:
        """Every record in `target`; a bad record is a Rejected, never an exception. Only the
        options named in `options` are passed (see `options_for`).

        Heavy client libraries (mlflow, tensorboard, ...) are imported here, not at module
        import, so `kb --help` and `kb runs` stay fast.

    An ingester that can cut a big target into parts read apart (ingest.pipeline reads them in
    worker processes) also has `parts(target) -> list | None` (None: read it whole) and
    `read_part(target, part)`, which together yield what `read` yields, in the same order; one
    whose targets are URLs has `local_path(target) -> Path | None`, where its data lies here."""


INGESTERS: dict[str, Ingester] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        cls.options = frozenset(getattr(cls, "options", ()))
        INGESTERS[name] = cls()
        return cls
    return deco


def options_for(ingester: Ingester, options: dict[str, Any]) -> dict[str, Any]:
    """The options this ingester reads; the others are meant for another ingester in the same walk."""
    return {k: v for k, v in options.items() if k in ingester.options}


def check_options(readers: list[Ingester], options: dict[str, Any]) -> None:
    """InvalidRecord for an option none of the ingesters about to read takes (`--map` with no table)."""
    taken = set().union(*(r.options for r in readers))
    for name in sorted(set(options) - taken):
        formats = sorted(n for n, i in INGESTERS.items() if name in i.options)
        raise InvalidRecord(f"only {', '.join(formats) or 'no'} sources take it, and no target is read as one",
                            field=name)


def rejected(source: Path | str, error: str, *, line: int | None = None, field: str = "") -> Rejected:
    return Rejected(InvalidRecord(error, source=str(source), line=line, field=field))


def read_text_file(path: Path, encoding: str = "utf-8") -> tuple[str | None, Rejected | None]:
    """(text, None), or (None, a Rejected naming the byte and line that is not UTF-8). A UTF-8
    byte-order mark (some Windows editors and Excel write one) is not part of the text."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, rejected(path, f"cannot read: {exc.strerror or exc}")
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as exc:
        return None, rejected(path, f"not UTF-8 (byte {exc.start})", line=raw[:exc.start].count(b"\n") + 1)
    return (text.removeprefix("\ufeff") if encoding.replace("-", "").lower() == "utf8" else text), None


TOO_DEEP = f"JSON nested deeper than {MAX_DEPTH} levels"


def read_json_file(path: Path) -> tuple[Any, Rejected | None]:
    """(data, None), or (None, a Rejected naming the byte, line or column that is wrong)."""
    text, error = read_text_file(path)
    if error:
        return None, error
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, rejected(path, f"invalid JSON: {exc.msg} (column {exc.colno})", line=exc.lineno)
    except RecursionError:         # json's own limit, far past a record's
        return None, rejected(path, TOO_DEEP)
