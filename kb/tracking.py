"""Run tracking: a run recorded by the process that trains it, stored when it ends.

    with k.track(project="gpt-small", config=cfg) as run:       # a TrackedRun
        for step in range(n):
            run.log({"train/loss": loss}, step=step)
        run.summary["val/loss"] = 3.2

Every hook (this context manager, the framework callbacks in ingest/callbacks.py and
ingest/lightning_callback.py, `kb track` through ingest.hooks.command_record) writes one
record shape through one path, `store`: `KnowledgeBase.ingest_records`, source kind
`track`, an explicit id so a re-store replaces rather than duplicates.

How a run ends: `completed`; `diverged` when a logged loss went NaN/Inf (wins over the
rest: it is the cause); `failed` with failure kind `exception` ("Type: message", the
traceback as evidence) when the block raised; `killed` for KeyboardInterrupt. A run
with neither config nor metrics records its command line as config, so a script that
died on import is still remembered. Every run stores its host, working directory, argv
and git commit (with a dirty flag).

Core module: it takes an open KnowledgeBase as an argument and imports neither the API
nor any ingester, so it can be used from both sides without an import loop.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kb.errors import InvalidRecord, KBError
from kb.failures import from_exception
from kb.records import json_safe

log = logging.getLogger(__name__)

SOURCE_KIND = "track"
EXTRA_FIELDS = {"id", "scale", "summary", "tags", "notes", "parent", "hypothesis", "code", "meta"}
MAX_CONFIG_ITEMS = 64          # an id2label of a 1000-class head is noise in a run's config


# ---- provenance and ids -------------------------------------------------------------------

def provenance(cwd: str | Path | None = None) -> dict:
    """Where a run ran: host, working directory, git commit and whether the tree was dirty."""
    cwd = str(Path(cwd or os.getcwd()).resolve())
    out: dict[str, Any] = {"host": socket.gethostname(), "cwd": cwd}
    commit = _git(cwd, "rev-parse", "HEAD")
    if commit:
        out["git_commit"] = commit
        out["git_dirty"] = bool(_git(cwd, "status", "--porcelain", "--untracked-files=no"))
    return out


def _git(cwd: str, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""                # no git here, or a hung network filesystem: provenance is best effort
    return done.stdout.strip() if done.returncode == 0 else ""


def new_run_id(name: str, started: datetime) -> str:
    """`<name>-<yyyymmdd-hhmmss>-<8 hex>`: readable, sortable by start, unique per run."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:40] or "run"
    salt = hashlib.sha1(f"{name}|{started.isoformat()}|{uuid.uuid4().hex}".encode()).hexdigest()[:8]
    return f"{slug}-{started:%Y%m%d-%H%M%S}-{salt}"


def source_uri(host: str, pid: int, started: datetime) -> str:
    return f"track://{host}/{pid}/{started.strftime('%Y%m%dT%H%M%S.%fZ')}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# ---- storing --------------------------------------------------------------------------------

def store(kb, record: dict, *, source: str, index: bool = True) -> str:
    """Write one record (SQL first: the run is safe even if indexing cannot happen now); its id.

    When SQL refuses it, the record is saved as JSON under the temp folder and the error
    says how to store it later, so a finished training is never lost to a database hiccup."""
    from sqlalchemy.exc import SQLAlchemyError
    try:
        report = kb.ingest_records([record], source=source, source_kind=SOURCE_KIND, index=False)
    except (KBError, SQLAlchemyError) as exc:
        path = spill(record)
        raise KBError(f"could not store run {record.get('id')}: {exc}; saved as {path} "
                      f"(`kb ingest {path}` stores it)") from exc
    if report.failed:
        f = report.failed[0]
        path = spill(record)
        raise InvalidRecord(f"{f['error']} (the record is saved as {path})", source=source, field=f["field"])
    if index and (report.added or report.updated):
        kb.try_sync_index()         # held elsewhere: the run waits in SQL for the holder to index it
    return report.ids[0]


def spill(record: dict) -> Path:
    path = Path(tempfile.gettempdir()) / f"kb-run-{record.get('id') or uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(record, default=str))
    return path


# ---- record values ----------------------------------------------------------------------------

def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def param_count(model) -> int | None:
    """Parameters of a torch module (a framework callback's `scale.params`), None if it has none."""
    try:
        return sum(p.numel() for p in model.parameters()) or None
    except (AttributeError, TypeError):
        return None


# ---- the context manager --------------------------------------------------------------------

class TrackedRun:
    """One run logged live: `run.log(values, step=None)`, `run.summary[...] = v`, stored on exit.

    `kb` is an open KnowledgeBase. `fields` are native record keys (id, scale, summary, tags,
    notes, parent, hypothesis, code, meta); `index=False` leaves the vectors to the next
    process that opens the index. The run starts when it is created, and `run.id` is known
    from then on."""

    def __init__(self, kb, project: str = "default", config: dict | None = None, name: str | None = None,
                 *, index: bool = True, hook: str = "k.track", **fields):
        unknown = sorted(set(fields) - EXTRA_FIELDS)
        if unknown:
            raise InvalidRecord(f"unknown key; a tracked run takes {sorted(EXTRA_FIELDS)}", field=unknown[0])
        self.kb = kb
        self.project = project
        self.config = dict(config or {})
        self.name = name or Path(sys.argv[0] or "run").stem or "run"
        self.summary: dict = dict(fields.pop("summary", None) or {})
        self.scale: dict = dict(fields.pop("scale", None) or {})
        self.tags: list = list(fields.pop("tags", None) or [])
        self.meta: dict = {"hook": hook, "pid": os.getpid(), **(fields.pop("meta", None) or {})}
        self.code: dict = {"entrypoint": sys.argv[0] or None, "argv": list(sys.argv), **provenance(),
                           **(fields.pop("code", None) or {})}
        self.fields = fields
        self.index = index
        self.started_at = utcnow()
        self.id: str = fields.pop("id", None) or new_run_id(self.name, self.started_at)
        self.source = source_uri(self.code["host"], os.getpid(), self.started_at)
        self.stored = False
        self._series: dict[str, dict[int, list]] = {}
        self._next_step = 0
        self._nonfinite: tuple[int, str, float] | None = None

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Record metric points at `step` (default: one past the last step logged).

        Values are anything float() takes (numbers, numpy scalars, one-element tensors);
        logging the same key at the same step again replaces the point."""
        if step is None:
            step = self._next_step
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidRecord(f"step {step!r} is not a non-negative integer", field="step")
        wall = utcnow().timestamp()
        for key, value in values.items():
            try:
                x = float(value)
            except (TypeError, ValueError):
                raise InvalidRecord(f"{type(value).__name__} is not a number", field=f"metrics.{key}") from None
            self._series.setdefault(str(key), {})[step] = [step, x, wall]
            if self._nonfinite is None and not math.isfinite(x) and _is_loss(str(key)):
                self._nonfinite = (step, str(key), x)
        self._next_step = step + 1

    @property
    def metrics(self) -> dict[str, list[list]]:
        return {k: [pts[s] for s in sorted(pts)] for k, pts in self._series.items()}

    def last_step(self) -> int | None:
        return max((max(pts) for pts in self._series.values() if pts), default=None)

    def finish(self, exc: BaseException | None = None) -> str:
        """Store the run as it ended (exc: what stopped it, if anything); returns its id."""
        if self.stored:
            return self.id
        status, failure = outcome(exc, self._nonfinite, self.last_step())
        config = self.config or {"command": shlex.join(sys.argv)}
        record: dict[str, Any] = {
            "id": self.id, "project": self.project, "name": self.name, "status": status,
            "config": json_safe(config), "metrics": self.metrics, "summary": json_safe(self.summary),
            "tags": self.tags, "started_at": self.started_at.isoformat(), "ended_at": utcnow().isoformat(),
            "code": json_safe(self.code), "meta": json_safe(self.meta), **self.fields}
        if self.scale:
            record["scale"] = self.scale
        if failure:
            record["failure"] = failure
        run_id = store(self.kb, record, source=self.source, index=self.index)
        self.stored = True
        return run_id

    def __enter__(self) -> "TrackedRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.finish(exc)
        except Exception:
            if exc is None:
                raise
            # the training's own error is the one to see; the store error is logged beside it
            log.exception("could not store run %s", self.id)
        return False


def outcome(exc: BaseException | None, nonfinite: tuple[int, str, float] | None,
            last_step: int | None) -> tuple[str, dict | None]:
    """(status, failure) of a run that ended with `exc` (None: normally)."""
    diverged = None
    if nonfinite:
        step, key, value = nonfinite
        diverged = {"kind": "diverged", "step": step, "message": f"{key} is {value} at step {step}"}
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return ("diverged", diverged) if diverged else ("completed", None)
    failure = from_exception(exc, last_step).as_dict()
    if isinstance(exc, KeyboardInterrupt):
        return ("diverged" if diverged else "killed"), failure
    return ("diverged" if diverged else "failed"), failure


def _is_loss(key: str) -> bool:
    from kb.curves import is_loss     # numpy: paid on the first logged value, not on import
    return is_loss(key)
