"""Notes in the store: postmortems, design docs and reviews, linked to the runs they mention."""
from __future__ import annotations

import hashlib

from sqlalchemy import delete, or_, select
from sqlmodel import Session

from kb.models import Note, Run, utcnow
from kb.records import NoteRecord, note_hash
from kb.indexer import queue_index
from kb.runs import Outcome


def write_note(session: Session, note: NoteRecord, source_kind: str, source_uri: str) -> tuple[Outcome, str]:
    digest = note_hash(note, source_kind)
    note_id = note.id or f"note-{hashlib.sha1(f'{source_uri}#{note.chunk}'.encode()).hexdigest()[:12]}"
    existing = session.get(Note, note_id)
    if existing is not None and existing.content_hash == digest:
        return "unchanged", note_id
    fields = dict(project=note.project, title=note.title, text=note.text, chunk=note.chunk,
                  mentions=resolve_mentions(session, note.mentions), source_kind=source_kind,
                  source_uri=source_uri, content_hash=digest, ingested_at=utcnow())
    if existing is None:
        session.add(Note(id=note_id, **fields))
    else:
        for k, v in fields.items():
            setattr(existing, k, v)
    queue_index(session, "note", note_id)
    return ("added" if existing is None else "updated"), note_id


def resolve_mentions(session: Session, candidates: list[str]) -> list[str]:
    """The run ids among `candidates`, matched by id or by run name."""
    if not candidates:
        return []
    rows = session.execute(select(Run.id, Run.name).where(
        or_(Run.id.in_(candidates), Run.name.in_(candidates)))).all()
    return sorted({rid for rid, _ in rows})


def drop_chunks_beyond(session: Session, source_uri: str, count: int) -> int:
    """Remove a document's chunks numbered `count` and up, and their vectors."""
    stale = list(session.execute(select(Note.id).where(Note.source_uri == source_uri, Note.chunk >= count)).scalars())
    if stale:
        session.execute(delete(Note).where(Note.id.in_(stale)))
        for note_id in stale:
            queue_index(session, "note", note_id)    # the indexer drops vectors of rows that are gone
    return len(stale)
