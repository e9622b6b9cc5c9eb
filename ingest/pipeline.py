"""A big ingest read and prepared by worker processes while the calling process writes.

Reading a run (JSON, validation) and preparing its rows (kb.runs.prepare_run: curve stats,
anomalies, fields, packed curves, the card) is pure Python and about 60% of a bulk ingest into
SQLite; SQLite's writes take the GIL back at every row, so a thread gains nothing there
(measured), processes do. The work is cut into tasks: a file of a walk, or a part of a big
target where its ingester can cut one (a JSONL file's slices of lines, cut at line ends so line
numbers stay those of the file; a TensorBoard tree's runs in groups; a list of records given
to KnowledgeBase.ingest_records, which the forked workers read where it lies). Forked workers take
the tasks in turn (worker w: tasks w, w + n, ...) and send each one's results in chunks; the
writer reads them task by task, so runs reach it, and the report, in the order one process
would have produced them.

What crosses the pipe is small: a run's PreparedRun and, instead of its record (curves and
all), a stand-in that keeps what the report reads (the project). A note goes whole: its write
needs the record.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ingest.base import options_for
from kb.errors import InvalidRecord
from kb.records import NoteRecord, Parsed, RunRecord
from kb.runs import PreparedRun, prepare_run

MIN_BYTES = 4 * 2**20       # below this a worker's start (~30 ms) and the pipe cost more than they save
CHUNK_RUNS = 32             # runs per message
QUEUE_CHUNKS = 8            # messages waiting per worker: memory stays bounded when the writer lags
POLL_S = 1.0                # how often a waiting writer checks that its worker is still alive
END_S = 10.0                # how long a worker told to stop gets before it is killed
# a run's reading and preparing costs ~2x its writing (measured here), so past a few workers
# the one writer is the bottleneck and more would only hold memory
DEFAULT_MAX = 4


@dataclass
class Task:
    read: object                # ingest.detect.Read
    part: object = None         # a part of it (its ingester's `parts`), or None: all of it


@dataclass
class Outcome:
    """One item as the writer gets it: a prepared run, or a record that failed (`error`), or a
    note to write (`prepared` None, record whole), or a Rejected read (`rejected`)."""
    item: Parsed | None
    prepared: PreparedRun | None = None
    error: str | None = None
    rejected: dict | None = None
    source: str = ""


def worth_it(reads: list, workers: int | None) -> int:
    """How many workers to start for these reads: 0 to read in this process (small input, one
    core, no fork here, or threads running that a fork would copy mid-step)."""
    cores = os.cpu_count() or 1
    n = min(cores, DEFAULT_MAX) if workers is None else workers
    if n < 1 or cores < 2 or not sys.platform.startswith("linux") or _threads_in_the_way():
        return 0
    return n if _size(reads, MIN_BYTES) >= MIN_BYTES else 0


def _threads_in_the_way() -> bool:
    """Another thread may hold a lock (an import's, a library's) at the fork, which the worker
    would then wait on forever: with threads running (a server), read in this process."""
    return threading.active_count() > 1


def _size(reads: list, enough: int) -> int:
    """Bytes under the reads' sources, counted until `enough` is reached."""
    total = 0
    for read in reads:
        in_memory = getattr(read.ingester, "approx_bytes", None)      # records given as objects
        if in_memory:
            total += in_memory()
            continue
        # an ingester that reads URLs (MLflow's) says where the store lies, if on this machine
        locate = getattr(read.ingester, "local_path", None)
        path = locate(read.source) if locate else Path(read.source)
        if path is None:
            continue
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            for folder, _, files in os.walk(path):
                for name in files:
                    try:
                        total += os.stat(os.path.join(folder, name)).st_size
                    except OSError:
                        pass
                    if total >= enough:
                        return total
        if total >= enough:
            return total
    return total


def tasks_for(reads: list) -> list[Task]:
    """A task per read, or per part of it where its ingester cuts it (ingest.base.Ingester)."""
    tasks = []
    for read in reads:
        cut = getattr(read.ingester, "parts", None)
        parts = cut(read.source) if cut else None
        if parts and len(parts) > 1:
            tasks += [Task(read, part) for part in parts]
        else:
            tasks.append(Task(read))
    return tasks


def run(reads: list, workers: int, options: dict, project: str | None) -> Iterator[Outcome]:
    """Every item of the reads, in order, read and prepared by `workers` forked processes."""
    tasks = tasks_for(reads)
    n = min(workers, len(tasks))
    ctx = multiprocessing.get_context("fork")
    queues = [ctx.Queue(QUEUE_CHUNKS) for _ in range(n)]
    procs = [ctx.Process(target=_work, args=(tasks[w::n], queues[w], options, project), daemon=True,
                         name=f"kb-ingest-{w}") for w in range(n)]
    # the workers inherit this process's objects frozen: their collector never walks them, which
    # would write to, and so copy, every page of the heap they share with this process
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    try:
        for t in range(len(tasks)):
            while True:
                done, outcomes = _next(queues[t % n], procs[t % n])
                yield from outcomes
                if done:
                    break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            # a worker blocked for good (a SIGTERM handler it should not have had kept one alive,
            # stuck at exit, and this join waited forever in CI) is killed, never waited on
            p.join(END_S)
            if p.is_alive():
                p.kill()
                p.join()
        for q in queues:
            q.close()


def _next(q, proc) -> tuple[bool, list[Outcome]]:
    while True:
        try:
            message = q.get(timeout=POLL_S)
        except queue.Empty:
            if proc.is_alive():
                continue
            try:
                message = q.get(timeout=POLL_S)     # what it sent just before it ended
            except queue.Empty:
                raise RuntimeError(f"an ingest worker ended without finishing (exit code {proc.exitcode})") from None
        kind, payload = message
        if kind == "raise":
            raise payload
        return kind == "end", payload


def _work(tasks: list[Task], q, options: dict, project: str | None) -> None:
    # the fork copied the caller's signal handlers (kb serve ignores SIGTERM while it serves, a
    # tracked run forwards it): a worker ends on the writer's terminate(), as a worker should
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)
    try:
        for task in tasks:
            chunk: list[Outcome] = []
            for outcome in _outcomes(task, options, project):
                chunk.append(outcome)
                if len(chunk) >= CHUNK_RUNS:
                    q.put(("more", chunk))
                    chunk = []
            q.put(("end", chunk))
    except BaseException as exc:        # re-raised in the writer, as one process would have raised it
        q.put(("raise", _picklable(exc)))
    q.close()
    q.join_thread()


def _outcomes(task: Task, options: dict, project: str | None) -> Iterator[Outcome]:
    read = task.read
    if task.part is None:
        items = read.ingester.read(read.source, **options_for(read.ingester, options))
    else:
        items = read.ingester.read_part(read.source, task.part)
    for item in items:
        if not isinstance(item, Parsed):
            yield Outcome(None, rejected=item.error.as_dict(), source=read.source)
            continue
        read.settle(item, project)
        if isinstance(item.record, NoteRecord):
            yield Outcome(item, source=read.source)
            continue
        light = Parsed(RunRecord.model_construct(project=item.record.project), item.source_kind,
                       item.source_uri, item.line)
        try:
            prepared = prepare_run(item.record, item.source_kind, item.source_uri)
        except (InvalidRecord, ValueError) as exc:
            yield Outcome(light, error=str(exc), source=read.source)
            continue
        yield Outcome(light, prepared, source=read.source)


def _picklable(exc: BaseException) -> BaseException:
    import pickle
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return RuntimeError(f"an ingest worker failed: {text}")
