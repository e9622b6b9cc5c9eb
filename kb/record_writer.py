"""Parsed records into the store, runs in groups, with what happened to each in an IngestReport.

A run's own statements (its hash lookup, its row, its fields, curves, queue entries, a savepoint)
cost more per run than the rows they carry, so runs are prepared one by one (kb.runs.prepare_run:
pure Python, no database) and written GROUP_RUNS at a time, one statement per table. Atomicity
stays per run: when a group cannot go in, each of its runs is written again in its own savepoint,
so the one at fault is reported alone and the others are stored.

On Postgres a group is written by a thread while the next is prepared: most of a group's write
is the server's (COPY into indexed tables), and the driver waits for it without the GIL, so the
two overlap on two cores. SQLite's writes run in this process and take the GIL back at every
row: there a thread gained nothing (measured), so groups are written in line. Either way the
report is only touched by the caller's thread, and groups are written in the order given.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy.exc import IntegrityError

from kb.db import WriteBatch
from kb.errors import InvalidRecord
from kb.records import NoteRecord, Parsed
from kb.runs import PreparedRun, prepare_run, write_prepared

GROUP_RUNS = 64


@dataclass
class IngestReport:
    added: int = 0
    updated: int = 0
    unchanged: int = 0
    failed: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)    # files a walk visited that are not runs
    ids: list[str] = field(default_factory=list)
    pending_index: int = 0
    projects: set[str] = field(default_factory=set)     # touched: their ablations are recomputed
    note_chunks: dict[str, int] = field(default_factory=dict)   # document -> chunks it has now

    def as_dict(self) -> dict:
        return {"added": self.added, "updated": self.updated, "unchanged": self.unchanged,
                "failed": self.failed, "skipped": self.skipped}


class RecordWriter:
    """`with RecordWriter(engine, report) as w: w.add(parsed)`; everything added is written by
    the end of the block, and also when an error ends it early (what came before it stays)."""

    def __init__(self, engine, report: IngestReport):
        self.batch = WriteBatch(engine)
        self.report = report
        self.group: list[tuple[Parsed, PreparedRun]] = []
        self.ids: set[str] = set()
        threaded = engine.dialect.name == "postgresql"
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kb-writer") if threaded else None
        self.in_flight: Future | None = None

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            try:
                self.flush()
            finally:
                self._drain()
        finally:
            if self.writer:
                self.writer.shutdown()
            self.batch.__exit__(exc_type, exc, tb)

    def add(self, item: Parsed) -> None:
        if isinstance(item.record, NoteRecord):
            self.flush()            # in the order given: a later run may cite this note
            self._drain()
            self._write_note(item)
            return
        try:
            prepared = prepare_run(item.record, item.source_kind, item.source_uri)
        except (InvalidRecord, ValueError) as exc:
            self.reject(item, str(exc))
            return
        self.add_prepared(item, prepared)

    def add_prepared(self, item: Parsed, prepared: PreparedRun) -> None:
        """A run prepared elsewhere (ingest.pipeline); the report reads only the project of
        `item.record`."""
        if prepared.id in self.ids:
            self.flush()            # the same run twice: the second write must see the first
        self.group.append((item, prepared))
        self.ids.add(prepared.id)
        if len(self.group) >= GROUP_RUNS:
            self.flush()

    def flush(self) -> None:
        group, self.group, self.ids = self.group, [], set()
        if not group:
            return
        if self.writer is None:
            self._report(self._write_group(group))
            return
        self._drain()               # one group in flight: groups go in in order, memory stays bounded
        self.in_flight = self.writer.submit(self._write_group, group)

    def _drain(self) -> None:
        """Wait for the group in flight and report it (its error, if it raised, is raised here)."""
        if self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            self._report(done.result())

    def _write_group(self, group: list[tuple[Parsed, PreparedRun]]) -> list[tuple]:
        """(item, outcome, ref) or (item, None, error) for each run of the group, written together."""
        try:
            with self.batch.record(len(group)) as s:
                outcomes = write_prepared(s.connection(), [p for _, p in group])
        except Exception:
            # one of them cannot go in (or the database failed): each alone, so only that one fails
            return [self._write(item, lambda s, p=prepared: (write_prepared(s.connection(), [p])[0], p.id))
                    for item, prepared in group]
        return [(item, outcome, prepared.id) for (item, prepared), outcome in zip(group, outcomes)]

    def _write_note(self, item: Parsed) -> None:
        from kb.notes import write_note
        self._report([self._write(item, lambda s: write_note(s, item.record, item.source_kind, item.source_uri))])

    def _write(self, item: Parsed, write) -> tuple:
        """One record in its own savepoint: `write(session)` gives (outcome, ref), or it fails alone."""
        try:
            with self.batch.record() as s:
                outcome, ref = write(s)
        except IntegrityError as exc:
            return item, None, f"conflicts with the store: {exc.orig}"
        except (InvalidRecord, ValueError) as exc:
            return item, None, str(exc)
        return item, outcome, ref

    def _report(self, results: list[tuple]) -> None:
        for item, outcome, ref in results:
            if outcome is None:
                self.reject(item, ref)
            else:
                self._done(item, outcome, ref)

    def reject(self, item: Parsed, message: str) -> None:
        """A record that cannot go in, reported as failed."""
        self.report.failed.append(InvalidRecord(message, source=item.source_uri, line=item.line).as_dict())

    def _done(self, item: Parsed, outcome: str, ref: str) -> None:
        report, record = self.report, item.record
        setattr(report, outcome, getattr(report, outcome) + 1)
        report.ids.append(ref)
        if isinstance(record, NoteRecord):
            report.note_chunks[item.source_uri] = max(report.note_chunks.get(item.source_uri, 0), record.chunk + 1)
        elif outcome != "unchanged":
            report.projects.add(record.project)
