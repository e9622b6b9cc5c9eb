"""The native run record (the contract's JSON shape), validated, with errors that name the field.

Every ingester produces these; so do the post-run hooks and the runner's write-back,
which is why one validation path guards the whole store.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictInt, ValidationError,
                      field_validator, model_validator)
from pydantic_core import to_json

from kb.errors import InvalidRecord
from kb.fields import canonical, spelled

Status = Literal["completed", "failed", "diverged", "running", "killed"]
FailureKind = Literal["diverged", "loss_spike", "oom", "nccl_timeout", "hardware", "killed",
                      "exception", "plateau", "timeout", "other"]
INT64 = 2**63 - 1

# ---- limits: the same on SQLite and Postgres (README, "Limits") ------------------------------
# Names and key paths sit in btree index rows, which Postgres caps at 2,704 bytes; a character
# takes up to 4 bytes in UTF-8, so a key path and a run id together stay under 2,400 bytes.
# String values are in a btree on Postgres only up to kb.models.TEXT_INDEXED bytes, so they may be long.
MAX_NAME = 200              # characters: id, project, parent, hypothesis, a tag, a metric name
MAX_KEY = 400               # characters: a stored key path as queries spell it (`config.optim.lr`)
MAX_TEXT = 16 * 2**20       # characters: any one string
MAX_DEPTH = 64              # objects and lists nested in config, summary, meta or code


def text_problem(s: str, limit: int = MAX_TEXT) -> str | None:
    """Why a string cannot be stored, or None. Postgres text cannot hold NUL, and a lone
    surrogate (JSON's "\\ud800") is no Unicode at all; both are refused on SQLite too, so
    the two stores accept the same records."""
    if len(s) > limit:
        return f"is {len(s):,} characters long; the limit is {limit:,}"
    if "\x00" in s:
        return "contains a NUL character (\\u0000), which text cannot hold"
    if not s.isascii():
        try:
            s.encode()
        except UnicodeEncodeError as exc:
            return (f"contains a lone surrogate (\\u{ord(s[exc.start]):04x} at character {exc.start}), "
                    "which is not Unicode text")
    return None


def _checked(v: str | None, limit: int = MAX_TEXT) -> str | None:
    if v is not None and (problem := text_problem(v, limit)):
        raise ValueError(problem)
    return v


class StrictRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class FailureIn(StrictRecord):
    kind: FailureKind
    step: int | None = None
    message: str = ""
    evidence: str | list[str] = ""

    @field_validator("step")
    @classmethod
    def _step_in_range(cls, v):
        return _check_int(v)

    @field_validator("message")
    @classmethod
    def _text(cls, v):
        return _checked(v)

    @field_validator("evidence")
    @classmethod
    def _evidence(cls, v):
        for i, line in enumerate([v] if isinstance(v, str) else v):
            if problem := text_problem(line):
                raise ValueError(problem if isinstance(v, str) else f"failure.evidence.{i}: {problem}")
        return v


class Scale(StrictRecord):
    params: int | None = None
    tokens: int | None = None
    flops: float | None = None
    gpus: int | None = None
    gpu_hours: float | None = None

    @field_validator("params", "tokens", "gpus")
    @classmethod
    def _ints(cls, v):
        return _check_int(v)

    @field_validator("flops", "gpu_hours")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("number is not finite")
        return v


class Code(BaseModel):
    model_config = ConfigDict(extra="allow")
    git_commit: str | None = None
    entrypoint: str | None = None
    argv: list[str] | None = None
    host: str | None = None

    @model_validator(mode="after")
    def _json_values(self):
        _check_json(self.model_dump(exclude_none=True), ("code",))
        return self


# A curve point: [step, value] or [step, value, wall_time], with strict types: a step is an
# integer (not true, not "5"), a value a number, null or one of the strings JSON spells the
# non-finite values with, a wall time a finite number or null. Tried in this order, the usual
# three-item point validates on the first try; pydantic's default ("smart") union tried both
# shapes on every point, 2.5x slower. A point matches one shape at most, so the result is the same.
NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_Spelled = Annotated[Literal["NaN", "Infinity", "-Infinity"], AfterValidator(NONFINITE_TEXT.__getitem__)]
Value = Annotated[Union[Annotated[float, Strict()], None, _Spelled], Field(union_mode="left_to_right")]
Wall = Union[Annotated[float, Strict(), Field(allow_inf_nan=False)], None]
Point = Annotated[Union[tuple[StrictInt, Value, Wall], tuple[StrictInt, Value]],
                  Field(union_mode="left_to_right")]


class RunRecord(StrictRecord):
    # NaN and null curve values serialize apart (content_hash's bytes): a NaN loss is a divergence
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    id: str | None = None
    project: str = "default"
    name: str | None = None
    status: Status = "completed"
    config: dict[str, Any] = {}
    scale: Scale = Scale()
    metrics: dict[str, list[Point]] = {}
    summary: dict[str, Any] = {}
    tags: list[str] = []
    notes: str = ""
    failure: FailureIn | None = None
    parent: str | None = None
    hypothesis: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    code: Code | None = None
    meta: dict[str, Any] = {}     # source-specific facts kept verbatim (an MLflow run uuid, checkpoints)

    @field_validator("id", "project", "name")
    @classmethod
    def _non_empty(cls, v):
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("id", "project", "parent", "hypothesis")
    @classmethod
    def _names(cls, v):
        return _checked(v, MAX_NAME)

    @field_validator("name", "notes")
    @classmethod
    def _text(cls, v):
        return _checked(v)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v):
        for i, tag in enumerate(v):
            if problem := text_problem(tag, MAX_NAME):
                raise ValueError(f"tags.{i}: {problem}")
        return v

    @field_validator("config", "summary", "meta")
    @classmethod
    def _json_values(cls, v, info):
        _check_json(v, (info.field_name,), keyed=info.field_name != "meta")
        return v

    @field_validator("metrics")
    @classmethod
    def _steps(cls, v):
        if not all(v.values()):            # a curve without points is no curve: nothing to store
            v = {key: points for key, points in v.items() if points}
        for key, points in v.items():
            if not key:
                raise ValueError("metric name must not be empty")
            if problem := text_problem(key, MAX_NAME):
                raise ValueError(f"metrics.{key[:40]}: the name {problem}")
            steps = [p[0] for p in points]          # min/max in C: a loop here cost more than validation
            if steps and (min(steps) < 0 or max(steps) > INT64):
                i = next(i for i, step in enumerate(steps) if step < 0 or step > INT64)
                raise ValueError(f"metrics.{key}.{i}.0: step {steps[i]} is out of range (0 to 2**63-1)")
        return v

    @field_validator("started_at", "ended_at", mode="before")
    @classmethod
    def _iso(cls, v):
        """A time is written as ISO-8601: pydantic would read a number as Unix seconds, or as
        milliseconds past a size it picks, and `true` as 1970-01-01T00:00:01."""
        if isinstance(v, (int, float)):
            raise ValueError(f"a time is an ISO-8601 string, got {_as_json(v)}")
        return v

    @field_validator("started_at", "ended_at")
    @classmethod
    def _utc(cls, v):
        """Times are stored in UTC; a time written without a zone is taken to be UTC already. A
        time whose UTC day falls outside the years 1 to 9999 has no datetime to be stored as."""
        if v is None:
            return v
        try:
            return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)
        except OverflowError:
            raise ValueError(f"{v.isoformat()} is outside the years 1 to 9999 once in UTC") from None

    @model_validator(mode="after")
    def _needs_content(self):
        if not self.config and not self.metrics:
            raise ValueError("a run needs `config` or `metrics`")
        return self


def json_safe(value: Any, _depth: int = 0) -> Any:
    """The one conversion every source's values go through, so a value is stored the same way
    whatever wrote it: NaN and infinities become the strings "NaN", "Infinity", "-Infinity"
    (as curve values print in JSON), ints beyond 64 bits become their decimal text, bytes
    their UTF-8 text, numpy scalars and arrays plain numbers and lists, enums their value,
    times ISO-8601, tuples and sets lists, anything else its str() (also what is nested deeper
    than MAX_DEPTH, which a record cannot hold)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -INT64 - 1 <= value <= INT64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else spelled(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)) and _depth >= MAX_DEPTH:
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [json_safe(v, _depth + 1) for v in items]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return json_safe(value.value, _depth + 1)
    if hasattr(value, "tolist") and callable(value.tolist):      # numpy scalars and arrays, tensors
        try:
            return json_safe(value.tolist(), _depth + 1)
        except (TypeError, ValueError):
            pass
    if isinstance(value, numbers.Integral):
        return json_safe(int(value), _depth + 1)
    if isinstance(value, numbers.Real):
        return json_safe(float(value), _depth + 1)
    return str(value)


def _check_int(v):
    if v is not None and not -INT64 - 1 <= v <= INT64:
        raise ValueError(f"number {v} does not fit in 64 bits")
    return v


def _check_json(value: Any, path: tuple, keyed: bool = False) -> None:
    """What config, summary, meta and code may hold: numbers finite and within 64 bits (SQL can
    hold them), strings that text can hold (`text_problem`), containers at most MAX_DEPTH deep
    (path[0] is the namespace, so a container's depth is len(path)), and where the leaves become
    queryable fields (`keyed`), names of at most MAX_NAME and key paths of at most MAX_KEY."""
    if isinstance(value, dict):
        if len(path) > MAX_DEPTH:
            raise ValueError(f"{_shown(path)}: nested deeper than {MAX_DEPTH} levels")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{_shown(path)}: keys must be strings")
            if problem := text_problem(k, MAX_NAME if keyed else MAX_TEXT):
                raise ValueError(f"{_shown(path)}: the key {k[:40]!r} {problem}")
            _check_json(v, path + (k,), keyed)
    elif isinstance(value, list):
        if len(path) > MAX_DEPTH:
            raise ValueError(f"{_shown(path)}: nested deeper than {MAX_DEPTH} levels")
        for i, v in enumerate(value):
            _check_json(v, path + (str(i),), keyed)
    else:
        if keyed and _key_too_long(path):
            raise ValueError(f"{_shown(path)}: the key path is longer than {MAX_KEY} characters")
        if isinstance(value, str):
            if problem := text_problem(value):
                raise ValueError(f"{_shown(path)}: {problem}")
        elif isinstance(value, bool) or value is None:
            return
        elif isinstance(value, int):
            if not -INT64 - 1 <= value <= INT64:
                raise ValueError(f"{_shown(path)}: number {value} does not fit in 64 bits")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{_shown(path)}: number is not finite")
        else:
            raise ValueError(f"{_shown(path)}: {type(value).__name__} is not a JSON value")


def _key_too_long(path: tuple) -> bool:
    """Whether a leaf's stored key (`canonical`) is over MAX_KEY. Quoting at most doubles
    a segment and adds two quotes, so most paths are cleared without spelling the key."""
    if 2 * sum(map(len, path)) + 3 * len(path) <= MAX_KEY:
        return False
    return len(canonical(path)) > MAX_KEY


def _shown(path: tuple) -> str:
    text = ".".join(path)
    return text if len(text) <= 200 else text[:197] + "..."


def parse_run(data: Any) -> RunRecord:
    """Validate one native record; raises InvalidRecord naming the first offending field."""
    if not isinstance(data, dict):
        raise InvalidRecord(f"a run record is a JSON object, got {type(data).__name__}")
    try:
        return RunRecord.model_validate(data)
    except UnicodeEncodeError:
        # pydantic refuses a lone surrogate in some places (a metric's name) before any validator
        # sees it, and without saying where: find it
        path, text = _first_surrogate(data)
        raise InvalidRecord(text_problem(text) or "not Unicode text", field=_shown(path)) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raw = err["loc"]
        if len(raw) > 2 and raw[0] == "metrics" and isinstance(raw[2], int):
            # a point's error, said in the record's terms (pydantic's names the last union branch tried)
            item, problem = _point_problem(data["metrics"][raw[1]][raw[2]])
            if problem:
                field = f"metrics.{raw[1]}.{raw[2]}" + ("" if item is None else f".{item}")
                raise InvalidRecord(problem, field=field) from None
        # drop pydantic's union-branch labels ("tuple[int, ...]") from the location
        loc = ".".join(str(p) for p in raw if not (isinstance(p, str) and "[" in p))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        # a nested validator names its own path ("config.optim.lr: ..."): prefer it
        head = msg.split(": ", 1)[0]
        if ": " in msg and (head == loc or head.startswith(loc.split(".")[0] + ".")):
            loc, msg = msg.split(": ", 1)
        raise InvalidRecord(msg, field=loc) from None


def _first_surrogate(value: Any, path: tuple = ()) -> tuple[tuple, str]:
    """(path, text) of the first key or string holding a lone surrogate, or ((), "")."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and not k.isascii() and text_problem(k):
            return path + (k.encode("utf-8", "backslashreplace").decode(),), k
        if isinstance(v, str) and not v.isascii() and text_problem(v):
            return path + (str(k),), v
        if isinstance(v, (dict, list)):
            found = _first_surrogate(v, path + (str(k),))
            if found[1]:
                return found
    return path, ""


def _point_problem(point: Any) -> tuple[int | None, str | None]:
    """(item index or None, what is wrong) for a curve point that failed validation."""
    shape = "a point is [step, value] or [step, value, wall_time]"
    if not isinstance(point, (list, tuple)):
        return None, f"{shape}, got {_as_json(point)}"
    if len(point) not in (2, 3):
        return None, f"{shape}; this one has {len(point)} items"
    step, value = point[0], point[1]
    if type(step) is not int:
        return 0, f"a step is an integer, got {_as_json(step)}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        return 1, "the value is beyond the range of a float"
    if not (value is None or isinstance(value, (int, float)) and not isinstance(value, bool)
            or isinstance(value, str) and value in NONFINITE_TEXT):
        return 1, (f"{_as_json(value)} is not a valid number (a value is a number, null, "
                   '"NaN", "Infinity" or "-Infinity")')
    if len(point) == 3:
        wall = point[2]
        if not (wall is None or isinstance(wall, (int, float)) and not isinstance(wall, bool)
                and math.isfinite(wall)):
            return 2, f"a wall time is a finite number or null, got {_as_json(wall)}"
    return None, None


def _as_json(value: Any) -> str:
    text = to_json(value, inf_nan_mode="constants", fallback=repr).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def content_hash(record: RunRecord, source_kind: str) -> str:
    """Same source, same record, same hash: pydantic's serializer keeps field and key order, which
    a source reproduces on every read, and it is ~10x faster than json.dumps on long curves.

    The bytes are exactly `record.model_dump_json(exclude_none=True)`'s, made 3x faster: the
    curves go through the untyped serializer (the typed one tries each shape of a point
    against every point), spliced in where the model puts them."""
    head = record.model_dump_json(exclude_none=True, include=_BEFORE_METRICS)
    tail = record.model_dump_json(exclude_none=True, include=_AFTER_METRICS)
    curves = b'"metrics":' + to_json(record.metrics, inf_nan_mode="constants")
    parts = [head[1:-1].encode(), curves, tail[1:-1].encode()]
    h = hashlib.sha256(source_kind.encode() + b"\0")
    h.update(b"{" + b",".join(p for p in parts if p) + b"}")
    return h.hexdigest()


_FIELDS = list(RunRecord.model_fields)
_BEFORE_METRICS = set(_FIELDS[:_FIELDS.index("metrics")])
_AFTER_METRICS = set(_FIELDS[_FIELDS.index("metrics") + 1:])


class NoteRecord(StrictRecord):
    """Free text: a postmortem, design doc or review note (one chunk of one, for long documents)."""
    id: str | None = None
    project: str = "default"
    title: str = ""
    text: str
    chunk: int = 0
    mentions: list[str] = []      # run ids or names the text refers to; resolved on write


def note_hash(note: NoteRecord, source_kind: str) -> str:
    blob = json.dumps([source_kind, note.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---- what a reader yields ---------------------------------------------------------------------
# Ingesters produce these and KnowledgeBase.ingest consumes them; they live here, in the core,
# so the store never imports a reader to know what it is handed.

def path_text(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (kept by the OS as surrogate escapes, which
    no store holds) written as `\\xff`, so a run's name and source stay unique and stable."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:          # a lone surrogate that was never a byte
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Parsed:
    record: RunRecord | NoteRecord
    source_kind: str
    source_uri: str
    line: int | None = None

    def __post_init__(self) -> None:
        # every reader names its source by a path, and a path need not be UTF-8
        self.source_uri = path_text(self.source_uri)


@dataclass
class Rejected:
    error: InvalidRecord          # carries source, line, field


Item = Parsed | Rejected
