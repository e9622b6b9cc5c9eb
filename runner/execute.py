"""One leased job, run in this process: the proxy training with heartbeats, its run written back
through the ingest path, the job finished, and the hypothesis concluded when it was its last job.

    kb worker --job JOB_ID --token TOKEN      # what a backend runs (a subprocess, a Ray task, a Slurm job)

The lease is renewed from a thread every `heartbeat_s` and at every eval (with the eval's
metrics, which `kb jobs` and the worker's progress bars show, and the losses so far as a bounded
curve, which the UI plots while the job runs). A renewal that finds the job
cancelled, or the lease gone (it expired and the job was queued again), stops the training at
its next step check. The training resumes from the checkpoints in the job's workdir, which is
the same for every attempt, so a job whose worker was killed continues where it stopped.

The run's id is the job's (`run-<job hex>`): a retried or resumed job writes the same run again,
never a second one. A diverged training is a succeeded job whose run is `diverged`; a training
that failed (its record says why) is a failed job that keeps its run; a cancelled job writes
no run (its curves stop early and would read as a worse result than the configuration has).
"""
from __future__ import annotations

import logging
import math
import threading
import traceback
from dataclasses import replace
from typing import Callable

from sqlalchemy.exc import SQLAlchemyError

from runner.queue import LEASE_S, Lease, finish, renew, retry_or_fail

log = logging.getLogger(__name__)
SOURCE_KIND = "runner"
CURVE_POINTS = 200         # points per loss kept in a running job's progress: enough to draw, small to rewrite


class LiveCurve:
    """The losses of a running job at its evals, `progress["curve"]` = {key: [[step, value], ...]}.

    Rewritten into the job's row at every eval, so it is bounded: a curve keeps the steps that
    are multiples of its stride, and the stride doubles whenever more than `limit` points would
    be kept, so the points stay evenly spaced over every step done; the latest point is always
    there too. A resumed attempt starts from the curve the last one left, cut back to the
    checkpoint's step."""

    def __init__(self, start: dict | None = None, limit: int = CURVE_POINTS):
        self.limit = limit
        self.points: dict[str, list[list]] = {k: [list(p) for p in v] for k, v in (start or {}).items()
                                               if isinstance(v, list)}
        self.stride: dict[str, int] = {}

    def add(self, step: int, metrics: dict) -> dict:
        for key, value in metrics.items():
            if "loss" not in key:       # lr and throughput are in progress["metrics"]; the curve is for losses
                continue
            points = self.points.setdefault(key, [])
            stride = self.stride.setdefault(key, 1)
            while points and points[-1][0] >= step:        # a resumed attempt goes over those steps again
                points.pop()
            if points and points[-1][0] % stride:          # kept only while it was the latest
                points.pop()
            points.append([step, value])
            while len(points) > self.limit:
                stride = self.stride[key] = stride * 2
                points[:] = [p for p in points[:-1] if p[0] % stride == 0] + points[-1:]
        return {k: [list(p) for p in v] for k, v in self.points.items()}


def run_id_for(job_id: str) -> str:
    return "run-" + job_id.removeprefix("job-")


class Heartbeat:
    """Renews a lease from a thread; `stop_reason` becomes "cancel" or "lost" when the job must stop."""

    def __init__(self, engine, lease: Lease, lease_s: float = LEASE_S, every: float | None = None):
        self.engine, self.lease, self.lease_s = engine, lease, lease_s
        self.every = every or lease_s / 4
        self.stop_reason: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{lease.job_id}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(self.every):
            self.beat()

    def beat(self, progress: dict | None = None) -> None:
        with self._lock:
            try:
                state = renew(self.engine, self.lease, lease_s=self.lease_s, progress=progress)
            except SQLAlchemyError as exc:     # the database hiccuped: the next beat tries again
                log.warning("job %s: heartbeat failed: %s", self.lease.job_id, exc)
                return
        if state != "ok" and self.stop_reason is None:
            log.warning("job %s: %s", self.lease.job_id,
                        "cancel requested" if state == "cancel" else "lease lost: the job was taken back")
            self.stop_reason = state


def execute(kb, lease: Lease, *, lease_s: float = LEASE_S, heartbeat_s: float | None = None,
            on_progress: Callable[[str, dict], None] | None = None) -> str:
    """Run the leased job here; returns the job's status afterwards ("" when the lease was lost)."""
    from runner.conclude import conclude_if_done
    from runner.scales import train_config
    from runner.train import train

    engine = kb.engine
    spec = lease.spec
    with Heartbeat(engine, lease, lease_s, heartbeat_s) as beat:
        if beat.stop_reason:
            return _stopped(kb, lease, beat.stop_reason)

        curve = LiveCurve(_last_curve(engine, lease))

        def on_eval(step: int, metrics: dict) -> None:
            finite = _finite(metrics)
            progress = {"step": int(step), "max_steps": spec.get("max_steps"), "metrics": finite,
                        "curve": curve.add(int(step), finite)}
            beat.beat(progress)
            if on_progress:
                on_progress(lease.job_id, progress)

        lease.workdir.mkdir(parents=True, exist_ok=True)
        try:
            cfg = train_config(spec["config"])
            if not cfg.threads:            # the setting (KB_THREADS) unless the job names its own
                cfg = replace(cfg, threads=kb.settings.threads)
            result = train(cfg, workdir=lease.workdir, on_eval=on_eval, resume=True,
                           should_stop=lambda: beat.stop_reason is not None,
                           record_fields={"id": run_id_for(lease.job_id)})
        except Exception as exc:       # noqa: BLE001 - any crash of one attempt: retried, then failed with it
            log.error("job %s attempt %d crashed:\n%s", lease.job_id, lease.attempt, traceback.format_exc())
            status = retry_or_fail(engine, lease, f"{type(exc).__name__}: {exc}")
            conclude_if_done(kb, lease.hypothesis)
            return status
    if beat.stop_reason:
        return _stopped(kb, lease, beat.stop_reason)
    if result.record.get("summary", {}).get("stop_reason") == "interrupted":
        # Ctrl-C reached the training (the trainer ends such a run as killed): no result, so the
        # job goes back to the queue to resume from its checkpoint, and the interrupt goes on
        retry_or_fail(engine, lease, f"interrupted at step {result.steps_done}")
        raise KeyboardInterrupt
    status = write_back(kb, lease, result.record)
    conclude_if_done(kb, lease.hypothesis)
    return status


def _stopped(kb, lease: Lease, reason: str) -> str:
    from runner.conclude import conclude_if_done
    if reason == "lost":
        return ""
    done = finish(kb.engine, lease, "cancelled", error="cancelled on request")
    conclude_if_done(kb, lease.hypothesis)
    return "cancelled" if done else ""


def write_back(kb, lease: Lease, record: dict) -> str:
    """Store the trainer's record as the job's run (through KnowledgeBase.ingest_records, like any
    run) with the job's id, project, name, tags and hypothesis; then finish the job."""
    spec = lease.spec
    run_id = run_id_for(lease.job_id)
    record = dict(record, id=run_id, project=spec["project"], name=spec.get("name") or run_id)
    record["tags"] = list(dict.fromkeys([*record.get("tags", []), *spec.get("tags", [])]))
    for key in ("hypothesis", "parent"):
        if spec.get(key):
            record[key] = spec[key]
    record["meta"] = dict(record.get("meta") or {}, job={"id": lease.job_id, "attempt": lease.attempt,
                                                          "backend": lease.backend, "side": spec.get("side")})
    report = kb.ingest_records([record], source=f"job://{lease.job_id}", source_kind=SOURCE_KIND, index=False)
    if report.failed:
        error = "; ".join(f"{f['field']}: {f['error']}" if f.get("field") else f["error"] for f in report.failed)
        status = "failed"
        finish(kb.engine, lease, status, error=f"the store refused the run: {error}")
        return status
    failure = record.get("failure") or {}
    if record.get("status") == "failed":
        status, error = "failed", f"training failed: {failure.get('kind', 'exception')}: {failure.get('message', '')}"
    else:
        status, error = "succeeded", None
    return status if finish(kb.engine, lease, status, run_id=run_id, error=error) else ""


def _last_curve(engine, lease: Lease) -> dict | None:
    """The curve an earlier attempt of this job left in its progress (None on a first attempt)."""
    if lease.attempt <= 1:
        return None
    from runner.queue import get
    return (get(engine, lease.job_id).get("progress") or {}).get("curve")


def _finite(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
