"""The citable chunks, read from SQL: run cards, note chunks, ablations and failures, each as the
same text the vector index embeds, with what retrieval filters on.

SQL is the source of truth, so the keyword index and the answer's context are built from here,
never from the vector index's payloads.
"""
from __future__ import annotations

from typing import Iterable, Iterator

from sqlalchemy import String, cast, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from kb.models import Ablation, Failure, Note, Run
from kb.record_texts import RecordText, ablation_texts, failure_texts, note_texts, run_texts

READERS = {"run": run_texts, "note": note_texts, "ablation": ablation_texts, "failure": failure_texts}
KINDS = tuple(READERS)


# a citable chunk is a record's indexed text (kb.record_texts), the same words the vectors embed
Chunk = RecordText


def all_chunks(engine: Engine) -> Iterator[Chunk]:
    with Session(engine) as s:
        for reader in READERS.values():
            yield from reader(s, None)


def chunk_stamps(engine: Engine) -> dict[str, str]:
    """Every chunk's key -> when what its text is made of was last written, read without the texts
    (ids and times: 0.5 s at 100,000 runs, where reading the chunks takes 6.7 s). Every write of a
    run, note or ablation sets its `ingested_at`; a failure's text is made of its run's row, so it
    carries its run's time; an ablation's text names its runs, and a run's write queues the
    refresh that writes its ablations again (kb.ablation_store). Stamps are compared for equality,
    never ordered, so writers' clocks need not agree."""
    stamp = {Run: cast(Run.ingested_at, String), Note: cast(Note.ingested_at, String),
             Ablation: cast(Ablation.ingested_at, String)}
    out: dict[str, str] = {}
    with Session(engine) as s:
        for kind, model in (("run", Run), ("note", Note), ("ablation", Ablation)):
            out.update((f"{kind}:{i}", t) for i, t in s.execute(select(model.id, stamp[model])))
        q = select(Failure.id, stamp[Run]).join(Run, Run.id == Failure.run_id)
        out.update((f"failure:{i}", t) for i, t in s.execute(q))
    return out


def chunks_by_key(engine: Engine, keys: Iterable[str]) -> dict[str, Chunk]:
    """The chunks named `kind:id`, those that still exist."""
    wanted: dict[str, list[str]] = {k: [] for k in KINDS}
    for key in keys:
        kind, _, ref = key.partition(":")
        if kind in wanted and ref:
            wanted[kind].append(ref)
    out: dict[str, Chunk] = {}
    with Session(engine) as s:
        for kind, reader in READERS.items():
            if wanted[kind]:
                out.update((c.key, c) for c in reader(s, wanted[kind]))
    return out


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
