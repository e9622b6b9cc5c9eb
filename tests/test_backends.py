"""Execution backends (runner/backends.py): a real subprocess per job (local), Ray tasks on a local
Ray cluster this module starts, Slurm jobs through submitit's local executor (no Slurm here: the
executor runs the same command as a local process), and the registry's error for an unknown name.
Tiny proxy trainings on CPU, one thread; SQLite, and Postgres when KB_TEST_DATABASE_URL is set."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kb.settings import Settings
from runner.backends import BACKENDS, build
from runner.worker import Worker

TINY = {"n_layer": 1, "seq_len": 32, "batch_size": 8, "max_steps": 30, "eval_interval": 10, "eval_batches": 2,
        "threads": 1}


def run_one_job(k, backend: str, settings: Settings | None = None) -> dict:
    [job] = k.submit(config=TINY, backend=backend, project="b")
    worker = Worker(k, build(backend, settings or k.settings), lease_s=30, poll_s=0.2)
    [done] = worker.run(once=True)
    assert done["id"] == job["id"]
    return done


def check_succeeded(k, job: dict, backend: str) -> None:
    assert job["status"] == "succeeded" and job["attempts"] == 1, job
    run = k.run(job["run"])
    assert run.status == "completed" and run.meta["job"]["backend"] == backend
    assert run.summary["val/loss"] == pytest.approx(job["progress"]["metrics"]["val/loss"])
    assert (Path(job["workdir"]) / "attempt-1.log").exists()


def test_an_unknown_backend_is_refused_naming_the_known_ones(kb, tmp_path, capsys):
    from kb.cli import main
    config = tmp_path / "c.json"
    config.write_text('{"n_layer": 1}')
    for args in (["submit", "--config", str(config), "--backend", "gpu-farm"], ["worker", "--backend", "gpu-farm"]):
        rc = main(["--home", str(kb.settings.home), "--database-url", kb.settings.database_url, *args])
        err = capsys.readouterr().err
        assert rc == 2 and "unknown backend 'gpu-farm'; known: ['inline', 'local', 'ray', 'slurm']" in err
    assert sorted(BACKENDS) == ["inline", "local", "ray", "slurm"]
    assert kb.jobs() == []


@pytest.mark.slow
def test_local_backend_retries_a_job_whose_process_was_killed_and_resumes_it(kb):
    """An attempt's process killed from outside (as the OOM killer would): the worker sees it end
    without a result, queues the job again, and the next attempt resumes from the checkpoint."""
    [job] = kb.submit(config={**TINY, "max_steps": 200, "checkpoint_interval": 20}, backend="local", project="b")
    worker = Worker(kb, build("local", kb.settings), lease_s=30, poll_s=0.2)
    checkpoint = Path(job["workdir"]) / "checkpoint.pt"

    def kill_first_attempt() -> None:
        while not checkpoint.exists():
            time.sleep(0.05)
        _, handle = worker.running[job["id"]]
        os.kill(handle.inner.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_first_attempt)
    killer.start()
    finished = worker.run(once=True)
    killer.join()
    done = kb.job(job["id"])
    assert [j["status"] for j in finished] == ["queued", "succeeded"]    # the killed attempt, then the retry
    assert done["status"] == "succeeded" and done["attempts"] == 2
    run = kb.run(done["run"])
    assert run.meta["job"]["attempt"] == 2 and [p[0] for p in run.metrics["train/loss"]] == list(range(200))
    assert len(kb.runs(project="b")) == 1


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="the ray backend needs Ray (pip install 'pretrain-kb[ray]')")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_backend_runs_a_job_as_a_task_on_a_local_cluster(kb, ray_cluster):
    backend = build("ray", kb.settings)
    assert backend.slots == 1 and backend.gpus == 0          # the cluster this module started
    done = run_one_job(kb, "ray")
    check_succeeded(kb, done, "ray")


@pytest.mark.slow
def test_slurm_backend_runs_a_job_through_submitits_local_executor(kb):
    pytest.importorskip("submitit", reason="the slurm backend needs submitit (pip install 'pretrain-kb[slurm]')")
    settings = kb.settings.model_copy(update={"slurm_cluster": "local", "slurm_gpus": 0})
    done = run_one_job(kb, "slurm", settings)
    check_succeeded(kb, done, "slurm")
    assert list((Path(kb.settings.home) / "slurm").glob("*_submitted.pkl"))      # submitit's own job files


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_local_backend_gives_each_job_its_own_gpu(kb):
    import torch
    backend = build("local", kb.settings)
    assert backend.slots == torch.cuda.device_count()
    jobs = kb.submit(config={**TINY, "device": "cuda"}, backend="local", project="b", seeds=backend.slots)
    done = Worker(kb, backend, lease_s=60, poll_s=0.2).run(once=True)
    assert sorted(j["id"] for j in done) == sorted(j["id"] for j in jobs)
    devices = {kb.run(j["run"]).meta["runner"]["device"] for j in done}
    assert all(j["status"] == "succeeded" for j in done) and all("cpu" not in d for d in devices)
