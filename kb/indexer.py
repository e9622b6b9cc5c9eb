"""Keeps the vector index in step with SQL: drains what writers queued, and reconciles on open.

Writers never touch the index (an embedded Qdrant folder is one process's alone): they
queue `IndexPending` rows in the same transaction as the run. Whoever holds the index
calls `sync`, which embeds in batches outside any SQL transaction, so a slow embedding
never holds the SQL write lock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from sqlalchemy import DateTime, delete, func, insert, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import Session

from kb.cards import card_hash
from kb.models import IndexPending, Note, Run, utcnow

log = logging.getLogger(__name__)
BATCH = 128


@dataclass
class SyncReport:
    indexed: int = 0
    removed: int = 0
    requeued: int = 0


def queue_index(session: Session, kind: str, ref_id: str) -> None:
    """Mark a record for (re)indexing, in the writer's own transaction: the run and its queue
    entry commit together, so a crash can never leave a stored run that nobody will index."""
    conn = session.connection()
    conn.execute(_upsert_pending(conn.dialect.name), {"kind": kind, "ref_id": ref_id, "queued_at": utcnow()})


@lru_cache(maxsize=None)
def _upsert_pending(dialect_name: str):
    # built once with bound parameters: building and caching a fresh statement per run cost
    # about as much as the run's curve inserts
    dialect = postgresql if dialect_name == "postgresql" else sqlite
    stmt = dialect.insert(IndexPending)
    return stmt.on_conflict_do_update(index_elements=["kind", "ref_id"], set_={"queued_at": stmt.excluded.queued_at})


def point_id(kind: str, ref_id: str) -> str:
    return f"{kind}:{ref_id}"


def sync(engine: Engine, index, embedder, *, reconcile: bool = True,
         progress: Callable[[int, int], None] | None = None) -> SyncReport:
    report = SyncReport()
    if reconcile:
        report.requeued, report.removed = _reconcile(engine, index)
    with Session(engine) as s:
        total = s.execute(select(func.count()).select_from(IndexPending)).scalar_one()
    done = 0
    while True:
        started = utcnow()
        with Session(engine) as s:
            batch = s.execute(select(IndexPending.kind, IndexPending.ref_id)
                              .order_by(IndexPending.queued_at).limit(BATCH)).all()
            if not batch:
                break
            docs = _documents(s, batch)
        gone = [point_id(k, r) for k, r in batch if (k, r) not in docs]
        if gone:
            index.delete(gone)
            report.removed += len(gone)
        if docs:
            from kb.vectors import VectorPoint
            keys = list(docs)
            vectors = embedder.encode([docs[k]["text"] for k in keys])
            index.upsert([VectorPoint(id=point_id(*k), vector=v, payload=docs[k]["payload"])
                          for k, v in zip(keys, vectors)])
            report.indexed += len(keys)
        with Session(engine) as s, s.begin():
            # a writer may have re-queued a ref while we embedded it: keep those
            for kind, ref in batch:
                s.execute(delete(IndexPending).where(IndexPending.kind == kind, IndexPending.ref_id == ref,
                                                     IndexPending.queued_at <= started))
        done += len(batch)
        if progress:
            progress(done, max(total, done))
    return report


def _documents(s: Session, batch) -> dict[tuple[str, str], dict]:
    out = {}
    run_ids = [r for k, r in batch if k == "run"]
    note_ids = [r for k, r in batch if k == "note"]
    if run_ids:
        for row in s.execute(select(Run).where(Run.id.in_(run_ids))).scalars():
            out[("run", row.id)] = {"text": row.card, "payload": payload(
                "run", row.id, row.project, row.name, row.card, status=row.status)}
    if note_ids:
        for row in s.execute(select(Note).where(Note.id.in_(note_ids))).scalars():
            text = note_text(row)
            out[("note", row.id)] = {"text": text, "payload": payload("note", row.id, row.project, row.title, text)}
    return out


def payload(kind: str, ref_id: str, project: str, label: str, text: str, status: str | None = None) -> dict:
    """The one payload every point carries: what retrieval filters on (kb.vectors.INDEXED_FIELDS),
    a label to show, and the hash of the embedded text that tells a stale vector from a fresh one."""
    out = {"kind": kind, "ref_id": ref_id, "project": project, "label": label, "card_hash": card_hash(text)}
    if status is not None:
        out["status"] = status
    return out


def note_text(row: Note) -> str:
    return f"{row.title}\n{row.text}" if row.title else row.text


def _reconcile(engine: Engine, index) -> tuple[int, int]:
    """Queue whatever SQL holds that the index lacks or holds stale; drop what SQL no longer has."""
    with Session(engine) as s:
        n_sql = (s.execute(select(func.count()).select_from(Run)).scalar_one()
                 + s.execute(select(func.count()).select_from(Note)).scalar_one())
        n_pending = s.execute(select(func.count()).select_from(IndexPending)).scalar_one()
    if index.count() == n_sql and n_pending == 0:
        return 0, 0          # the common case: nothing to compare, reopen stays fast
    have = index.fingerprints()
    want = expected_fingerprints(engine)
    missing = [pid for pid, h in want.items() if have.get(pid) != h]
    with Session(engine) as s:
        queued = {point_id(k, r) for k, r in s.execute(select(IndexPending.kind, IndexPending.ref_id))}
    extra = [pid for pid in have if pid not in want]
    if extra:
        index.delete(extra)
    todo = [pid for pid in missing if pid not in queued]
    with Session(engine) as s, s.begin():
        for pid in todo:
            kind, ref = pid.split(":", 1)
            s.add(IndexPending(kind=kind, ref_id=ref))
    if todo or extra:
        log.info("index reconcile: %d to index, %d removed", len(todo), len(extra))
    return len(todo), len(extra)


def expected_fingerprints(engine: Engine) -> dict[str, str]:
    """point id -> card hash of everything SQL holds: what an index in step with it returns from
    `fingerprints()`."""
    want: dict[str, str] = {}
    with Session(engine) as s:
        for rid, card in s.execute(select(Run.id, Run.card)):
            want[point_id("run", rid)] = card_hash(card)
        for row in s.execute(select(Note)).scalars():
            want[point_id("note", row.id)] = card_hash(note_text(row))
    return want


def queue_everything(engine: Engine) -> int:
    now = utcnow()
    cols = ["kind", "ref_id", "queued_at"]
    with Session(engine) as s, s.begin():
        s.execute(delete(IndexPending))
        for kind, model in (("run", Run), ("note", Note)):
            s.execute(insert(IndexPending).from_select(
                cols, select(literal(kind), model.id, literal(now, type_=DateTime))))
        return s.execute(select(func.count()).select_from(IndexPending)).scalar_one()
