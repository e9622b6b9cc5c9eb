"""Post-run hooks: a run recorded by the process that trains it, stored when it ends.

Four ways in, one record shape, one write path (`KnowledgeBase.ingest_records`, source
kind `track`, an explicit id so a re-store replaces rather than duplicates):

    with k.track(project="gpt-small", config=cfg) as run:       # TrackedRun
        for step in range(n):
            run.log({"train/loss": loss}, step=step)
        run.summary["val/loss"] = 3.2

    trainer = Trainer(..., callbacks=[cb := KBCallback(k, project="p")])
    with cb:                         # optional: Trainer has no exception hook; this stores a crash
        trainer.train()

    pl.Trainer(callbacks=[KBLightningCallback(k, project="p")]).fit(model)   # on_exception built in

    kb track -- python train.py      # a subprocess; see command_record and kb/cli/track.py

How a run ends: `completed`; `diverged` when a logged loss went NaN/Inf (wins over the
rest: it is the cause); `failed` with failure kind `exception` ("Type: message", the
traceback as evidence) when the block raised; `killed` for KeyboardInterrupt. A run
with neither config nor metrics records its command line as config, so a script that
died on import is still remembered.

`KBCallback` and `KBLightningCallback` live in ingest/callbacks.py and are built on first
access, so importing this module imports neither transformers nor lightning. Every run stores
its host, working directory, argv and git commit (with a dirty flag).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kb.errors import IndexBusy, InvalidRecord, KBError

log = logging.getLogger(__name__)

SOURCE_KIND = "track"
EVIDENCE_CHARS = 4000          # a traceback's tail; a recursion error's full repr is megabytes
LINE_CAP = 500
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


# ---- failures -------------------------------------------------------------------------------

def exception_failure(exc: BaseException, step: int | None) -> dict:
    """{kind, step, message "Type: msg", evidence: the traceback's tail}."""
    kind = "killed" if isinstance(exc, KeyboardInterrupt) else "exception"
    text = str(exc)
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    evidence = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"kind": kind, "step": step, "message": message[:LINE_CAP], "evidence": evidence[-EVIDENCE_CHARS:]}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
    run_id = report.ids[0]
    if index and (report.added or report.updated):
        try:
            kb.sync_index()
        except IndexBusy:
            log.info("vector index held by another process; run %s waits in SQL to be indexed", run_id)
    return run_id


def spill(record: dict) -> Path:
    path = Path(tempfile.gettempdir()) / f"kb-run-{record.get('id') or uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(record, default=str))
    return path


def open_kb(kb=None):
    """A KnowledgeBase from None (KB_* settings), a Settings, or an open KnowledgeBase."""
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    if kb is None:
        return KnowledgeBase.open()
    if isinstance(kb, Settings):
        return KnowledgeBase.open(kb)
    return kb


def plain(x: Any, depth: int = 0) -> Any:
    """A JSON value for config: non-finite floats dropped to None, objects as their text."""
    if depth > 8:
        return None
    if isinstance(x, Mapping):
        return {str(k): plain(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [plain(v, depth + 1) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "value") and isinstance(getattr(x, "value"), (str, int, float, bool)):
        return plain(x.value, depth + 1)      # an Enum member (HF's IntervalStrategy, ...)
    return str(x)


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---- the context manager --------------------------------------------------------------------

class TrackedRun:
    """One run logged live: `run.log(values, step=None)`, `run.summary[...] = v`, stored on exit.

    `fields` are native record keys (id, scale, summary, tags, notes, parent, hypothesis,
    code, meta); `index=False` leaves the vectors to the next process that opens the index.
    The run starts when it is created, and `run.id` is known from then on."""

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
            "config": plain(config), "metrics": self.metrics, "summary": plain(self.summary),
            "tags": self.tags, "started_at": self.started_at.isoformat(), "ended_at": utcnow().isoformat(),
            "code": plain(self.code), "meta": plain(self.meta), **self.fields}
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
    failure = exception_failure(exc, last_step)
    if isinstance(exc, KeyboardInterrupt):
        return ("diverged" if diverged else "killed"), failure
    return ("diverged" if diverged else "failed"), failure


def _is_loss(key: str) -> bool:
    from kb.curves import is_loss
    return is_loss(key)


# ---- a finished subprocess (kb track) --------------------------------------------------------

def command_name(argv: list[str]) -> str:
    """A run name from a command line: the script's stem (`python train.py` -> train)."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            return Path(arg).stem
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1].rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv else "run"


def command_record(argv: list[str], returncode: int, log_text: str, *, run_id: str, name: str,
                   project: str, config: dict, started: datetime, ended: datetime, cwd: str,
                   pid: int, interrupted: int | None = None, log_path: str | None = None,
                   tail_lines: int = 200) -> dict:
    """The native record of a command that ran to its end, from its exit status and its log.

    Status: a loss that went NaN/Inf in the log -> diverged; a signal kb track forwarded
    (Ctrl-C) -> killed; death by a signal (negative return code, or 128+N from a shell)
    -> killed, naming the signal; exit 0 -> completed; any other exit -> failed, with the
    failure classified from the log (exception, oom, nccl_timeout, ...) or `other`."""
    from ingest.logs import parse_log

    parsed = parse_log(log_text, name)
    lines = log_text.splitlines()
    found = parsed.get("failure")
    steps = [p[0] for pts in parsed["metrics"].values() for p in pts]
    last = max(steps) if steps else None
    tail = "\n".join(x[:LINE_CAP] for x in lines[-8:])
    signalled = -returncode if returncode < 0 else returncode - 128 if 128 < returncode <= 128 + 64 else None

    if found and found["kind"] == "diverged":
        status, failure = "diverged", found
    elif interrupted is not None:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"interrupted: kb track forwarded {signal_name(interrupted)}"}
    elif returncode < 0:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"killed by {signal_name(-returncode)}"}
    elif returncode == 0:
        status, failure = "completed", None
    elif found:
        status, failure = parsed["status"], found
    elif signalled:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"exit code {returncode} (128 + {signal_name(signalled)})"}
    else:
        status, failure = "failed", {"kind": "other", "step": last, "evidence": tail,
                                     "message": f"exited with code {returncode}"}

    code = {"argv": list(argv), "entrypoint": next((a for a in argv if a.endswith(".py")), argv[0]),
            **provenance(cwd)}
    meta = {**{k: v for k, v in parsed["meta"].items() if k != "log_tail"},
            "hook": "kb track", "exit_code": returncode, "pid": pid,
            "duration_s": round((ended - started).total_seconds(), 3),
            "log_tail": "\n".join(x[:LINE_CAP] for x in lines[-tail_lines:])}
    if returncode < 0:
        meta["signal"] = signal_name(-returncode)
    if log_path:
        meta["log_path"] = log_path
    record = {"id": run_id, "project": project, "name": name, "status": status,
              "config": merge(parsed["config"], config) or {"command": shlex.join(argv)},
              "metrics": parsed["metrics"], "started_at": started.isoformat(), "ended_at": ended.isoformat(),
              "code": code, "meta": meta}
    if failure:
        record["failure"] = failure
    return record


def __getattr__(name: str):
    """`ingest.hooks.KBCallback` and `KBLightningCallback` live in ingest.callbacks."""
    if name in ("KBCallback", "KBLightningCallback"):
        from ingest import callbacks
        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
