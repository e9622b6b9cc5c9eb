"""The verification pass: a cited record must exist, and every number in a sentence must have been
measured: it appears in a record that sentence cites, in the SQL result, or in the question.

Numbers compare tolerantly, as people write them: `3e-4` = `0.0003`, `125M` = `1.25e8`, and a
value written with fewer digits matches a longer one that rounds to it (`3.395` for 3.39476).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

# a number not glued to a word (so run ids like base-lr0.001 or layer names like h12 are not
# read as claims), with an optional magnitude suffix and percent sign
_NUMBER = re.compile(
    r"(?<![\w.\-/])([-+]?(?:\d+(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"(?:\s?([kKmMbBtT])(?![a-zA-Z]))?(%?)(?![\w])")
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


@dataclass(frozen=True)
class Written:
    value: float
    digits: int          # significant digits as written: how precisely it claims the value
    text: str
    nominal: bool = False   # written with a magnitude suffix (125M, 2.5B): a size class


def numbers_in(text: str) -> list[Written]:
    out = []
    for m in _NUMBER.finditer(text):
        body, suffix, pct = m.group(1), m.group(2), m.group(3)
        if not body or not any(c.isdigit() for c in body):
            continue
        try:
            value = float(body.replace(",", ""))
        except ValueError:
            continue
        mantissa = body.lstrip("+-").split("e")[0].split("E")[0].replace(",", "")
        digits = len(mantissa.replace(".", "").lstrip("0")) or 1
        if suffix:
            value *= _SUFFIX[suffix.lower()]
        if pct:
            value /= 100
        out.append(Written(value, digits, m.group(0), bool(suffix)))
    return out


def _round_sig(v: float, digits: int) -> float:
    if v == 0 or not math.isfinite(v):
        return v
    return round(v, digits - 1 - int(math.floor(math.log10(abs(v)))))


def matches(written: Written, value: float) -> bool:
    if not math.isfinite(value):
        return False
    if math.isclose(written.value, value, rel_tol=1e-9, abs_tol=1e-12):
        return True
    if written.value == 0:
        return False
    # rounded to the digits written (3.395 for 3.39476), or within half a unit of the last
    # digit (125M for 124.4M params is a size class people write, and it rounds so)
    if math.isclose(_round_sig(value, written.digits), written.value, rel_tol=1e-9):
        return True
    if written.nominal and math.isclose(written.value, value, rel_tol=0.02):
        return True     # model sizes go by nominal names: GPT-2 small's 124.4M is "125M"
    return abs(written.value - value) <= 0.5 * 10 ** (math.floor(math.log10(abs(written.value))) - written.digits + 1) * 1.0001


def values_of(obj) -> list[float]:
    """Every number inside a record (JSON-like) or text, for support checks."""
    out: list[float] = []
    if isinstance(obj, bool) or obj is None:
        return out
    if isinstance(obj, (int, float)):
        out.append(float(obj))
    elif isinstance(obj, str):
        out.extend(w.value for w in numbers_in(obj))
        for m in re.finditer(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", obj):      # also inside ids
            try:
                out.append(float(m.group(0)))
            except ValueError:
                pass
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(values_of(k))
            out.extend(values_of(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(values_of(v))
    else:
        out.extend(values_of(json.loads(json.dumps(obj, default=str))))
    return out


def unsupported(sentence: str, evidence: list[float]) -> list[str]:
    """The numbers written in `sentence` that no evidence value supports."""
    return [w.text for w in numbers_in(sentence) if not any(matches(w, v) for v in evidence)]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text.strip()) if s.strip()]


@dataclass
class Claim:
    """One sentence of an answer and the records (chunk keys, `kind:id`) it cites."""
    text: str
    cites: list[str] = field(default_factory=list)
