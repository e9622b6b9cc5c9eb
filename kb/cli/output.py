"""Printing: JSON on stdout for scripts, plain aligned tables for people."""
from __future__ import annotations

import json
import math
import re
import sys

import click

from kb.fields import spelled


def _clean(value):
    """JSON has no NaN: a non-finite number prints as the contract spells it ("NaN", "Infinity",
    "-Infinity"), never as null, which means no value."""
    if isinstance(value, float) and not math.isfinite(value):
        return spelled(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def printable(text: str) -> str:
    """Text that always prints: a lone surrogate (a file name that is not UTF-8, bad input quoted
    back) shown as its code instead of failing the write."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str) -> str:
    """printable text on one line: a control character (a line break in a column's name, a NUL)
    shown as its escape, so bad input quoted back cannot split or garble an error line."""
    return printable(_CONTROL.sub(lambda m: repr(m.group())[1:-1], text))


def emit_json(data) -> None:
    click.echo(json.dumps(_clean(data), indent=2, default=str, allow_nan=False))


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    out = sys.stdout
    out.write("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip() + "\n")
    for r in rows:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
