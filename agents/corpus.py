"""The citable chunks, read from SQL: run cards, note chunks, ablations and failures, each as the
same text the vector index embeds, with what retrieval filters on.

SQL is the source of truth, so the keyword index and the answer's context are built from here,
never from the vector index's payloads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from kb.models import Ablation, Failure, Note, Run
from kb.record_texts import RecordText, ablation_texts, failure_texts, note_texts, run_texts

KINDS = ("run", "note", "ablation", "failure")


@dataclass(frozen=True)
class Chunk:
    kind: str            # run | note | ablation | failure: the citation kinds of the contract
    id: str              # the record's id (a failure's integer id as text)
    text: str
    project: str
    status: str | None = None     # runs, and failures (their run's status)
    run_id: str | None = None     # the run a failure belongs to; a run's own id

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.id}"


def all_chunks(engine: Engine) -> Iterator[Chunk]:
    with Session(engine) as s:
        yield from _runs(s, None)
        yield from _notes(s, None)
        yield from _ablations(s, None)
        yield from _failures(s, None)


def chunks_by_key(engine: Engine, keys: Iterable[str]) -> dict[str, Chunk]:
    """The chunks named `kind:id`, those that still exist."""
    wanted: dict[str, list[str]] = {k: [] for k in KINDS}
    for key in keys:
        kind, _, ref = key.partition(":")
        if kind in wanted and ref:
            wanted[kind].append(ref)
    out: dict[str, Chunk] = {}
    with Session(engine) as s:
        for kind, reader in (("run", _runs), ("note", _notes), ("ablation", _ablations), ("failure", _failures)):
            if wanted[kind]:
                out.update((c.key, c) for c in reader(s, wanted[kind]))
    return out


def _chunk(r: RecordText) -> Chunk:
    return Chunk(r.kind, r.id, r.text, r.project, r.status, r.run_id)


def _runs(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    return map(_chunk, run_texts(s, ids))


def _notes(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    return map(_chunk, note_texts(s, ids))


def _ablations(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    return map(_chunk, ablation_texts(s, ids))


def _failures(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    return map(_chunk, failure_texts(s, ids))


def record_values(engine: Engine, keys: Iterable[str]) -> dict[str, list]:
    """Each record's full content (not its card's rounded text), for checking that a number an
    answer states was measured: a run's config, scale, summary and curve stats; a failure's
    fields; an ablation's variants and effect; a note's text."""
    wanted: dict[str, list[str]] = {k: [] for k in KINDS}
    for key in keys:
        kind, _, ref = key.partition(":")
        if kind in wanted and ref:
            wanted[kind].append(ref)
    out: dict[str, list] = {}
    with Session(engine) as s:
        if wanted["run"]:
            q = select(Run.id, Run.config, Run.scale, Run.summary, Run.stats, Run.lr, Run.params, Run.tokens)
            for row in s.execute(q.where(Run.id.in_(wanted["run"]))):
                out[f"run:{row[0]}"] = list(row[1:])
        if wanted["ablation"]:
            for a in s.execute(select(Ablation).where(Ablation.id.in_(wanted["ablation"]))).scalars():
                out[f"ablation:{a.id}"] = [a.variants, a.effect]
        ids = [int(i) for i in wanted["failure"] if i.isdigit()]
        if ids:
            for f in s.execute(select(Failure).where(Failure.id.in_(ids))).scalars():
                out[f"failure:{f.id}"] = [f.step, f.message, f.evidence]
        if wanted["note"]:
            for n in s.execute(select(Note).where(Note.id.in_(wanted["note"]))).scalars():
                out[f"note:{n.id}"] = [n.title, n.text]
    return out
