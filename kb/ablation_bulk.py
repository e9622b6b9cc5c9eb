"""The end of a bulk load on Postgres: the projects it mostly wrote, rebuilt two at a time.

A bulk load's refresh (kb.ablation_store.refresh_all with `bulk`) rebuilds each mostly-queued
project whole, one after another, and one core idles: a rebuild is mostly Python (finding the
ablations), the rest the server's (COPY of bucket, ablation and field rows). Here two forked
processes rebuild two projects at a time, each in a transaction of its own, while the calling
process holds the refresh's lock (`benchmarks/bulk_end.py`: ~1.85x on 12 projects). Where a
fork is unsafe (other threads running: a server) two threads do it instead, which gains less:
their Python shares one GIL.

Two rebuilds write disjoint rows: an ablation's id names its project, and bucket, membership
and field rows belong to one run, which is in one project. A run that moved between projects
since its ablations were found breaks that (an ablation of its old project still holds it), so
projects linked by such a run are left to the serial refresh that follows, as is a project
whose rebuild here failed for any reason (a conflict with a writer, a worker killed): its
transaction rolled back, its queue entries stay, and the serial refresh does it again in this
process, where an error that repeats is raised as usual. SQLite writes one transaction at a
time: nothing to gain there.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
from collections import defaultdict
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from kb.ablation_store import (delete_entries, linked_by_moved_runs, lock_refresh, mostly_queued, rebuild,
                               refresh_all)
from kb.models import AblationPending, Run

log = logging.getLogger(__name__)

SIDE_BY_SIDE_MIN = 100      # runs in a project from which its rebuild runs beside another's (12
                            # projects of 100 runs: 0.673 s against 1.237 one after another,
                            # benchmarks/bulk_end.py)
WORKERS = 2                 # the cores here; the server's share of a rebuild runs beside them

_RUNS = Run.__table__
_QUEUE = AblationPending.__table__


def refresh_bulk(engine: Engine) -> int:
    """The refresh at a bulk load's end (KnowledgeBase.bulk): big mostly-queued projects rebuilt
    side by side on Postgres, then everything left as refresh_all(bulk=True) does it. Returns the
    queue entries taken."""
    taken = _side_by_side(engine) if engine.dialect.name == "postgresql" else 0
    return taken + refresh_all(engine, bulk=True)


def _side_by_side(engine: Engine) -> int:
    with engine.begin() as conn:
        if conn.execute(select(_QUEUE.c.id).limit(1)).first() is None:
            return 0
        lock_refresh(conn)          # held until every worker is done: no other refresh meanwhile
        entries = _entries_by_project(conn)
        sizes = dict(conn.execute(select(_RUNS.c.project, func.count()).where(_RUNS.c.project.in_(sorted(entries)))
                                  .group_by(_RUNS.c.project)).all())
        chosen = [p for p, ids in entries.items()
                  if sizes.get(p, 0) >= SIDE_BY_SIDE_MIN and mostly_queued(len(ids), sizes[p])]
        if len(chosen) >= 2:
            linked = linked_by_moved_runs(conn, chosen)
            chosen = [p for p in chosen if p not in linked]
        if len(chosen) < 2:
            return 0
        chosen.sort(key=lambda p: -sizes[p])           # the biggest first: the workers end closer together
        return _run_all(engine, [(p, entries[p]) for p in chosen])


def _run_all(engine: Engine, work: list[tuple[str, list[int]]]) -> int:
    """Each (project, its entry ids) rebuilt by a worker; the entries taken."""
    pool: Executor
    if fork_is_safe():
        pool = ProcessPoolExecutor(WORKERS, multiprocessing.get_context("fork"), _start_worker, (engine,))
        task = _rebuild_in_worker
    else:
        pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kb-rebuild")
        task = partial(_rebuild, engine)
    with pool:
        # forked children inherit this heap frozen: their collector never walks it, which would
        # write to, and so copy, every page they share with this process
        gc.freeze()
        try:
            futures = [pool.submit(task, p, ids) for p, ids in work]
        finally:
            gc.unfreeze()
        taken = 0
        for (project, _), future in zip(work, futures):
            try:
                taken += future.result()
            except Exception as exc:      # a worker that died (BrokenProcessPool) or failed
                log.info("rebuild of project %r beside another failed (%s); redone alone", project, exc)
        return taken


def fork_is_safe() -> bool:
    """A fork copies only the calling thread: a lock another thread holds (an import's, a
    library's) would stay held in the child forever."""
    return hasattr(os, "fork") and threading.active_count() == 1


def _entries_by_project(conn: Connection) -> dict[str, list[int]]:
    """Queue entry ids per project: its runs' entries and entries naming the project whole."""
    out: dict[str, list[int]] = defaultdict(list)
    for entry_id, project in conn.execute(select(_QUEUE.c.id, _RUNS.c.project)
                                          .join(_RUNS, _RUNS.c.id == _QUEUE.c.run_id)):
        out[project].append(entry_id)
    for entry_id, project in conn.execute(select(_QUEUE.c.id, _QUEUE.c.project).where(_QUEUE.c.run_id.is_(None))):
        out[project].append(entry_id)
    return out


def _rebuild(engine: Engine, project: str, entry_ids: list[int]) -> int:
    with engine.begin() as conn:
        rebuild(conn, project)
        delete_entries(conn, entry_ids)
    return len(entry_ids)


_worker_engine: Engine | None = None


def _start_worker(engine: Engine) -> None:
    global _worker_engine
    # the fork copied the caller's signal handlers (kb serve's, a tracked run's): a worker ends
    # when told to, as a worker should
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    engine.dispose(close=False)        # the pooled connections are the parent's: new ones here
    _worker_engine = engine


def _rebuild_in_worker(project: str, entry_ids: list[int]) -> int:
    assert _worker_engine is not None
    try:
        return _rebuild(_worker_engine, project, entry_ids)
    except Exception as exc:
        # SQLAlchemy's and the driver's errors do not all survive pickling: their words do
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
