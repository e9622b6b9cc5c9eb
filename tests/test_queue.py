"""The job queue (runner/queue.py, runner/execute.py, runner/worker.py, kb submit/worker/jobs/cancel):
leases on SQLite and Postgres, concurrent claims, cancels, retries, a config run end to end through
a real subprocess worker, and a worker killed with SIGKILL whose job resumes from its checkpoint.

Every test trains real tiny proxy GPTs on the built-in corpus (CPU, one thread)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kb.cli import main
from kb.db import make_engine
from kb.errors import InvalidRecord, NotFound
from runner.queue import claim, enqueue, finish, get, renew, requeue_expired, retry_or_fail

TINY = {"n_layer": 1, "seq_len": 32, "batch_size": 8, "max_steps": 30, "eval_interval": 10, "eval_batches": 2,
        "threads": 1}


def queue_jobs(k, n: int, backend: str = "inline", **over) -> list[str]:
    """n jobs straight into the queue (what the claim tests need: rows, not trainings)."""
    jobs = [{"id": f"job-{i:012x}", "backend": backend, "spec": {"config": TINY, "project": "q"},
             "workdir": k.settings.home / "jobs" / f"job-{i:012x}", **over} for i in range(n)]
    return [j["id"] for j in enqueue(k.engine, jobs)]


def cli(k, *args) -> tuple[int, str, str]:
    """`kb ...` in this process against the test's store; (exit code, stdout, stderr)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["--home", str(k.settings.home), "--database-url", k.settings.database_url, *args])
    return rc, out.getvalue(), err.getvalue()


# ---- leases -------------------------------------------------------------------------------------

def test_claim_leases_the_oldest_job_and_only_its_holder_writes(kb):
    first, second = queue_jobs(kb, 2)
    lease = claim(kb.engine, "w1", lease_s=60)
    assert lease.job_id == first and lease.attempt == 1 and lease.token == "w1/1"
    job = get(kb.engine, first)
    assert job["status"] == "running" and job["worker"] == "w1/1" and job["attempts"] == 1
    assert renew(kb.engine, lease, progress={"step": 5}) == "ok"
    assert get(kb.engine, first)["progress"] == {"step": 5}
    stranger = lease.__class__(**{**lease.__dict__, "token": "w2/1"})
    assert renew(kb.engine, stranger) == "lost" and not finish(kb.engine, stranger, "succeeded")
    assert finish(kb.engine, lease, "succeeded", run_id="run-x")
    assert get(kb.engine, first)["status"] == "succeeded" and get(kb.engine, first)["run"] == "run-x"
    assert claim(kb.engine, "w1", lease_s=60).job_id == second
    assert claim(kb.engine, "w1", lease_s=60) is None


def test_an_expired_lease_goes_back_to_the_queue_then_fails_after_max_attempts(kb):
    [job_id] = queue_jobs(kb, 1, max_attempts=2)
    lease = claim(kb.engine, "w1", lease_s=0.05)
    time.sleep(0.2)
    assert requeue_expired(kb.engine) == [job_id]
    job = get(kb.engine, job_id)
    assert job["status"] == "queued" and job["attempts"] == 1 and "lease expired" in job["error"]
    assert renew(kb.engine, lease) == "lost"            # the dead holder can no longer write
    again = claim(kb.engine, "w2", lease_s=0.05)
    assert again.attempt == 2 and again.token == "w2/2"
    time.sleep(0.2)
    assert requeue_expired(kb.engine) == [job_id]
    job = get(kb.engine, job_id)
    assert job["status"] == "failed" and job["error"].startswith("attempt 2 of 2: lease expired")
    assert claim(kb.engine, "w3") is None


def test_a_crashed_attempt_is_retried_then_failed(kb):
    [job_id] = queue_jobs(kb, 1, max_attempts=2)
    assert retry_or_fail(kb.engine, claim(kb.engine, "w"), "exit code 1: boom") == "queued"
    assert retry_or_fail(kb.engine, claim(kb.engine, "w"), "exit code 1: boom") == "failed"
    assert get(kb.engine, job_id)["error"] == "attempt 2 of 2: exit code 1: boom"


def test_two_workers_never_run_the_same_job(kb):
    ids = queue_jobs(kb, 40)
    taken: list[list[str]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(i: int) -> None:
        engine = make_engine(kb.settings.database_url)      # a worker has its own connections
        start.wait()
        while (lease := claim(engine, f"w{i}", lease_s=60)) is not None:
            taken[i].append(lease.job_id)
        engine.dispose()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [j for t in taken for j in t]
    assert sorted(claimed) == sorted(ids)              # every job once: none twice, none lost
    assert sum(1 for t in taken if t) >= 2             # the workers really raced
    assert {get(kb.engine, j)["worker"].split("/")[0] for j in ids} == {f"w{i}" for i, t in enumerate(taken) if t}


def test_cancel_a_queued_job_at_once_and_a_running_one_at_its_next_heartbeat(kb):
    queued, running = queue_jobs(kb, 2)
    lease = claim(kb.engine, "w", job_id=running)
    assert kb.cancel(queued)["status"] == "cancelled"
    job = kb.cancel(running)
    assert job["status"] == "running" and job["cancel_requested"]
    assert renew(kb.engine, lease) == "cancel"
    with pytest.raises(InvalidRecord, match="already cancelled"):
        kb.cancel(queued)
    with pytest.raises(NotFound):
        kb.cancel("job-nope")
    rc, _, err = cli(kb, "cancel", "job-nope")
    assert rc == 2 and "no job 'job-nope'" in err


# ---- jobs end to end ----------------------------------------------------------------------------

def test_cancel_stops_a_running_training_and_writes_no_run(kb):
    [job] = kb.submit(config={**TINY, "max_steps": 100000, "eval_interval": 5}, backend="inline", project="q")

    def cancel_soon(step, metrics):
        if step >= 10:
            kb.cancel(job["id"])

    kb.work(backend="inline", on_progress=lambda job_id, p: cancel_soon(p["step"], p))
    done = kb.job(job["id"])
    assert done["status"] == "cancelled" and done["run"] is None
    assert 10 <= done["progress"]["step"] < 100
    assert kb.runs(project="q") == []


def test_a_job_whose_data_vanished_fails_after_its_attempts_naming_it(kb, tmp_path):
    from runner.data import write_shard
    shard = write_shard(tmp_path / "web.bin", [i % 200 for i in range(5000)])
    [job] = kb.submit(config={**TINY, "data": {"sources": {"web": str(shard)}}}, backend="inline",
                      project="q", max_attempts=2)
    shard.unlink()
    kb.work(backend="inline")
    done = kb.job(job["id"])
    assert done["status"] == "failed" and done["attempts"] == 2 and done["run"] is None
    assert done["error"].startswith("attempt 2 of 2: InvalidRecord") and str(shard) in done["error"]


@pytest.mark.slow
def test_submit_a_config_then_a_local_worker_leaves_a_succeeded_job_and_its_run(kb, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("n_layer: 1\nseq_len: 32\nbatch_size: 8\nmax_steps: 30\neval_interval: 10\n"
                      "eval_batches: 2\nproject: tiny\n")
    rc, out, err = cli(kb, "submit", "--config", str(config), "--backend", "local", "--json")
    assert rc == 0, err
    [queued] = json.loads(out)
    assert {k: queued[k] for k in ("status", "backend", "attempts", "run", "error", "hypothesis")} == \
        {"status": "queued", "backend": "local", "attempts": 0, "run": None, "error": None, "hypothesis": None}
    rc, out, err = cli(kb, "worker", "--once", "--json")          # a real subprocess per job
    assert rc == 0, err
    [job] = json.loads(out)
    assert job["id"] == queued["id"] and job["status"] == "succeeded" and job["attempts"] == 1
    run = kb.run(job["run"])
    assert run.status == "completed" and run.project == "tiny" and run.source["kind"] == "runner"
    # the curves stored are the ones the trainer logged (its checkpoint keeps them)
    logged = torch.load(Path(job["workdir"]) / "checkpoint.pt", weights_only=True)["metrics"]
    assert set(logged) <= set(run.metrics)
    for key, points in logged.items():
        assert [(p[0], pytest.approx(p[1])) for p in run.metrics[key]] == [(p[0], p[1]) for p in points]
    assert run.summary["val/loss"] == pytest.approx(logged["val/loss"][-1][1])
    assert run.meta["job"] == {"id": job["id"], "attempt": 1, "backend": "local", "side": None}
    rc, out, _ = cli(kb, "jobs", "--json")
    assert [j["status"] for j in json.loads(out)] == ["succeeded"]


@pytest.mark.slow
def test_a_worker_killed_mid_run_resumes_its_job_from_the_checkpoint_after_a_restart(kb, tmp_path):
    [job] = kb.submit(config={**TINY, "max_steps": 600, "eval_interval": 50, "checkpoint_interval": 25},
                      backend="local", project="q")
    env = {**os.environ, "KB_JOB_LEASE_S": "3"}
    argv = [sys.executable, "-m", "kb.cli", "--home", str(kb.settings.home), "--database-url",
            kb.settings.database_url, "worker", "--once"]
    checkpoint = Path(job["workdir"]) / "checkpoint.pt"
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the worker never wrote a checkpoint"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)           # the worker only: its training dies with it
        first.wait()
    killed_at = torch.load(checkpoint, weights_only=True)["step"]
    assert 0 < killed_at < 600
    time.sleep(1.0)
    beat = kb.job(job["id"])["progress"]
    time.sleep(1.5)
    assert kb.job(job["id"])["progress"] == beat and kb.job(job["id"])["status"] == "running"   # nobody trains it
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    job = kb.job(job["id"])
    assert job["status"] == "succeeded" and job["attempts"] == 2 and job["error"] is None, job
    [run] = kb.runs(project="q")                    # one run, not one per attempt
    assert run.id == job["run"] and run.status == "completed"
    steps = [p[0] for p in kb.run(run.id).metrics["train/loss"]]
    assert steps == list(range(600))               # continued, not restarted: every step once
    # the record started with the first attempt: the second one resumed it from the checkpoint
    assert run.started_at < _parse(job["started_at"])
    assert (Path(job["workdir"]) / "attempt-2.log").exists()


def _parse(iso: str):
    from datetime import datetime
    return datetime.fromisoformat(iso)
