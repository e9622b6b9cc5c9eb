"""Hypotheses in the store: what a change to a baseline run resolves to, whether that configuration
is already held, and the human gate (approve / reject, with who and why).

A hypothesis's `change` maps dotted keys of its baseline's config (`optim.lr`, spelled as
queries spell paths) to new values; the resolved config is the baseline's with the change
applied. Two configs are the same configuration when they agree on every leaf but the seeds
(kb.ablations' signature), so `config_key` names a configuration within a project, and
`held_by` finds the runs and hypotheses that already hold one: nothing is proposed twice.

    kb hypotheses --status proposed
    kb approve hyp-1a2b3c4d5e --by alice --reason "cheap, and the ablation was clear"
"""
from __future__ import annotations

import copy
import hashlib
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from kb.ablations import parts_of, signed
from kb.errors import InvalidRecord, NotFound
from kb.models import AblationSig, Hypothesis, Run, utcnow

DECISIONS = ("approved", "rejected")
DECIDABLE = ("proposed", *DECISIONS)       # once the runner has it, the decision stands


# ---- changes and configurations -----------------------------------------------------------------

def split_key(key: str) -> tuple[str, ...]:
    """A change key as its path: `optim.lr` -> ("optim", "lr"); `data."my src"` quotes a segment."""
    from kb.errors import QueryError
    from kb.query import tokenize
    try:
        tokens = tokenize(key)
    except QueryError as exc:
        raise InvalidRecord(f"{key!r} is not a dotted key: {str(exc).splitlines()[0]}", field="change") from None
    if len(tokens) != 2 or tokens[0].kind not in ("key", "kw"):
        raise InvalidRecord(f"{key!r} is not a dotted key (like optim.lr)", field="change")
    value = tokens[0].value
    return value if isinstance(value, tuple) else (value,)


def apply_change(config: dict, change: dict) -> dict:
    """The baseline's config with the change applied (a copy; missing parents are created)."""
    out = copy.deepcopy(config)
    for key, value in change.items():
        path = split_key(key)
        node = out
        for seg in path[:-1]:
            if not isinstance(node.get(seg), dict):
                node[seg] = {}
            node = node[seg]
        node[path[-1]] = copy.deepcopy(value)
    return out


def config_key(project: str, config: dict) -> str:
    """The configuration's name within a project, seeds aside: the bucket kb.ablations gives a run's
    whole config (so runs are looked up by it in AblationSig), as hex."""
    return f"{parts_of(project, config)[2]:016x}"


def held_by(engine: Engine, project: str, config: dict) -> list[str]:
    """Ids of the runs and hypotheses that already hold this configuration in this project."""
    sig, _, total = parts_of(project, config)
    key = f"{total:016x}"
    with Session(engine) as s:
        candidates = s.execute(select(AblationSig.run_id).where(AblationSig.bucket == signed(total),
                                                                AblationSig.slot == 0)).scalars().all()
        runs = s.execute(select(Run.id, Run.project, Run.config).where(Run.id.in_(candidates))).all() \
            if candidates else []
        hyps = s.execute(select(Hypothesis.id).where(Hypothesis.config_hash == key)).scalars().all()
    # a sum of hashes can collide: the configs themselves confirm it
    same = [rid for rid, proj, cfg in runs if proj == project and parts_of(project, cfg)[0] == sig]
    return sorted(same) + sorted(hyps)


def hypothesis_id(project: str, key: str) -> str:
    return "hyp-" + hashlib.sha1(f"{project}\x00{key}".encode()).hexdigest()[:10]


# ---- the store ----------------------------------------------------------------------------------

def as_dict(row: Hypothesis) -> dict:
    """The contract's Hypothesis, plus where it came from, its plan and the decision taken on it."""
    decision = None
    if row.decided_by or row.decided_at:
        decision = {"by": row.decided_by, "at": _iso(row.decided_at), "reason": row.decision_reason or ""}
    return {"id": row.id, "title": row.title, "rationale": row.rationale, "baseline_run": row.baseline_run,
            "change": row.change, "evidence": row.evidence, "predicted": row.predicted, "risks": row.risks,
            "status": row.status, "result": row.result,
            "project": row.project, "source": row.source, "goal": row.goal or "", "plan": row.plan or {},
            "created_at": _iso(row.created_at), "decision": decision}


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def store(engine: Engine, hypotheses: list[dict]) -> list[dict]:
    """Write new hypotheses (dicts of Hypothesis columns) in one transaction; returns them as stored."""
    rows = [Hypothesis(**h) for h in hypotheses]
    with Session(engine, expire_on_commit=False) as s, s.begin():
        s.add_all(rows)
    return [as_dict(r) for r in rows]


def get(engine: Engine, ref: str) -> dict:
    with Session(engine) as s:
        row = s.get(Hypothesis, ref)
        if row is None:
            raise NotFound(f"no hypothesis {ref!r} (kb hypotheses lists them)")
        return as_dict(row)


def listed(engine: Engine, status: str | None = None, project: str | None = None) -> list[dict]:
    """Hypotheses, newest first, optionally of one status and project."""
    stmt = select(Hypothesis).order_by(Hypothesis.created_at.desc(), Hypothesis.id)
    if status:
        stmt = stmt.where(Hypothesis.status == status)
    if project:
        stmt = stmt.where(Hypothesis.project == project)
    with Session(engine) as s:
        return [as_dict(r) for r in s.execute(stmt).scalars()]


def decide(engine: Engine, ref: str, status: str, by: str, reason: str = "") -> dict:
    """Record the human decision on a hypothesis: approved or rejected, by whom, when and why.

    A proposed hypothesis may be approved or rejected, and a decision changed until the runner
    takes the hypothesis up; deciding what is already decided that way is refused."""
    if status not in DECISIONS:
        raise InvalidRecord(f"decision {status!r}: expected one of {list(DECISIONS)}", field="status")
    if not by or not by.strip():
        raise InvalidRecord("who decides is empty: pass --by NAME (default: $USER)", field="by")
    with Session(engine, expire_on_commit=False) as s, s.begin():
        row = s.get(Hypothesis, ref, with_for_update=True)
        if row is None:
            raise NotFound(f"no hypothesis {ref!r} (kb hypotheses lists them)")
        if row.status == status:
            raise InvalidRecord(f"hypothesis {ref} is already {status} (by {row.decided_by or 'someone'})",
                                field="status")
        if row.status not in DECIDABLE:
            raise InvalidRecord(f"hypothesis {ref} is {row.status}: only a hypothesis that is "
                                f"{', '.join(DECIDABLE)} can be {status}", field="status")
        row.status, row.decided_by, row.decided_at, row.decision_reason = status, by.strip(), utcnow(), reason
    return as_dict(row)
