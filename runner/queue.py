"""The job queue, in SQL: jobs are claimed under a lease, renewed by heartbeats, and put back in the
queue when a lease runs out (its worker died), to resume from the job's own workdir.

    lease = claim(engine, "host:4242:ab12", backend="local", lease_s=120)   # None: nothing queued
    renew(engine, lease, lease_s=120)            # "ok" | "cancel" (asked to stop) | "lost"
    finish(engine, lease, "succeeded", run_id="run-...")
    retry_or_fail(engine, lease, "exit code 1: ...")    # queued again, or failed after max_attempts

A claim takes one queued job: on PostgreSQL `SELECT ... FOR UPDATE SKIP LOCKED` (two workers
never wait on, nor take, the same row); on SQLite a conditional `UPDATE ... WHERE id = ? AND
status = 'queued'`, whose row count says whether this worker won (SQLite runs one writer at a
time, so exactly one does). The claim writes a token, `<worker>/<attempt>`, into `job.worker`;
every later write about the job (heartbeat, result, retry) is conditional on that token, so a
worker whose lease was taken from it (it stalled, the job went to another) can no longer write.

Times are the workers' clocks (UTC): workers on several hosts need them synchronised (NTP), and
a lease several heartbeats long (the default 120 s against a heartbeat every 30 s) absorbs skew.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import false, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from kb.errors import InvalidRecord, NotFound
from kb.models import Job, utcnow

log = logging.getLogger(__name__)

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")
LEASE_S = 120.0
MAX_ERROR = 2000            # characters of an error kept on a job
_JOB = Job.__table__


@dataclass(frozen=True)
class Lease:
    """A claimed job, as the process running it needs it."""
    job_id: str
    token: str
    attempt: int
    spec: dict
    workdir: Path
    hypothesis: str | None
    backend: str


def as_dict(row) -> dict:
    """The contract's Job, plus what a person watching the queue wants to see."""
    spec = row.spec or {}
    return {"id": row.id, "hypothesis": row.hypothesis, "status": row.status, "backend": row.backend,
            "attempts": row.attempts, "run": row.run_id, "error": row.error,
            "project": spec.get("project"), "name": spec.get("name"), "max_attempts": row.max_attempts,
            "cancel_requested": bool(row.cancel_requested), "progress": row.progress,
            "worker": row.worker, "workdir": row.workdir, "created_at": _iso(row.created_at),
            "started_at": _iso(row.started_at), "finished_at": _iso(row.finished_at)}


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


# ---- writing jobs -------------------------------------------------------------------------------

def enqueue(engine: Engine, jobs: list[dict]) -> list[dict]:
    """Queue jobs (dicts with id, spec, backend, workdir and optionally hypothesis, max_attempts) in
    one transaction; a job id already in the queue fails the whole submission."""
    now = utcnow()
    rows = [dict(id=j["id"], hypothesis=j.get("hypothesis"), status="queued", backend=j["backend"], attempts=0,
                 run_id=None, error=None, spec=j["spec"], created_at=now, updated_at=now, worker=None,
                 lease_until=None, heartbeat_at=None, max_attempts=j.get("max_attempts", 3),
                 cancel_requested=False, workdir=str(j["workdir"]), started_at=None, finished_at=None,
                 progress=None) for j in jobs]
    if not rows:
        return []
    try:
        with engine.begin() as conn:
            conn.execute(_JOB.insert(), rows)
    except IntegrityError:
        taken = sorted(set(listed_ids(engine)) & {r["id"] for r in rows})
        raise InvalidRecord(f"already queued: {', '.join(taken) or 'a job id of this submission'} "
                            "(kb jobs lists them)", field="job") from None
    return [get(engine, r["id"]) for r in rows]


def listed_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(_JOB.c.id)).scalars())


def cancel(engine: Engine, job_id: str) -> dict:
    """A queued job is cancelled at once; a running one is asked to stop (its worker sees it at the
    next heartbeat or eval and ends it as cancelled). A finished job cannot be cancelled."""
    now = utcnow()
    with engine.begin() as conn:
        done = conn.execute(update(_JOB).where(_JOB.c.id == job_id, _JOB.c.status == "queued")
                            .values(status="cancelled", finished_at=now, updated_at=now)).rowcount
        if not done:
            done = conn.execute(update(_JOB).where(_JOB.c.id == job_id, _JOB.c.status == "running")
                                .values(cancel_requested=True, updated_at=now)).rowcount
    job = get(engine, job_id)
    if not done:
        raise InvalidRecord(f"job {job_id} is already {job['status']}: only a queued or running job can be "
                            "cancelled", field="job")
    return job


# ---- leases -------------------------------------------------------------------------------------

def claim(engine: Engine, worker: str, *, backend: str | None = None, job_id: str | None = None,
          lease_s: float = LEASE_S) -> Lease | None:
    """Take the oldest queued job (of `backend`, or `job_id` itself) under a lease; None if none is left."""
    wanted = [_JOB.c.status == "queued"]
    if backend:
        wanted.append(_JOB.c.backend == backend)
    if job_id:
        wanted.append(_JOB.c.id == job_id)
    oldest = select(_JOB.c.id, _JOB.c.attempts).where(*wanted).order_by(_JOB.c.created_at, _JOB.c.id)
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            row = conn.execute(oldest.limit(1).with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            conn.execute(_take(row.id, row.attempts, worker, lease_s))
        return _lease(engine, row.id)
    # SQLite: read candidates outside any transaction, then one conditional UPDATE each (its own
    # transaction begins at the write, so it never works from a snapshot another worker moved past)
    with engine.connect() as conn:
        for row in conn.execute(oldest.limit(16)).all():
            won = conn.execute(_take(row.id, row.attempts, worker, lease_s)
                               .where(_JOB.c.status == "queued", _JOB.c.attempts == row.attempts)).rowcount
            conn.commit()
            if won == 1:
                return _lease(engine, row.id)
    return None


def _take(job_id: str, attempts: int, worker: str, lease_s: float):
    now = utcnow()
    return (update(_JOB).where(_JOB.c.id == job_id)
            .values(status="running", worker=f"{worker}/{attempts + 1}", attempts=attempts + 1,
                    lease_until=now + timedelta(seconds=lease_s), heartbeat_at=now, updated_at=now,
                    started_at=now, cancel_requested=False))


def _lease(engine: Engine, job_id: str) -> Lease:
    with engine.connect() as conn:
        row = conn.execute(select(_JOB).where(_JOB.c.id == job_id)).one()
    return Lease(row.id, row.worker, row.attempts, row.spec or {}, Path(row.workdir), row.hypothesis, row.backend)


def lease_of(engine: Engine, job_id: str, token: str) -> Lease:
    """The lease a dispatcher handed to the process that runs the job (`kb worker --job ID --token T`)."""
    with engine.connect() as conn:
        row = conn.execute(select(_JOB).where(_JOB.c.id == job_id)).first()
    if row is None:
        raise NotFound(f"no job {job_id!r} (kb jobs lists them)")
    if row.status != "running" or row.worker != token:
        raise InvalidRecord(f"job {job_id} is {row.status} and not leased to {token} (now {row.worker or 'nobody'}): "
                            "its lease was given up or taken over", field="token")
    return Lease(row.id, row.worker, row.attempts, row.spec or {}, Path(row.workdir), row.hypothesis, row.backend)


def _held(lease: Lease):
    return update(_JOB).where(_JOB.c.id == lease.job_id, _JOB.c.worker == lease.token, _JOB.c.status == "running")


def renew(engine: Engine, lease: Lease, *, lease_s: float = LEASE_S, progress: dict | None = None) -> str:
    """Extend the lease: "ok", "cancel" when someone asked the job to stop, "lost" when the lease
    is no longer this holder's (it expired and the job went back to the queue or elsewhere)."""
    now = utcnow()
    values = dict(lease_until=now + timedelta(seconds=lease_s), heartbeat_at=now)
    if progress is not None:
        values |= dict(progress=progress, updated_at=now)
    with engine.begin() as conn:
        if conn.execute(_held(lease).values(**values)).rowcount != 1:
            return "lost"
        stop = conn.execute(select(_JOB.c.cancel_requested).where(_JOB.c.id == lease.job_id)).scalar()
    return "cancel" if stop else "ok"


def finish(engine: Engine, lease: Lease, status: str, *, run_id: str | None = None, error: str | None = None) -> bool:
    """End the job as succeeded, failed or cancelled; False when the lease was no longer held."""
    if status not in FINISHED:
        raise ValueError(f"a job finishes as one of {FINISHED}, not {status!r}")
    now = utcnow()
    with engine.begin() as conn:
        return conn.execute(_held(lease).values(status=status, run_id=run_id, error=_short(error), lease_until=None,
                                                finished_at=now, updated_at=now)).rowcount == 1


def retry_or_fail(engine: Engine, lease: Lease, error: str) -> str:
    """An attempt that ended without a result (a crash, a lost worker): back to the queue while
    attempts remain, else failed with the error. Returns the job's new status ("" if not held)."""
    now = utcnow()
    with engine.begin() as conn:
        row = conn.execute(select(_JOB.c.attempts, _JOB.c.max_attempts, _JOB.c.cancel_requested)
                           .where(_JOB.c.id == lease.job_id)).first()
        if row is None:
            return ""
        status = _after_failed_attempt(row)
        values = dict(status=status, worker=None, lease_until=None, updated_at=now,
                      error=_short(_attempt_error(error, row)))
        if status != "queued":
            values["finished_at"] = now
        return status if conn.execute(_held(lease).values(**values)).rowcount == 1 else ""


def _after_failed_attempt(row) -> str:
    if row.cancel_requested:
        return "cancelled"
    return "queued" if row.attempts < row.max_attempts else "failed"


def _attempt_error(error: str, row) -> str:
    return f"attempt {row.attempts} of {row.max_attempts}: {error}"


def requeue_expired(engine: Engine) -> list[str]:
    """Put running jobs whose lease ran out back in the queue (or fail them, out of attempts; or
    cancel them, if that was asked). Returns their ids."""
    now = utcnow()
    with engine.connect() as conn:
        stale = conn.execute(select(_JOB.c.id, _JOB.c.worker, _JOB.c.attempts, _JOB.c.max_attempts,
                                    _JOB.c.cancel_requested, _JOB.c.lease_until)
                             .where(_JOB.c.status == "running", _JOB.c.lease_until < now)).all()
    moved = []
    for row in stale:
        status = _after_failed_attempt(row)
        error = f"lease expired at {row.lease_until:%Y-%m-%d %H:%M:%S} UTC: worker {row.worker} stopped renewing it"
        values = dict(status=status, worker=None, lease_until=None, updated_at=now,
                      error=_short(_attempt_error(error, row)))
        if status != "queued":
            values["finished_at"] = now
        with engine.begin() as conn:     # still the same holder, still expired: nobody renewed it meanwhile
            if conn.execute(update(_JOB).where(_JOB.c.id == row.id, _JOB.c.worker == row.worker,
                                               _JOB.c.status == "running", _JOB.c.lease_until < now)
                            .values(**values)).rowcount == 1:
                moved.append(row.id)
                log.warning("job %s: %s; now %s", row.id, error, status)
    return moved


def _short(error: str | None) -> str | None:
    if error is None:
        return None
    return error if len(error) <= MAX_ERROR else error[:MAX_ERROR - 3] + "..."


# ---- reading ------------------------------------------------------------------------------------

def get(engine: Engine, job_id: str) -> dict:
    with engine.connect() as conn:
        row = conn.execute(select(_JOB).where(_JOB.c.id == job_id)).first()
    if row is None:
        raise NotFound(f"no job {job_id!r} (kb jobs lists them)")
    return as_dict(row)


def listed(engine: Engine, *, status: str | None = None, hypothesis: str | None = None,
           ids: list[str] | None = None) -> list[dict]:
    """Jobs, oldest first, optionally of one status, one hypothesis, or these ids."""
    if status is not None and status not in STATUSES:
        raise InvalidRecord(f"unknown job status {status!r}; known: {list(STATUSES)}", field="status")
    stmt = select(_JOB).order_by(_JOB.c.created_at, _JOB.c.id)
    if status:
        stmt = stmt.where(_JOB.c.status == status)
    if hypothesis:
        stmt = stmt.where(_JOB.c.hypothesis == hypothesis)
    if ids is not None:
        stmt = stmt.where(_JOB.c.id.in_(ids)) if ids else stmt.where(false())
    with engine.connect() as conn:
        return [as_dict(r) for r in conn.execute(stmt)]
