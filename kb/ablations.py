"""Ablations found in the runs themselves: within a project, runs whose configs differ in exactly
one key (seeds aside), or that share an `ablation:<factor>` tag, form an Ablation with a factor,
a baseline, variants and their effect on the final metric.

Runs that differ only in their seed are one configuration measured several times: their
spread is the noise floor, and each effect says whether it clears it (|delta| > 2 sigma,
sigma the pooled seed standard deviation).
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import defaultdict
from functools import lru_cache
from json.encoder import encode_basestring_ascii

from sqlalchemy import and_, delete, insert, select
from sqlmodel import Session

from kb.fields import FIELD_COLUMNS, canonical, field_tuples, leaves
from kb.models import Ablation, Run, RunField, utcnow
from kb.query_sql import codepoint

SEED_KEYS = {"seed", "data_seed", "random_seed", "init_seed", "shuffle_seed"}
METRICS = ("val/loss", "val_loss", "eval/loss", "eval_loss", "valid/loss", "loss", "train/loss", "train_loss")
MISSING = "<missing>"


def _signature(config: dict) -> dict[str, str]:
    """Config leaves (seeds left out) as canonical key -> JSON text, so values compare exactly."""
    return {_canonical(p): _json_text(v) for p, v in leaves(config)
            if p and p[-1] not in SEED_KEYS and not isinstance(v, (dict, list))}


_canonical = lru_cache(maxsize=16384)(canonical)    # the same few dozen paths in every run


def _json_text(v) -> str:
    """json.dumps(v) for a JSON leaf, without the encoder's set-up (a project has ~20 per run)."""
    if v is None or v is True or v is False:
        return "null" if v is None else "true" if v else "false"
    if type(v) is str:
        return encode_basestring_ascii(v)
    if type(v) is int or (type(v) is float and math.isfinite(v)):
        return repr(v)
    return json.dumps(v, sort_keys=True)


def _metric(runs: list[Run]) -> str | None:
    """The first of METRICS that any run reports (a diverged variant has no final, and says so)."""
    for m in METRICS:
        if any(isinstance(r.summary.get(m), (int, float)) for r in runs):
            return m
    return None


class _Group:
    """Runs with one configuration: several seeds of it, or one."""

    def __init__(self, sig: dict[str, str], runs: list[Run]):
        self.sig, self.runs = sig, sorted(runs, key=lambda r: r.id)

    def values(self, metric: str) -> list[float]:
        return [float(r.summary[metric]) for r in self.runs if isinstance(r.summary.get(metric), (int, float))]

    def mean(self, metric: str) -> float | None:
        v = self.values(metric)
        return statistics.fmean(v) if v else None


def _baseline(groups: list[_Group]) -> _Group:
    members = {r.id for g in groups for r in g.runs}

    def rank(g: _Group):
        tagged = any("baseline" in r.tags for r in g.runs)
        is_parent = any(r.parent in {x.id for x in g.runs} for o in groups for r in o.runs if r.parent in members)
        first = min((r.started_at.isoformat() if r.started_at else "", r.id) for r in g.runs)
        return (not tagged, not is_parent, first)
    return min(groups, key=rank)


def _pooled_sigma(groups: list[_Group], metric: str) -> float | None:
    ss, dof = 0.0, 0
    for g in groups:
        v = g.values(metric)
        if len(v) >= 2:
            ss += statistics.variance(v) * (len(v) - 1)
            dof += len(v) - 1
    return (ss / dof) ** 0.5 if dof else None


def _build(project: str, factor: str, groups: list[_Group], key: str | None) -> dict:
    """One Ablation row as a dict of its columns (constructing the ORM object cost more than
    finding the ablation)."""
    runs = [r for g in groups for r in g.runs]
    metric = _metric(runs)
    base = _baseline(groups)
    sigma = _pooled_sigma(groups, metric) if metric else None
    base_mean = base.mean(metric) if metric else None
    variants = []
    for g in groups:
        value = json.loads(g.sig[key]) if key and key in g.sig else (MISSING if key else None)
        if key is None:     # tag ablation: the value is whatever differs from the baseline
            value = {k: json.loads(v) for k, v in g.sig.items() if base.sig.get(k) != v} or "baseline"
        mean = g.mean(metric) if metric else None
        delta = (mean - base_mean) if mean is not None and base_mean is not None else None
        variants.append({"runs": [r.id for r in g.runs], "run": g.runs[0].id, "value": value,
                         "metric": mean, "seeds": len(g.runs), "delta": delta,
                         "exceeds_seed_spread": (abs(delta) > 2 * sigma) if delta is not None and sigma else None,
                         "baseline": g is base})
    variants.sort(key=lambda v: (not v["baseline"], json.dumps(v["value"], sort_keys=True, default=str)))
    members = sorted(r.id for r in runs)
    digest = hashlib.sha1(json.dumps([factor, members]).encode()).hexdigest()[:10]
    return dict(id=f"abl-{factor}-{digest}", project=project, factor=factor, metric=metric or "",
                baseline_run=base.runs[0].id, variants=variants,
                effect={"seed_sigma": sigma, "baseline_metric": base_mean,
                        "best": min((v for v in variants if v["metric"] is not None),
                                    key=lambda v: v["metric"], default={}).get("run")},
                source_kind="derived", source_uri=f"project:{project}", content_hash=digest,
                ingested_at=utcnow())


def find_ablations(project: str, runs: list[Run]) -> list[dict]:
    """The project's ablations as Ablation rows (dicts of its columns), in a stable order."""
    # a signature's items, sorted, stand for it: equal tuples are equal signatures, and a tuple
    # with one key left out is hashed directly (no text built per key and group)
    by_config: dict[tuple, list[Run]] = defaultdict(list)
    sigs: dict[tuple, dict] = {}
    sig_of: dict[str, tuple] = {}
    for r in runs:
        sig = _signature(r.config)
        k = tuple(sorted(sig.items()))
        by_config[k].append(r)
        sigs[k] = sig
        sig_of[r.id] = k
    groups = [_Group(sigs[k], rs) for k, rs in by_config.items()]
    items = list(by_config)                      # groups[i]'s sorted items
    position = [{key: i for i, (key, _) in enumerate(its)} for its in items]
    found = []
    keys = sorted({k for g in groups for k in g.sig})
    for key in keys:
        # groups equal in everything but `key` (holding it or not) share a bucket
        buckets: dict[tuple, list[_Group]] = defaultdict(list)
        for g, its, pos in zip(groups, items, position):
            i = pos.get(key)
            buckets[its if i is None else its[:i] + its[i + 1:]].append(g)
        for members in buckets.values():
            if len(members) >= 2 and any(key in g.sig for g in members):
                found.append(_build(project, f"config.{key}", members, key))
    tagged: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        for t in r.tags:
            if t.startswith("ablation:") and len(t) > len("ablation:"):
                tagged[t.split(":", 1)[1]].append(r)
    covered = {(a["factor"].rsplit(".", 1)[-1], tuple(sorted(x for v in a["variants"] for x in v["runs"])))
               for a in found}
    for factor, rs in sorted(tagged.items()):
        distinct = list(dict.fromkeys(sig_of[r.id] for r in rs))      # first-seen order
        sub = [_Group(sigs[k], [r for r in rs if sig_of[r.id] == k]) for k in distinct]
        if len(sub) >= 2 and (factor, tuple(sorted(r.id for r in rs))) not in covered:
            found.append(_build(project, factor, sub, None))
    return found


def refresh(session: Session, project: str) -> list[dict]:
    """Recompute a project's ablations and the `ablations.*` fields its runs are queried by."""
    # only the columns the search reads, as plain rows: loading whole ORM runs (cards, stats)
    # cost more than finding the ablations
    t = Run.__table__
    runs = session.execute(select(t.c.id, t.c.config, t.c.summary, t.c.tags, t.c.parent, t.c.started_at)
                           .where(t.c.project == project)).all()
    found = find_ablations(project, runs)
    session.execute(delete(Ablation).where(Ablation.project == project))
    ids = [r.id for r in runs]
    # the ablations.* keys by code-point range, which the (key, run_id) primary key serves
    # (LIKE is case-blind on SQLite, so no index can)
    prefix = and_(codepoint(RunField.key) >= "ablations.", codepoint(RunField.key) < "ablations/")
    for chunk in (ids[i:i + 500] for i in range(0, len(ids), 500)):
        session.execute(delete(RunField).where(RunField.run_id.in_(chunk), prefix))
    if found:
        session.execute(insert(Ablation.__table__), found)
    per_run: dict[str, dict] = defaultdict(dict)
    for a in found:
        factor = a["factor"]
        name = factor.rsplit(".", 1)[-1] if factor.startswith("config.") else factor
        for v in a["variants"]:
            for rid in v["runs"]:
                per_run[rid][name] = {"role": "baseline" if v["baseline"] else "variant", "id": a["id"],
                                      "delta": v["delta"], "exceeds_seed_spread": v["exceeds_seed_spread"]}
    rows = [row for rid, abl in per_run.items() for row in field_tuples(rid, {"ablations": abl})]
    if rows:
        # straight to the driver, as the run writer does: four rows per run and ablation, and
        # SQLAlchemy's per-row parameter handling cost more than the inserts
        conn = session.connection()
        mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
        conn.exec_driver_sql(f"INSERT INTO runfield ({', '.join(FIELD_COLUMNS)}) "
                             f"VALUES ({', '.join([mark] * len(FIELD_COLUMNS))})", rows)
    return found
