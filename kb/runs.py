"""Runs in the store: write one validated record (one transaction), read public views back.

The write derives everything a record leaves out: summary from curves, curve stats,
anomalies and failures, scale from config, the promoted filter columns and the card.
ORM rows never leave this module: callers get `RunView` / `RunDetail`.
"""
from __future__ import annotations

import hashlib
import math
import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import delete, select
from sqlmodel import Session

from kb import curves
from kb.cards import run_card
from kb.fields import field_rows
from kb.indexer import queue_index
from kb.models import Ablation, Anomaly, Failure, MetricPoint, Run, RunField, utcnow
from kb.records import RunRecord, content_hash

Outcome = Literal["added", "updated", "unchanged"]

# first match wins, searched breadth-first through config so `optim.lr` beats `scheduler.warmup.lr`
LR_KEYS = ("lr", "learning_rate", "max_lr", "peak_lr", "base_lr", "opt_base_learning_rate")
BATCH_KEYS = ("global_batch_size", "batch_size", "global_batch", "train_batch_size", "total_batch_size")
SEQ_KEYS = ("block_size", "seq_len", "sequence_length", "max_seq_len", "context_length")
LAYER_KEYS = ("n_layer", "num_layers", "n_layers", "num_hidden_layers", "depth")
WIDTH_KEYS = ("d_model", "n_embd", "hidden_size", "dim", "model_dim")
VOCAB_KEYS = ("vocab_size", "n_vocab", "padded_vocab_size")


def find_number(config: dict, names: tuple[str, ...]) -> float | int | None:
    frontier = [config]
    while frontier:
        nxt = []
        for node in frontier:
            for name in names:
                v = node.get(name)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return v
            nxt.extend(v for v in node.values() if isinstance(v, dict))
        frontier = nxt
    return None


def derive_scale(record: RunRecord, stats: dict) -> dict:
    """Scale as given, filled in from config where it can be computed (and only then)."""
    scale = record.scale.model_dump(exclude_none=True)
    cfg = record.config
    if "params" not in scale:
        layers, width = find_number(cfg, LAYER_KEYS), find_number(cfg, WIDTH_KEYS)
        if layers and width:
            vocab = find_number(cfg, VOCAB_KEYS) or 0
            # 12·L·d² for attention + MLP blocks, plus the (tied) embedding
            scale["params"] = int(12 * layers * width**2 + vocab * width)
    if "tokens" not in scale:
        batch, seq = find_number(cfg, BATCH_KEYS), find_number(cfg, SEQ_KEYS)
        last = max((s["last_step"] for s in stats.values()), default=None)
        if batch and seq and last:
            scale["tokens"] = int(batch * seq * last)
    if "flops" not in scale and scale.get("params") and scale.get("tokens"):
        scale["flops"] = 6.0 * scale["params"] * scale["tokens"]      # the usual 6·N·D
    return scale


def run_id_for(record: RunRecord, source_kind: str, source_uri: str, digest: str) -> str:
    """An explicit id wins; else a slug of the name plus a hash of what identifies the run."""
    if record.id:
        return record.id
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", record.name or "run").strip("-")[:48] or "run"
    if source_kind != "native":           # one run per source URI (a folder, an MLflow run)
        basis = f"{source_kind}|{source_uri}"
    elif record.name:
        basis = f"{record.project}|{record.name}|{record.started_at}"
    else:
        return f"run-{digest[:12]}"
    return f"{slug}-{hashlib.sha1(basis.encode()).hexdigest()[:8]}"


def write_run(session: Session, record: RunRecord, source_kind: str, source_uri: str) -> tuple[Outcome, str]:
    """Store one run in the caller's transaction; same content twice is a no-op."""
    digest = content_hash(record, source_kind)
    run_id = run_id_for(record, source_kind, source_uri, digest)
    existing = session.get(Run, run_id)
    if existing is not None and existing.content_hash == digest:
        return "unchanged", run_id
    if existing is not None:
        for table in (RunField, MetricPoint, Failure, Anomaly):
            session.execute(delete(table).where(table.run_id == run_id))
        session.execute(delete(Ablation).where(Ablation.baseline_run == run_id))

    metrics = {k: [tuple(p) for p in pts] for k, pts in record.metrics.items()}
    stats = curves.curve_stats(metrics)
    findings = curves.find_anomalies(metrics)
    failures = _failures(record, metrics)
    status = record.status
    if "status" not in record.model_fields_set and any(f["kind"] == "diverged" for f in failures):
        status = "diverged"
    summary = {k: s["final"] for k, s in stats.items()} | _finite_summary(record.summary)
    scale = derive_scale(record, stats)
    anomalies = [vars(f) for f in findings]
    fields = dict(
        project=record.project, name=record.name or run_id, status=status, config=record.config,
        scale=scale, summary=summary, stats=stats, tags=record.tags, notes=record.notes,
        parent=record.parent, hypothesis_id=record.hypothesis, started_at=record.started_at,
        ended_at=record.ended_at, code=record.code.model_dump(exclude_none=True) if record.code else {},
        meta=record.meta, lr=find_number(record.config, LR_KEYS),
        batch_size=_int(find_number(record.config, BATCH_KEYS)), params=scale.get("params"),
        tokens=scale.get("tokens"), flops=scale.get("flops"),
        source_kind=source_kind, source_uri=source_uri, content_hash=digest, ingested_at=utcnow(),
    )
    fields["card"] = run_card({"id": run_id, **fields}, failures, anomalies)
    if existing is None:
        session.add(Run(id=run_id, **fields))
    else:
        for k, v in fields.items():
            setattr(existing, k, v)
    session.flush()

    namespaces = {"config": record.config, "summary": summary, "scale": scale, "stats": stats,
                  "anomalies": curves.anomaly_summary(findings),
                  "failure": {k: failures[0].get(k) for k in ("kind", "step")} if failures else {},
                  "tags": {t: True for t in record.tags}}
    _bulk(session, RunField, field_rows(run_id, namespaces))
    _bulk(session, MetricPoint, [
        (run_id, key, i, p[0], None if p[1] != p[1] else p[1], p[2] if len(p) > 2 else None)   # NaN -> NULL
        for key, pts in metrics.items() for i, p in enumerate(pts)],
        columns=("run_id", "key", "seq", "step", "value", "wall_time"))
    _bulk(session, Failure, [{"run_id": run_id, **f} for f in failures])
    _bulk(session, Anomaly, [{"run_id": run_id, **a} for a in anomalies])
    queue_index(session, "run", run_id)
    return ("added" if existing is None else "updated"), run_id


def _failures(record: RunRecord, metrics: dict) -> list[dict]:
    out = []
    if record.failure:
        f = record.failure
        evidence = "\n".join(f.evidence) if isinstance(f.evidence, list) else f.evidence
        out.append({"kind": f.kind, "step": f.step, "message": f.message, "evidence": evidence,
                    "origin": "reported"})
    if not any(f["kind"] == "diverged" for f in out):
        found = curves.failure_from_curves(metrics)
        if found:
            out.append({"kind": found["kind"], "step": found.get("step"), "message": found.get("message", ""),
                        "evidence": found.get("evidence", ""), "origin": "curve"})
    return out


def _bulk(session: Session, model, rows: list, columns: tuple[str, ...] | None = None) -> None:
    """executemany straight on the driver: curves are most of a run's rows, and SQLAlchemy's
    per-row parameter processing cost more than SQLite's own insert."""
    if not rows:
        return
    cols = columns or list(rows[0])
    if columns is None:
        rows = [tuple(r[c] for c in cols) for r in rows]
    conn = session.connection()
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    sql = f"INSERT INTO {model.__tablename__} ({', '.join(cols)}) VALUES ({', '.join([mark] * len(cols))})"
    conn.exec_driver_sql(sql, rows)


def _int(v):
    return int(v) if v is not None else None


def _finite_summary(summary: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


# ---- reading ----------------------------------------------------------------------------


class RunView(BaseModel):
    id: str
    project: str
    name: str
    status: str
    config: dict
    scale: dict
    summary: dict
    tags: list[str]
    notes: str = ""
    parent: str | None = None
    hypothesis: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    code: dict = {}
    stats: dict = {}
    meta: dict = {}
    source: dict = {}

    @classmethod
    def of(cls, row: Run) -> "RunView":
        return cls(id=row.id, project=row.project, name=row.name, status=row.status, config=row.config,
                   scale=row.scale, summary=row.summary, tags=row.tags, notes=row.notes, parent=row.parent,
                   hypothesis=row.hypothesis_id, started_at=row.started_at, ended_at=row.ended_at,
                   code=row.code, stats=row.stats, meta=row.meta,
                   source={"kind": row.source_kind, "uri": row.source_uri,
                           "ingested_at": row.ingested_at.isoformat(), "content_hash": row.content_hash})

    def as_dict(self) -> dict:
        return self.model_dump(mode="json")


class RunDetail(RunView):
    metrics: dict[str, list[list[Any]]] = {}
    failures: list[dict] = []
    anomalies: list[dict] = []
    ablations: list[dict] = []
    card: str = ""


def read_detail(session: Session, row: Run) -> RunDetail:
    view = RunView.of(row).model_dump()
    metrics: dict[str, list[list[Any]]] = {}
    pts = session.execute(select(MetricPoint.key, MetricPoint.step, MetricPoint.value, MetricPoint.wall_time)
                          .where(MetricPoint.run_id == row.id).order_by(MetricPoint.key, MetricPoint.seq))
    for key, step, value, wall in pts:
        point = [step, float("nan") if value is None else value]
        if wall is not None:
            point.append(wall)
        metrics.setdefault(key, []).append(point)
    failures = [{"id": str(f.id), "kind": f.kind, "step": f.step, "message": f.message,
                 "evidence": f.evidence, "origin": f.origin}
                for f in session.execute(select(Failure).where(Failure.run_id == row.id).order_by(Failure.id)).scalars()]
    anomalies = [{"kind": a.kind, "key": a.key, "step": a.step, "value": a.value, "score": a.score,
                  "evidence": a.evidence}
                 for a in session.execute(select(Anomaly).where(Anomaly.run_id == row.id).order_by(Anomaly.id)).scalars()]
    ablations = [{"id": a.id, "factor": a.factor, "metric": a.metric, "baseline_run": a.baseline_run,
                  "variants": a.variants, "effect": a.effect}
                 for a in _ablations_of(session, row)]
    return RunDetail(**view, metrics=metrics, failures=failures, anomalies=anomalies,
                     ablations=ablations, card=row.card)


def _ablations_of(session: Session, row: Run) -> list[Ablation]:
    rows = session.execute(select(Ablation).where(Ablation.project == row.project)).scalars()
    return [a for a in rows if any(row.id in v["runs"] for v in a.variants)]
