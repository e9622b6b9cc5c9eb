"""The native run record (the contract's JSON shape), validated, with errors that name the field.

Every ingester produces these; so do the post-run hooks and the runner's write-back,
which is why one validation path guards the whole store.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import to_json

from kb.errors import InvalidRecord

Status = Literal["completed", "failed", "diverged", "running", "killed"]
FailureKind = Literal["diverged", "loss_spike", "oom", "nccl_timeout", "hardware", "killed",
                      "exception", "plateau", "timeout", "other"]
INT64 = 2**63 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class FailureIn(Strict):
    kind: FailureKind
    step: int | None = None
    message: str = ""
    evidence: str | list[str] = ""

    @field_validator("step")
    @classmethod
    def _step_in_range(cls, v):
        return _check_int(v)


class Scale(Strict):
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


# (step, value) or (step, value, wall time). Tried in this order, the usual three-item point
# validates on the first try; pydantic's default ("smart") union tried both shapes on every
# point, 2.5x slower. A point matches one shape at most, so the result is the same.
Point = Annotated[Union[tuple[int, float | None, float | None], tuple[int, float | None]],
                  Field(union_mode="left_to_right")]


class RunRecord(Strict):
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

    @field_validator("config", "summary", "meta")
    @classmethod
    def _json_values(cls, v, info):
        _check_json(v, info.field_name)
        return v

    @field_validator("metrics")
    @classmethod
    def _steps(cls, v):
        for key, points in v.items():
            if not key:
                raise ValueError("metric name must not be empty")
            steps = [p[0] for p in points]          # min/max in C: a loop here cost more than validation
            if steps and (min(steps) < 0 or max(steps) > INT64):
                i = next(i for i, step in enumerate(steps) if step < 0 or step > INT64)
                raise ValueError(f"{key}[{i}]: step {steps[i]} out of range")
        return v

    @field_validator("started_at", "ended_at")
    @classmethod
    def _utc(cls, v):
        """Times are stored in UTC; a time written without a zone is taken to be UTC already."""
        if v is None:
            return v
        return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)

    @model_validator(mode="after")
    def _needs_content(self):
        if not self.config and not self.metrics:
            raise ValueError("a run needs `config` or `metrics`")
        return self


NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
MAX_DEPTH = 32


def json_safe(value: Any, _depth: int = 0) -> Any:
    """The one conversion every source's values go through, so a value is stored the same way
    whatever wrote it: NaN and infinities become the strings "NaN", "Infinity", "-Infinity"
    (as curve values print in JSON), ints beyond 64 bits become their decimal text, bytes
    their UTF-8 text, numpy scalars and arrays plain numbers and lists, enums their value,
    times ISO-8601, tuples and sets lists, anything else its str()."""
    if _depth > MAX_DEPTH:
        return str(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -INT64 - 1 <= value <= INT64 else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return NONFINITE.get(value, value)
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


def _check_json(value: Any, path: str) -> None:
    """Numbers in config/summary must be finite and fit in 64 bits: SQL and JSONB can hold them."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path}: keys must be strings")
            _check_json(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{path}.{i}")
    elif isinstance(value, bool) or value is None or isinstance(value, str):
        return
    elif isinstance(value, int):
        if not -INT64 - 1 <= value <= INT64:
            raise ValueError(f"{path}: number {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: number is not finite")
    else:
        raise ValueError(f"{path}: {type(value).__name__} is not a JSON value")


def parse_run(data: Any) -> RunRecord:
    """Validate one native record; raises InvalidRecord naming the first offending field."""
    if not isinstance(data, dict):
        raise InvalidRecord(f"a run record is a JSON object, got {type(data).__name__}")
    try:
        return RunRecord.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # drop pydantic's union-branch labels ("tuple[int, ...]") from the location
        loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        # a nested validator names its own path ("config.optim.lr: ..."): prefer it
        if ": " in msg and msg.split(": ", 1)[0].startswith(loc.split(".")[0] + "."):
            loc, msg = msg.split(": ", 1)
        raise InvalidRecord(msg, field=loc) from None


def content_hash(record: RunRecord, source_kind: str) -> str:
    """Same source, same record, same hash: pydantic's serializer keeps field and key order, which
    a source reproduces on every read, and it is ~10x faster than json.dumps on long curves.

    The bytes are exactly `record.model_dump_json(exclude_none=True)`'s, made 3x faster: the
    curves go through the untyped serializer (the typed one tries each shape of a point
    against every point), spliced in where the model puts them."""
    head = record.model_dump_json(exclude_none=True, include=_BEFORE_METRICS)
    tail = record.model_dump_json(exclude_none=True, include=_AFTER_METRICS)
    curves = b'"metrics":' + to_json(record.metrics, inf_nan_mode="null")
    parts = [head[1:-1].encode(), curves, tail[1:-1].encode()]
    h = hashlib.sha256(source_kind.encode() + b"\0")
    h.update(b"{" + b",".join(p for p in parts if p) + b"}")
    return h.hexdigest()


_FIELDS = list(RunRecord.model_fields)
_BEFORE_METRICS = set(_FIELDS[:_FIELDS.index("metrics")])
_AFTER_METRICS = set(_FIELDS[_FIELDS.index("metrics") + 1:])


class NoteRecord(Strict):
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

@dataclass
class Parsed:
    record: RunRecord | NoteRecord
    source_kind: str
    source_uri: str
    line: int | None = None


@dataclass
class Rejected:
    error: InvalidRecord          # carries source, line, field


Item = Parsed | Rejected
