"""The text of each indexed record, read from SQL: what the vector index embeds and what the
agent's keyword index and citations read (agents.corpus), so both see the same words.

Runs carry their card (kb.cards.run_card, written with the run); notes are their title and text;
ablations and failures are written out here from their rows (kb.cards), a failure with its run's
name and hyperparameters so that "the 350M run at lr 3e-3 that diverged" finds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from sqlalchemy import select
from sqlmodel import Session

from kb.cards import ablation_card, failure_card
from kb.db import chunked
from kb.models import Ablation, Failure, Note, Run


@dataclass(frozen=True)
class RecordText:
    kind: str                  # run | note | ablation | failure
    id: str                    # the record's id (a failure's integer id as text)
    text: str
    project: str
    label: str = ""            # a name to show
    status: str | None = None  # a run's status, and a failure's run's
    run_id: str | None = None  # a failure's run; an ablation's baseline run; a run's own id

    @property
    def key(self) -> str:
        """`kind:id`: the vector point's id, the keyword index's key, a citation's reference."""
        return f"{self.kind}:{self.id}"


def note_text(row: Note) -> str:
    return f"{row.title}\n{row.text}" if row.title else row.text


def _where_in(s: Session, query, column, ids: Iterable | None):
    """The query's rows, for every id when `ids` is None, else for those ids, IN list by IN list."""
    if ids is None:
        yield from s.execute(query)
        return
    for chunk in chunked(ids):
        yield from s.execute(query.where(column.in_(chunk)))


def run_texts(s: Session, ids: Iterable[str] | None = None) -> Iterator[RecordText]:
    q = select(Run.id, Run.card, Run.project, Run.status, Run.name)
    for rid, card, project, status, name in _where_in(s, q, Run.id, ids):
        yield RecordText("run", rid, card, project, name or rid, status, rid)


def note_texts(s: Session, ids: Iterable[str] | None = None) -> Iterator[RecordText]:
    for (row,) in _where_in(s, select(Note), Note.id, ids):
        yield RecordText("note", row.id, note_text(row), row.project, row.title or row.id)


def ablation_texts(s: Session, ids: Iterable[str] | None = None) -> Iterator[RecordText]:
    # columns, not ORM objects: building 100,000 of them was a quarter of a keyword-index rebuild
    q = select(Ablation.id, Ablation.project, Ablation.factor, Ablation.metric, Ablation.variants, Ablation.effect,
               Ablation.baseline_run)
    rows = list(_where_in(s, q, Ablation.id, ids))
    run_ids = {v.get("run") for a in rows for v in (a.variants or []) if v.get("run")}
    # every ablation: every run's name in one scan, not their ids IN list by IN list
    labels = {rid: name for rid, name in _where_in(s, select(Run.id, Run.name), Run.id,
                                                   None if ids is None else run_ids) if name}
    for a in rows:
        text = ablation_card({"id": a.id, "project": a.project, "factor": a.factor, "metric": a.metric,
                              "variants": a.variants, "effect": a.effect}, labels)
        yield RecordText("ablation", a.id, text, a.project, a.factor, None, a.baseline_run)


def failure_texts(s: Session, ids: Iterable[str] | None = None, *,
                  run_ids: Iterable[str] | None = None) -> Iterator[RecordText]:
    """Failures by id, or every failure of `run_ids`, or (neither) all of them."""
    q = select(Failure, Run.name, Run.project, Run.status, Run.config).join(Run, Run.id == Failure.run_id)
    if ids is not None:
        rows = _where_in(s, q, Failure.id, [int(i) for i in ids if str(i).isdigit()])
    else:
        rows = _where_in(s, q, Failure.run_id, run_ids)
    for f, name, project, status, config in rows:
        text = failure_card({"kind": f.kind, "step": f.step, "message": f.message, "evidence": f.evidence},
                            {"id": f.run_id, "name": name, "project": project, "config": config})
        yield RecordText("failure", str(f.id), text, project, f"{f.kind} in {name or f.run_id}", status, f.run_id)
