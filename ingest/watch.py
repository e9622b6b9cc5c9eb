"""`kb watch DIR`: ingest the runs under a folder once they have finished, and only those that changed.

What a run is. Each entry directly under DIR is one unit (a log file, a JSONL, a TB /
HF Trainer / W&B run folder, a notes file), read by `KnowledgeBase.ingest`, so what
it holds is decided by ingest.detect as for `kb ingest`. A folder that holds only
folders (W&B's `wandb/`, a tree of TensorBoard runs) is a folder of runs: its
sub-folders are the units, recursively. HF Trainer folders holding only `checkpoint-N/`
are one run, not one per checkpoint. Dot entries, `.git`, `.kb`, `.venv` and links are
skipped.

When a unit is finished (either rule):
- quiet: no file in it changed for `quiet_seconds` (newest mtime);
- an end marker: a `_SUCCESS` or `DONE` file directly in the folder; an HF
  `trainer_state.json` (top level or in a checkpoint) with global_step >= max_steps;
  a W&B run folder whose `.wandb` logs all end with an exit record (this one is read
  through the wandb ingester, so it costs a read while the run is live).

Unchanged units are not read at all: a fingerprint (relative path, size and mtime of
every file, stat only) of each unit is kept, in memory and in KB_HOME/watch-state.json
(per database and root, written atomically), so a restarted watcher skips what it
already ingested. A unit that changes after ingestion is ingested again when it is
finished again (ingest is idempotent: unchanged records stay unchanged). A unit no
ingester reads is remembered as ignored until it changes; one whose records were
rejected is remembered too, with the errors in the report.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kb.errors import KBError, UnknownFormat

SKIP_DIRS = {".git", "__pycache__", ".kb", ".venv", "node_modules"}
MARKERS = ("_SUCCESS", "DONE")
HF_STATE = "trainer_state.json"
CHECKPOINT = re.compile(r"checkpoint-\d+\Z")
STATE_FILE = "watch-state.json"
STATE_VERSION = 1


@dataclass
class WatchReport:
    ingested: list[dict] = field(default_factory=list)    # {path, reason, added, updated, unchanged, ids}
    waiting: list[str] = field(default_factory=list)       # changed but not finished yet
    unchanged: int = 0                                     # fingerprint as last time: not read
    ignored: list[str] = field(default_factory=list)       # no ingester reads it
    failed: list[dict] = field(default_factory=list)       # rejected records {source, line, field, error}

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Snapshot:
    fingerprint: str
    newest: float          # newest mtime of any file, unix seconds (0 for an empty folder)
    files: int


def units(root: Path) -> list[Path]:
    """The candidate runs under `root` (see the module docstring)."""
    if root.is_file():
        return [root]
    out: list[Path] = []
    for child in _entries(root):
        if child.is_dir() and _is_folder_of_runs(child):
            out.extend(units(child))
        elif child.is_dir() or child.is_file():
            out.append(child)
    return out


def _entries(folder: Path) -> list[Path]:
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    return [c for c in children if not c.name.startswith(".") and c.name not in SKIP_DIRS and not c.is_symlink()]


def _is_folder_of_runs(folder: Path) -> bool:
    entries = _entries(folder)
    return (bool(entries) and all(c.is_dir() for c in entries)
            and not any(CHECKPOINT.match(c.name) for c in entries))


def snapshot(unit: Path) -> Snapshot:
    """Stat every file of a unit (nothing is opened)."""
    rows, newest = [], 0.0
    if unit.is_file():
        files = [(unit.name, unit)]
    else:
        files = []
        for folder, dirs, names in os.walk(unit):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
            for n in names:
                p = Path(folder) / n
                files.append((str(p.relative_to(unit)), p))
    for rel, p in files:
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue            # removed while we walked: the next scan sees the new state
        rows.append(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}")
        newest = max(newest, st.st_mtime)
    digest = hashlib.sha1("\n".join(sorted(rows)).encode()).hexdigest()
    return Snapshot(digest, newest, len(rows))


def end_marker(unit: Path) -> str | None:
    """Why a folder says its run is over, or None."""
    if not unit.is_dir():
        return None
    for name in MARKERS:
        if (unit / name).exists():
            return f"marker {name}"
    states = [unit / HF_STATE] + [c / HF_STATE for c in _entries(unit) if CHECKPOINT.match(c.name)]
    for path in states:
        try:
            state = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue            # absent, or half-written: the quiet rule still applies
        step, total = state.get("global_step"), state.get("max_steps")
        if isinstance(step, int) and isinstance(total, int) and 0 < total <= step:
            return f"{HF_STATE} at max_steps"
    if any(unit.glob("run-*.wandb")) and _wandb_exited(unit):
        return "wandb exit record"
    return None


def _wandb_exited(unit: Path) -> bool:
    from ingest.detect import load_ingesters
    from kb.records import Parsed

    items = list(load_ingesters()["wandb"].read(str(unit)))
    return bool(items) and all(isinstance(i, Parsed) and i.record.status != "running" for i in items)


class Watcher:
    """Scans `root` and ingests finished, changed runs into `kb`; `scan_once()` -> WatchReport."""

    def __init__(self, kb, root: str | Path, quiet_seconds: float = 60.0, *, project: str | None = None,
                 state_path: str | Path | None = None):
        self.kb = kb
        self.root = Path(root).absolute()
        self.quiet_seconds = quiet_seconds
        self.project = project
        self.state_path = Path(state_path) if state_path else Path(kb.settings.home) / STATE_FILE
        self.key = f"{_safe_url(kb.settings.sql_url)}|{self.root}"
        self.seen: dict[str, dict] = self._load().get(self.key, {})

    def scan_once(self) -> WatchReport:
        report = WatchReport()
        now = time.time()
        present, changed = set(), False
        for unit in units(self.root):
            path = str(unit)
            present.add(path)
            snap = snapshot(unit)
            if self.seen.get(path, {}).get("fingerprint") == snap.fingerprint:
                report.unchanged += 1
                continue
            reason = "quiet" if now - snap.newest >= self.quiet_seconds else end_marker(unit)
            if reason is None:
                report.waiting.append(path)
                continue
            entry = {"fingerprint": snap.fingerprint, "at": datetime.now(timezone.utc).isoformat()}
            try:
                got = self.kb.ingest(path, project=self.project, index=False)
            except UnknownFormat:
                report.ignored.append(path)
                entry["outcome"] = "ignored"
            except OSError:
                continue        # vanished or unreadable mid-scan: try again next time
            except KBError as exc:
                report.failed.append({"source": path, "line": None, "field": "", "error": str(exc)})
                entry["outcome"] = "failed"
            else:
                report.ingested.append({"path": path, "reason": reason, "added": got.added,
                                        "updated": got.updated, "unchanged": got.unchanged, "ids": got.ids})
                report.failed.extend(got.failed)
                entry.update(outcome="ingested", ids=got.ids)
            self.seen[path] = entry
            changed = True
        for gone in set(self.seen) - present:
            del self.seen[gone]
            changed = True
        if changed:
            self._save()
        return report

    # ---- the state file ---------------------------------------------------------------------

    def _load(self) -> dict:
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}            # first start, or a damaged file: re-ingesting is safe, only slower
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            return {}
        return data.get("watches", {})

    def _save(self) -> None:
        # re-read first: another watcher on the same KB_HOME keeps its own section
        watches = self._load()
        watches[self.key] = self.seen
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": STATE_VERSION, "watches": watches}))
        os.replace(tmp, self.state_path)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url        # an unparsable URL still works as a key
