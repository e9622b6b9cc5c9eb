"""Dotted keys: the one spelling of a path into a run, shared by the writer and the query compiler.

A run's queryable leaves live under namespaces (`config`, `summary`, `scale`, `stats`,
`hparams` (canonical hyperparameters, kb.vocab), `anomalies`, `failure`, `tags`).
A segment is written bare when it is a plain word
(`config.optim.lr`, `summary.train/loss`) and double-quoted otherwise
(`summary."val loss"`), so every path has exactly one canonical key.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any, Iterable, Iterator


NAMESPACES = ("config", "summary", "scale", "stats", "hparams", "anomalies", "failure", "tags", "ablations")
BARE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_/\-]*\Z")


def quote(segment: str) -> str:
    if BARE.match(segment):
        return segment
    return '"' + segment.replace("\\", "\\\\").replace('"', '\\"') + '"'


def canonical(path: list[str] | tuple[str, ...]) -> str:
    return ".".join(quote(str(s)) for s in path)


def spelled(x: float) -> str:
    """A non-finite number as JSON-bound values write it (kb.records.json_safe, curve values in
    `kb show --json`): "NaN", "Infinity" or "-Infinity"."""
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def typed(value: Any) -> tuple[str, float | None, str | None]:
    """(vtype, num, text) as stored in RunField; NaN and inf are kept as text, not numbers,
    spelled as every source stores them (`spelled`)."""
    if value is None:
        return "z", None, None
    if isinstance(value, bool):
        return "b", float(value), None
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "s", None, spelled(value)
        return "n", float(value), None
    if isinstance(value, str):
        return "s", None, value
    raise TypeError(f"not a leaf: {type(value).__name__}")


def leaves(value: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf under value with its path; list items are addressed by index."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, prefix + (str(k),))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves(v, prefix + (str(i),))
    else:
        yield prefix, value


def lookup(root: Any, path: list[str] | tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) for a path; the reference the SQL compiler is tested against."""
    node = root
    for seg in path:
        if isinstance(node, dict) and seg in node:
            node = node[seg]
        elif isinstance(node, list) and seg.isascii() and seg.isdigit() and seg == str(int(seg)) and int(seg) < len(node):
            node = node[int(seg)]
        else:
            return False, None
    return True, node


FIELD_COLUMNS = ("run_id", "key", "vtype", "num", "text")


def field_rows(run_id: str, namespaces: dict[str, Any]) -> list[dict]:
    """RunField rows for every leaf under each namespace (`{"config": {...}, "summary": {...}}`)."""
    return [dict(zip(FIELD_COLUMNS, row)) for row in field_tuples(run_id, namespaces)]


def field_tuples(run_id: str, namespaces: dict[str, Any]) -> list[tuple]:
    """field_rows as tuples in FIELD_COLUMNS order, for the writer's bulk insert.

    The same walk as `leaves`, appending as it goes (a generator chain re-yields each leaf
    through every level above it), with each path's key spelled once per process."""
    rows: list[tuple] = []

    def walk(items: Iterable[tuple[Any, Any]], path: tuple[str, ...]) -> None:
        # a leaf is appended here, not in a call of its own: most of the calls were leaves
        for k, v in items:
            if isinstance(v, dict):
                walk(v.items(), path + (str(k),))
            elif isinstance(v, (list, tuple)):
                walk(enumerate(v), path + (str(k),))
            else:
                rows.append((run_id, _key(path + (str(k),)), *typed(v)))

    for ns, value in namespaces.items():        # a namespace that is a bare value has no leaves
        if isinstance(value, dict):
            walk(value.items(), (ns,))
        elif isinstance(value, (list, tuple)):
            walk(enumerate(value), (ns,))
    return rows


_key = lru_cache(maxsize=1 << 16)(canonical)      # runs of one project share most of their paths
