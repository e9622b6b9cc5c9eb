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

from kb.cards import ablation_card, failure_card
from kb.indexer import note_text
from kb.models import Ablation, Failure, Note, Run

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


def _runs(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    q = select(Run.id, Run.card, Run.project, Run.status)
    for rid, card, project, status in s.execute(q if ids is None else q.where(Run.id.in_(ids))):
        yield Chunk("run", rid, card, project, status, rid)


def _notes(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    q = select(Note)
    for row in s.execute(q if ids is None else q.where(Note.id.in_(ids))).scalars():
        yield Chunk("note", row.id, note_text(row), row.project)


def _ablations(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    q = select(Ablation)
    rows = list(s.execute(q if ids is None else q.where(Ablation.id.in_(ids))).scalars())
    run_ids = {v.get("run") for a in rows for v in (a.variants or []) if v.get("run")}
    labels = dict(s.execute(select(Run.id, Run.name).where(Run.id.in_(run_ids))).all()) if run_ids else {}
    for a in rows:
        text = ablation_card({"id": a.id, "project": a.project, "factor": a.factor, "metric": a.metric,
                              "variants": a.variants, "effect": a.effect},
                             {k: v for k, v in labels.items() if v})
        yield Chunk("ablation", a.id, text, a.project, None, a.baseline_run)


def _failures(s: Session, ids: list[str] | None) -> Iterator[Chunk]:
    q = select(Failure, Run.id, Run.name, Run.project, Run.status, Run.config).join(Run, Run.id == Failure.run_id)
    if ids is not None:
        numeric = [int(i) for i in ids if i.isdigit()]
        if not numeric:
            return
        q = q.where(Failure.id.in_(numeric))
    for f, rid, name, project, status, config in s.execute(q):
        text = failure_card({"kind": f.kind, "step": f.step, "message": f.message, "evidence": f.evidence},
                            {"id": rid, "name": name, "project": project, "config": config})
        yield Chunk("failure", str(f.id), text, project, status, rid)


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
