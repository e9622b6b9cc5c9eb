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

`KBCallback` and `KBLightningCallback` are built on first access (module `__getattr__`),
so importing this module imports neither transformers nor lightning. Every run stores
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


# ---- framework callbacks, built on first access ---------------------------------------------------

def __getattr__(name: str):
    builders = {"KBCallback": _hf_callback, "KBLightningCallback": _lightning_callback}
    if name not in builders:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = builders[name]()
    globals()[name] = cls
    return cls


def _model_config(model) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {}
    data = plain(cfg.to_dict())
    return {k: v for k, v in data.items() if not (isinstance(v, (dict, list)) and len(v) > MAX_CONFIG_ITEMS)}


def _param_count(model) -> int | None:
    try:
        return sum(p.numel() for p in model.parameters()) or None
    except (AttributeError, TypeError):
        return None


def _hf_callback():
    from transformers import TrainerCallback

    from ingest.hf_trainer import TRAINING_KEYS, metric_key

    class KBCallback(TrainerCallback):
        """Records a Trainer run: on_log entries become curves (the hf-trainer ingester's names:
        loss -> train/loss, eval_loss -> eval/loss), train()'s closing line the summary, config
        {"training": TrainingArguments, "model": model.config}; stored at on_train_end.

        Trainer has no exception hook, so a crash is stored only inside `with callback:`
        around `trainer.train()`; the exception is re-raised. Only the main process writes."""

        def __init__(self, kb=None, project: str = "default", name: str | None = None,
                     config: dict | None = None, index: bool = True, **fields):
            self.kb = open_kb(kb)
            self.project, self.name, self.config, self.index, self.fields = project, name, config, index, fields
            self.run: TrackedRun | None = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if not state.is_world_process_zero:
                return
            settings = args.to_dict() if hasattr(args, "to_dict") else vars(args)
            config = {"training": {k: plain(settings[k]) for k in TRAINING_KEYS
                                   if settings.get(k) is not None and plain(settings[k]) is not None}}
            if model is not None and _model_config(model):
                config["model"] = _model_config(model)
            scale = dict(self.fields.get("scale") or {})
            if model is not None and "params" not in scale and _param_count(model):
                scale["params"] = _param_count(model)
            name = self.name or getattr(args, "run_name", None) or Path(args.output_dir or "run").name
            self.run = TrackedRun(self.kb, self.project, merge(config, self.config or {}), name,
                                  index=self.index, hook="hf-callback",
                                  **{**self.fields, "scale": scale})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.run is None or self.run.stored or not logs:
                return
            numbers = {metric_key(k): v for k, v in logs.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "train_loss" in logs or "total_flos" in logs:     # train()'s closing line
                self.run.summary.update({k: v for k, v in numbers.items() if math.isfinite(v)})
            elif numbers:
                self.run.log(numbers, step=state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if self.run is None or self.run.stored:
                return
            if getattr(state, "total_flos", 0) and "flops" not in self.run.scale:
                self.run.scale["flops"] = float(state.total_flos)
            if getattr(state, "num_input_tokens_seen", 0) and "tokens" not in self.run.scale:
                self.run.scale["tokens"] = int(state.num_input_tokens_seen)
            self.run.finish()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc, tb):
            if self.run is not None and not self.run.stored and exc is not None:
                self.run.__exit__(exc_type, exc, tb)
            return False

    return KBCallback


def _lightning_callback():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class KBLightningCallback(pl.Callback):
        """Records a Lightning fit: the loss of every training step (train/loss), and every scalar
        in callback_metrics after each validation and training epoch; config {"model": hparams,
        "trainer": its step/epoch/precision settings}. Stored at on_fit_end, or at on_exception
        as failed (killed for KeyboardInterrupt). Only global rank 0 writes."""

        def __init__(self, kb=None, project: str = "default", name: str | None = None,
                     config: dict | None = None, index: bool = True, **fields):
            self.kb = open_kb(kb)
            self.project, self.name, self.config, self.index, self.fields = project, name, config, index, fields
            self.run: TrackedRun | None = None

        def on_fit_start(self, trainer, pl_module):
            if not trainer.is_global_zero:
                return
            config = {"model": plain(dict(pl_module.hparams)),
                      "trainer": plain({k: getattr(trainer, k, None) for k in (
                          "max_steps", "max_epochs", "accumulate_grad_batches", "gradient_clip_val",
                          "precision", "num_devices", "num_nodes")})}
            scale = dict(self.fields.get("scale") or {})
            if "params" not in scale and _param_count(pl_module):
                scale["params"] = _param_count(pl_module)
            self.run = TrackedRun(self.kb, self.project, merge(config, self.config or {}),
                                  self.name or type(pl_module).__name__, index=self.index,
                                  hook="lightning-callback", **{**self.fields, "scale": scale})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.run is None or self.run.stored:
                return
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None:
                self.run.log({"train/loss": loss}, step=trainer.global_step)

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._log_callback_metrics(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            self._log_callback_metrics(trainer)

        def _log_callback_metrics(self, trainer):
            if self.run is None or self.run.stored:
                return
            scalars = {}
            for key, value in trainer.callback_metrics.items():
                if getattr(value, "numel", lambda: 1)() == 1:
                    scalars[key] = value
            if scalars:
                self.run.log(scalars, step=trainer.global_step)

        def on_fit_end(self, trainer, pl_module):
            if self.run is not None and not self.run.stored:
                self.run.finish()

        def on_exception(self, trainer, pl_module, exception):
            if self.run is not None and not self.run.stored:
                self.run.__exit__(type(exception), exception, exception.__traceback__)

    return KBLightningCallback
