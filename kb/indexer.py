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
from kb.models import Ablation, Failure, IndexPending, Note, Run, utcnow
from kb.record_texts import ablation_texts, failure_texts, note_texts, run_texts

log = logging.getLogger(__name__)
BATCH = 128
INDEXED = (Run, Note, Ablation, Failure)      # each row one point


@dataclass
class SyncReport:
    indexed: int = 0
    removed: int = 0
    requeued: int = 0


def queue_index(session: Session, kind: str, ref_id: str) -> None:
    """Mark a record for (re)indexing, in the writer's own transaction: the run and its queue
    entry commit together, so a crash can never leave a stored run that nobody will index."""
    queue_refs(session.connection(), kind, [ref_id])


def queue_refs(conn, kind: str, ref_ids) -> None:
    """`queue_index` for many records of one kind, on a Connection (the ablation refresh's)."""
    rows = [{"kind": kind, "ref_id": str(r), "queued_at": utcnow()} for r in ref_ids]
    if rows:
        conn.execute(_upsert_pending(conn.dialect.name), rows)


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
    """What each queued record embeds, for those that still exist. A run brings its failures
    along (they are written with it, and their ids are new each time it is); a failure queued
    on its own is one whose run was rewritten, so its point goes unless it still exists."""
    wanted: dict[str, list[str]] = {}
    for kind, ref in batch:
        wanted.setdefault(kind, []).append(ref)
    records = []
    if wanted.get("run"):
        records += run_texts(s, wanted["run"])
        records += failure_texts(s, run_ids=wanted["run"])
    if wanted.get("note"):
        records += note_texts(s, wanted["note"])
    if wanted.get("ablation"):
        records += ablation_texts(s, wanted["ablation"])
    if wanted.get("failure"):
        records += failure_texts(s, wanted["failure"])
    return {(r.kind, r.id): {"text": r.text, "payload": payload(r.kind, r.id, r.project, r.label, r.text,
                                                                  status=r.status)}
            for r in records}


def payload(kind: str, ref_id: str, project: str, label: str, text: str, status: str | None = None) -> dict:
    """The one payload every point carries: what retrieval filters on (kb.vectors.INDEXED_FIELDS),
    a label to show, and the hash of the embedded text that tells a stale vector from a fresh one."""
    out = {"kind": kind, "ref_id": ref_id, "project": project, "label": label, "card_hash": card_hash(text)}
    if status is not None:
        out["status"] = status
    return out


def _reconcile(engine: Engine, index) -> tuple[int, int]:
    """Queue whatever SQL holds that the index lacks or holds stale; drop what SQL no longer has."""
    with Session(engine) as s:
        n_sql = sum(s.execute(select(func.count()).select_from(model)).scalar_one() for model in INDEXED)
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
    with Session(engine) as s:
        return {point_id(r.kind, r.id): card_hash(r.text)
                for texts in (run_texts, note_texts, ablation_texts, failure_texts) for r in texts(s)}


def queue_everything(engine: Engine) -> int:
    now = utcnow()
    cols = ["kind", "ref_id", "queued_at"]
    with Session(engine) as s, s.begin():
        s.execute(delete(IndexPending))
        # a run's entry brings its failures (see _documents): runs, notes and ablations suffice
        for kind, model in (("run", Run), ("note", Note), ("ablation", Ablation)):
            s.execute(insert(IndexPending).from_select(
                cols, select(literal(kind), model.id, literal(now, type_=DateTime))))
        return s.execute(select(func.count()).select_from(IndexPending)).scalar_one()
