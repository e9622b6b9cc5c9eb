"""Runs in the store: write one validated record (one transaction), read public views back.

The write derives everything a record leaves out: summary from curves, curve stats,
anomalies and failures, scale from config, the promoted filter columns and the card.
ORM rows never leave this module: callers get `RunPublic` (kb.models) / `RunDetail`.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict
from sqlalchemy import Connection, bindparam, delete, not_, select
from sqlmodel import Session

from kb import curves, series, vocab
from kb.ablation_store import ABLATION_FIELDS, queue_runs
from kb.cards import run_card
from kb.db import bulk_insert, insert_dicts
from kb.fields import FIELD_COLUMNS, field_tuples
from kb.indexer import queue_refs
from kb.models import (Ablation, Anomaly, Failure, MetricSeries, Run, RunField, RunPublic,
                       utcnow)
from kb.records import INT64, RunRecord, content_hash, json_safe

Outcome = Literal["added", "updated", "unchanged"]
_RUNS = Run.__table__
_STORED_HASHES = select(_RUNS.c.id, _RUNS.c.content_hash).where(_RUNS.c.id.in_(bindparam("ids", expanding=True)))

MAX_TOKENS_PER_STEP = 2**27     # past any real global batch: a batch that big is counted in tokens


def derive_scale(record: RunRecord, stats: dict, hp: dict) -> dict:
    """Scale as given, filled in from config where it can be computed (and only then: a count
    past 64 bits, or compute past a float, is no scale a run had, so it is left out).

    `hp` holds the config's canonical hyperparameters (kb.vocab.canonical_hparams)."""
    scale = record.scale.model_dump(exclude_none=True)
    num = {name: value for name, (_, value) in hp.items()}
    if "params" not in scale:
        layers, width = num.get("n_layer"), num.get("d_model")
        if layers and width:
            # 12·L·d² for attention + MLP blocks, plus the (tied) embedding
            _put(scale, "params", lambda: 12 * layers * width**2 + (num.get("vocab_size") or 0) * width)
    if "tokens" not in scale:
        batch, seq = num.get("batch_size"), num.get("seq_len")
        last = max((s["last_step"] for s in stats.values()), default=None)
        if batch and seq and last:
            # a batch counted in sequences times the sequence length, unless that is more tokens
            # per step than any real run: then the batch was already counted in tokens
            per_step = batch * seq if batch * seq <= MAX_TOKENS_PER_STEP else batch
            _put(scale, "tokens", lambda: per_step * last)
    if "flops" not in scale and scale.get("params") and scale.get("tokens"):
        flops = 6.0 * scale["params"] * scale["tokens"]      # the usual 6·N·D
        if math.isfinite(flops):
            scale["flops"] = flops
    return scale


def _put(scale: dict, name: str, count) -> None:
    """scale[name] = int(count()) where that is a number a BIGINT column holds."""
    try:
        value = count()
    except OverflowError:                # a float squared past its range
        return
    if -INT64 - 1 <= value <= INT64:     # False for NaN and infinities too
        scale[name] = int(value)


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


@dataclass
class PreparedRun:
    """Every row of one run, derived from its record without touching the database."""
    id: str
    digest: str
    row: dict                      # the run table's columns
    fields: list[tuple]            # RunField rows (FIELD_COLUMNS)
    series: list[tuple]            # MetricSeries rows (SERIES_COLUMNS)
    failures: list[dict]
    anomalies: list[dict]


def prepare_run(record: RunRecord, source_kind: str, source_uri: str) -> PreparedRun:
    """The run's id, content hash and rows: summary, curve stats, anomalies, failures, scale,
    the promoted columns, the card. Raises ValueError for what no column can hold."""
    digest = content_hash(record, source_kind)
    run_id = run_id_for(record, source_kind, source_uri, digest)
    cv = curves.Curves(record.metrics)      # each curve converted once: stats, anomalies, failures, writer
    stats = curves.curve_stats(cv)
    findings = curves.find_anomalies(cv)
    failures = _failures(record, cv)
    status = record.status
    if "status" not in record.model_fields_set and any(f["kind"] == "diverged" for f in failures):
        status = "diverged"
    summary = {k: s["final"] for k, s in stats.items()} | json_safe(record.summary)
    hp = vocab.canonical_hparams(record.config)
    scale = derive_scale(record, stats, hp)
    anomalies = [vars(f) for f in findings]
    row = dict(
        id=run_id, project=record.project, name=record.name or run_id, status=status, config=record.config,
        scale=scale, summary=summary, stats=stats, tags=record.tags, notes=record.notes,
        parent=record.parent, hypothesis=record.hypothesis, started_at=record.started_at,
        ended_at=record.ended_at, code=record.code.model_dump(exclude_none=True) if record.code else {},
        meta=record.meta, lr=_hp(hp, "lr"), batch_size=_int(_hp(hp, "batch_size")), params=scale.get("params"),
        tokens=scale.get("tokens"), flops=scale.get("flops"),
        source_kind=source_kind, source_uri=source_uri, content_hash=digest, ingested_at=utcnow(),
    )
    row["card"] = run_card(row, failures, anomalies, hp)
    namespaces = {"config": record.config, "summary": summary, "scale": scale, "stats": stats,
                  "anomalies": curves.anomaly_summary(findings),
                  "failure": {k: failures[0].get(k) for k in ("kind", "step")} if failures else {},
                  "tags": {t: True for t in record.tags}}
    return PreparedRun(run_id, digest, row, field_tuples(run_id, vocab.with_canonical(namespaces, hp)),
                       series_rows(run_id, cv), failures, anomalies)


def write_run(session: Session, record: RunRecord, source_kind: str, source_uri: str) -> tuple[Outcome, str]:
    """Store one run in the caller's transaction; same content twice is a no-op."""
    prepared = prepare_run(record, source_kind, source_uri)
    return write_prepared(session.connection(), [prepared])[0], prepared.id


def write_prepared(conn: Connection, runs: list[PreparedRun]) -> list[Outcome]:
    """Store prepared runs (distinct ids) in the caller's transaction, one statement per table
    for all of them: per run, the statements' own overhead cost more than their rows. A run
    whose content is stored already is left alone; one stored with other content is replaced."""
    stored = dict(conn.execute(_STORED_HASHES, {"ids": [r.id for r in runs]}).all())
    outcomes: list[Outcome] = []
    write, new = [], []
    for r in runs:
        if r.id not in stored:
            outcomes.append("added")
            new.append(r.row)
        elif stored[r.id] == r.digest:
            outcomes.append("unchanged")
            continue
        else:
            outcomes.append("updated")
            _clear(conn, r.id)
            conn.execute(_RUNS.update().where(_RUNS.c.id == r.id), r.row)
        write.append(r)
    if not write:
        return outcomes
    # straight to the driver, not the ORM: a unit-of-work flush per run cost more than its curve inserts
    insert_dicts(conn, _RUNS, new)
    bulk_insert(conn, RunField.__tablename__, FIELD_COLUMNS, [t for r in write for t in r.fields])
    bulk_insert(conn, MetricSeries.__tablename__, SERIES_COLUMNS, [t for r in write for t in r.series])
    insert_dicts(conn, Failure.__table__, [{"run_id": r.id, **f} for r in write for f in r.failures])
    insert_dicts(conn, Anomaly.__table__, [{"run_id": r.id, **a} for r in write for a in r.anomalies])
    queue_refs(conn, "run", [r.id for r in write])
    queue_runs(conn, [r.id for r in write])       # their ablations: kb.ablation_store.refresh, after the commit
    return outcomes


def _clear(conn: Connection, run_id: str) -> None:
    """A stored run's derived rows, before its new content goes in."""
    # its failures get new ids: their old points go (the new ones come with the run's entry)
    queue_refs(conn, "failure", conn.execute(select(Failure.id).where(Failure.run_id == run_id)).scalars().all())
    for table in (MetricSeries, Failure, Anomaly):
        conn.execute(delete(table).where(table.run_id == run_id))
    # its ablations.* fields are the refresh's to rewrite: a writer never locks rows a
    # refresh in another transaction is writing (two such waits made a Postgres deadlock)
    conn.execute(delete(RunField).where(RunField.run_id == run_id, not_(ABLATION_FIELDS)))


SERIES_COLUMNS = ("run_id", "key", "seq") + series.Packed._fields


def series_rows(run_id: str, cv: curves.Curves) -> list[tuple]:
    """MetricSeries rows: one per curve, its points packed (kb.series)."""
    return [(run_id, key, i, *series.pack_table(pts, cv.table(key))) for i, (key, pts) in enumerate(cv.metrics.items())
            if pts]


def _failures(record: RunRecord, metrics: "dict | curves.Curves") -> list[dict]:
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


def _int(v):
    """A promoted integer column's value: None where there is none, or none that fits."""
    return int(v) if v is not None and -INT64 - 1 <= v <= INT64 else None


def _hp(hp: dict, name: str):
    return hp[name][1] if name in hp else None


# ---- reading ----------------------------------------------------------------------------


class RunDetail(RunPublic):
    """One run with everything about it: its curves, failures, anomalies and ablations.

    Curve values are floats here (NaN and ±inf included) or None (no value); in JSON the
    non-finite ones are the strings "NaN", "Infinity" and "-Infinity", as the contract spells them."""
    model_config = ConfigDict(ser_json_inf_nan="strings")
    metrics: dict[str, list[list[Any]]] = {}
    failures: list[dict] = []
    anomalies: list[dict] = []
    ablations: list[dict] = []
    card: str = ""

    def as_dict(self) -> dict:
        data = super().as_dict()
        data["metrics"] = {k: [[json_safe(x) for x in p] for p in pts] for k, pts in self.metrics.items()}
        return data


def read_detail(session: Session, row: Run) -> RunDetail:
    view = RunPublic.of(row).model_dump()
    rows = session.execute(select(MetricSeries.key, MetricSeries.step_bytes, MetricSeries.value_bytes,
                                  MetricSeries.wall_bytes, MetricSeries.flag_bytes)
                           .where(MetricSeries.run_id == row.id).order_by(MetricSeries.seq))
    metrics: dict[str, list[list[Any]]] = {key: series.unpack(*packed) for key, *packed in rows}
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
