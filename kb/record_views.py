"""Notes, ablations and failures read back by id, and failures and anomalies listed across runs:
what a citation link opens and what a failures dashboard lists.

    with Session(engine) as s:
        note = read_record(s, "note", "note-1a2b3c")     # {"id", "title", "text", "source", ...}
        rows = list_failures(s, kind="oom")             # each with its run's name and project
        counts = failure_counts(s)                      # {"failures": {"oom": 3}, "anomalies": {...}}

Plain dicts out, ORM rows never: the same shapes go to JSON, the CLI and the UI.
"""
from __future__ import annotations

from sqlalchemy import func, select
from sqlmodel import Session

from kb.errors import NotFound
from kb.models import Ablation, Anomaly, Failure, Note, Run

RECORD_KINDS = ("note", "ablation", "failure")


def read_record(s: Session, kind: str, ref: str) -> dict:
    """One note chunk, ablation or failure by id; NotFound when there is none."""
    if kind == "note":
        row = s.get(Note, ref)
        if row is None:
            raise NotFound(f"no note {ref!r}")
        return {"id": row.id, "project": row.project, "title": row.title, "text": row.text,
                "chunk": row.chunk, "mentions": list(row.mentions or []),
                "source": {"kind": row.source_kind, "uri": row.source_uri}}
    if kind == "ablation":
        row = s.get(Ablation, ref)
        if row is None:
            raise NotFound(f"no ablation {ref!r}")
        return {"id": row.id, "project": row.project, "factor": row.factor, "metric": row.metric,
                "baseline_run": row.baseline_run, "variants": list(row.variants or []),
                "effect": dict(row.effect or {})}
    if kind == "failure":
        found = list_failures(s, ids=[ref])
        if not found:
            raise NotFound(f"no failure {ref!r}")
        return found[0]
    raise NotFound(f"no record kind {kind!r}; one of {', '.join(RECORD_KINDS)}")


def list_failures(s: Session, kind: str | None = None, project: str | None = None, limit: int | None = None,
                  ids: list[str] | None = None) -> list[dict]:
    """Failures, newest run first, each with its run's name, project and status."""
    q = (select(Failure, Run.name, Run.project, Run.status).join(Run, Run.id == Failure.run_id)
         .order_by(Run.ingested_at.desc(), Failure.id))
    if ids is not None:
        numeric = [int(i) for i in ids if str(i).isdigit()]
        if not numeric:
            return []
        q = q.where(Failure.id.in_(numeric))
    q = _scoped(q, Failure.kind, kind, project)
    return [{"id": str(f.id), "run_id": f.run_id, "run_name": name or f.run_id, "project": proj,
             "run_status": status, "kind": f.kind, "step": f.step, "message": f.message,
             "evidence": f.evidence, "origin": f.origin}
            for f, name, proj, status in s.execute(q.limit(limit) if limit else q)]


def list_anomalies(s: Session, kind: str | None = None, project: str | None = None,
                   limit: int | None = None) -> list[dict]:
    """Anomalies found on curves (loss spikes, plateaus, divergence), newest run first."""
    q = (select(Anomaly, Run.name, Run.project).join(Run, Run.id == Anomaly.run_id)
         .order_by(Run.ingested_at.desc(), Anomaly.id))
    q = _scoped(q, Anomaly.kind, kind, project)
    return [{"id": str(a.id), "run_id": a.run_id, "run_name": name or a.run_id, "project": proj,
             "kind": a.kind, "key": a.key, "step": a.step, "value": a.value, "score": a.score,
             "evidence": a.evidence}
            for a, name, proj in s.execute(q.limit(limit) if limit else q)]


def failure_counts(s: Session, project: str | None = None) -> dict[str, dict[str, int]]:
    """{"failures": {kind: n}, "anomalies": {kind: n}}, most frequent kind first."""
    out = {}
    for name, table in (("failures", Failure), ("anomalies", Anomaly)):
        q = select(table.kind, func.count()).group_by(table.kind)
        if project:
            q = q.join(Run, Run.id == table.run_id).where(Run.project == project)
        out[name] = dict(sorted(s.execute(q).all(), key=lambda kv: (-kv[1], kv[0])))
    return out


def _scoped(q, kind_column, kind: str | None, project: str | None):
    if kind:
        q = q.where(kind_column == kind)
    if project:
        q = q.where(Run.project == project)
    return q
