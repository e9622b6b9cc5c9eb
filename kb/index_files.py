"""The embedded index's folder on disk, apart from what is in it: the lock that makes it one
process's alone, the sidecar naming the model its vectors came from, private copies for readers,
removal for a rebuild, and keeping what the native engine prints on fd 2 out of the CLI's one
error line. kb.vectors.EdgeIndex builds on these."""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from kb.errors import IndexBusy, IndexDamaged, ReadOnlyStore

log = logging.getLogger(__name__)


def busy(path: Path) -> IndexBusy:
    return IndexBusy(f"vector index {path} is open in another process (kb serve?); "
                     "what was written waits in SQL and is indexed by that process")


def take_lock(path: Path):
    """Hold `<name>.lock` beside the folder while it is open. The engine's own lock lives in its WAL
    folder, which a damaged index may lack; this one lets a rebuild remove the folder knowing that
    no other process has it open."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path.with_name(path.name + ".lock"), "a")
    except PermissionError as exc:
        raise ReadOnlyStore(f"vector index at {path} is read-only ({exc.strerror})") from exc
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise ReadOnlyStore(f"vector index at {path} is on a read-only file system") from exc
        raise
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise busy(path) from None
    return fh


@contextmanager
def writes_settled(path: Path, *, writer: bool):
    """Hold `<name>.write.lock` beside the folder: a writer exclusively for each write and its flush,
    a reader's copy shared, so that no copy catches a segment half-written. A reader that cannot
    open the file (a read-only store has no writer) copies without it."""
    lock_path = path.with_name(path.name + ".write.lock")
    try:
        fh = open(lock_path, "a" if writer else "r")
    except OSError:
        if writer:
            raise
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX if writer else fcntl.LOCK_SH)
        yield                         # closing the file releases its flock


def remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    meta_path(path).unlink(missing_ok=True)


def meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_meta(path: Path, default: dict) -> dict:
    """Which model and dimension the vectors are from (a sidecar we write; qdrant-edge keeps no metadata)."""
    meta = meta_path(path)
    if not meta.exists():
        return default
    try:
        have = json.loads(meta.read_bytes())
        return {"model": have["model"], "dim": have["dim"]}
    except (ValueError, TypeError, KeyError) as exc:
        raise damaged(path, f"{meta.name}: {exc}") from exc


def damaged(path: Path, reason: str) -> IndexDamaged:
    return IndexDamaged(f"vector index at {path} is unusable ({reason}); the runs are safe in SQL, "
                        "and `kb reindex` rebuilds the index from them")


_STDERR_LOCK = threading.Lock()


@contextmanager
def native_stderr_to_log():
    """What native code writes to fd 2 goes to the log (shown with --verbose), so an error stays
    the one line the CLI prints; Python's own sys.stderr is untouched when nothing was written."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said = sink.read().decode("utf-8", "replace").strip()
            if said:
                log.info("qdrant-edge: %s", said)


def copy_shard(src: Path, dst: Path) -> bool:
    """Copy a shard's files, leaving out its WAL (its lock, and 64 MB of preallocated segments;
    every write is flushed to the segments) and the temp files of writes in flight. True when
    nothing changed while copying."""
    before = _file_states(src)
    for rel in before:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(src / rel, target)
        except FileNotFoundError:
            pass                          # replaced while we copied: `after` differs, so we retry
    return _file_states(src) == before


def _file_states(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for folder, dirs, files in os.walk(root):
        if Path(folder) == root and "wal" in dirs:
            dirs.remove("wal")
        for name in files:
            if name.startswith(".atomicwrite"):
                continue
            p = Path(folder) / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out
