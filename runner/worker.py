"""The worker: claims queued jobs under leases and hands each to its backend, until the queue is
empty (`once`) or forever.

    kb worker --backend local          # waits for jobs; Ctrl-C puts its running jobs back in the queue
    kb worker --once                   # works until nothing is queued or running here, then exits

Each pass: leases that ran out (a worker died) go back to the queue; free slots take the oldest
queued jobs of this backend; the jobs whose process is alive have their leases renewed here too
(it may still be starting, or waiting in a Ray or Slurm queue); an attempt whose process ended without
finishing its job (it crashed, or was killed) is retried while attempts remain, then failed with
the tail of its output.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from runner.backends import Backend, Handle, job_command, job_env
from runner.queue import LEASE_S, Lease, claim, get, renew, requeue_expired, retry_or_fail

log = logging.getLogger(__name__)
POLL_S = 1.0


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Worker:
    kb: object
    backend: Backend
    lease_s: float = LEASE_S
    poll_s: float = POLL_S
    id: str = field(default_factory=worker_id)
    on_change: Callable[[list[dict]], None] | None = None     # the jobs running here, after each pass
    running: dict[str, tuple[Lease, Handle]] = field(default_factory=dict)
    finished: list[dict] = field(default_factory=list)

    def run(self, once: bool = False, max_jobs: int | None = None) -> list[dict]:
        """Work until the queue is empty (once) or forever; returns the jobs finished here."""
        started = 0
        renewed = time.monotonic()
        try:
            while True:
                requeue_expired(self.kb.engine)
                drained = False
                while len(self.running) < self.backend.slots and (max_jobs is None or started < max_jobs):
                    lease = claim(self.kb.engine, self.id, backend=self.backend.name, lease_s=self.lease_s)
                    if lease is None:
                        drained = True
                        break
                    started += 1
                    log.info("job %s: attempt %d on %s", lease.job_id, lease.attempt, self.backend.name)
                    handle = self.backend.start(lease, job_command(lease.job_id, lease.token), job_env(self.kb.settings))
                    self.running[lease.job_id] = (lease, handle)
                    self._collect()        # an inline job has already ended
                self._collect()
                if time.monotonic() - renewed > self.lease_s / 4:
                    self._renew()
                    renewed = time.monotonic()
                if self.on_change:
                    self.on_change([get(self.kb.engine, job_id) for job_id in self.running])
                if once and drained and not self.running:
                    return self.finished
                if max_jobs is not None and started >= max_jobs and not self.running:
                    return self.finished
                time.sleep(self.poll_s)
        except BaseException:
            self.stop("the worker stopped")
            raise

    def _collect(self) -> None:
        """Jobs whose process has ended: an attempt that left its job running crashed."""
        from runner.conclude import conclude_if_done
        for job_id, (lease, handle) in list(self.running.items()):
            ended = handle.poll()
            if ended is None:
                continue
            del self.running[job_id]
            rc, tail = ended
            job = get(self.kb.engine, job_id)
            if job["status"] == "running" and job["worker"] == lease.token:
                last = tail.strip().splitlines()[-1] if tail.strip() else "no output"
                status = retry_or_fail(self.kb.engine, lease, f"exit code {rc}: {last}")
                log.warning("job %s: attempt %d ended with exit code %d without a result; %s",
                            job_id, lease.attempt, rc, status)
                conclude_if_done(self.kb, lease.hypothesis)
                job = get(self.kb.engine, job_id)
            self.finished.append(job)

    def _renew(self) -> None:
        """Renew the leases of the jobs whose process is alive: it may still be starting (a Python
        process importing torch, a Slurm job waiting for a node) before its own heartbeats begin.
        A lease found lost was taken back (it expired): that process is stopped."""
        for job_id, (lease, handle) in list(self.running.items()):
            lost = renew(self.kb.engine, lease, lease_s=self.lease_s) == "lost"
            if lost and get(self.kb.engine, job_id)["worker"] != lease.token:     # not just finished
                log.warning("job %s: lease lost; stopping its attempt %d", job_id, lease.attempt)
                handle.stop()
                del self.running[job_id]

    def stop(self, why: str) -> None:
        """Stop this worker's jobs and put them back in the queue (counted as an attempt)."""
        for job_id, (lease, handle) in list(self.running.items()):
            handle.stop()
            retry_or_fail(self.kb.engine, lease, why)
            del self.running[job_id]


def run_one(kb, job_id: str, token: str | None = None, *, on_progress=None) -> dict:
    """Run one job in this process: the lease a dispatcher handed over (`token`), or claim the job
    here when it is queued. Returns the job afterwards."""
    from kb.errors import InvalidRecord
    from runner.execute import execute
    from runner.queue import lease_of
    settings = kb.settings
    lease = lease_of(kb.engine, job_id, token) if token else \
        claim(kb.engine, worker_id(), job_id=job_id, lease_s=settings.job_lease_s)
    if lease is None:
        job = get(kb.engine, job_id)
        raise InvalidRecord(f"job {job_id} is {job['status']}, not queued: nothing to run", field="job")
    execute(kb, lease, lease_s=settings.job_lease_s, on_progress=on_progress)
    return get(kb.engine, job_id)
