"""Where a job runs: a registry of execution backends, each starting one leased job and reporting
when it ended.

    local   a subprocess per job (`python -m kb.cli worker --job ID --token T`); on a machine with
            GPUs one job per GPU in parallel (CUDA_VISIBLE_DEVICES), on CPU one at a time. The
            subprocess dies with its worker (Linux PR_SET_PDEATHSIG), so a killed worker leaves no
            orphan training that keeps renewing its lease.
    ray     the same command as a Ray task (num_gpus=1 when the cluster has GPUs) on the cluster at
            KB_RAY_ADDRESS, or on a local one started here.
    slurm   the same command as a Slurm job through submitit: partition KB_SLURM_PARTITION, GPUs
            KB_SLURM_GPUS, time limit KB_SLURM_TIME_MIN; KB_SLURM_CLUSTER=local runs it with
            submitit's local executor (no Slurm needed), as the tests do.
    inline  in the worker's own process, one at a time (no isolation: for debugging, tests and
            `kb loop` on a laptop, where a subprocess's start-up would cost more than the training).

A backend is `start(lease, argv, env) -> Handle`, `Handle.poll() -> (exit code, output tail) | None`
and `Handle.stop()`; `slots` is how many jobs it runs at once. Remote backends need the store to
be reachable from where the job runs: KB_DATABASE_URL pointing at Postgres, and KB_HOME on a
shared filesystem (job workdirs hold the checkpoints a retry resumes from).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Protocol

from kb.errors import InvalidRecord, KBError

log = logging.getLogger(__name__)
TAIL_LINES = 20


class Handle(Protocol):
    def poll(self) -> tuple[int, str] | None: ...
    def stop(self) -> None: ...


class Backend(Protocol):
    name: str
    slots: int

    def start(self, lease, argv: list[str], env: dict[str, str]) -> Handle: ...


BACKENDS: dict[str, Callable[..., Backend]] = {}


def register(name: str):
    def deco(builder):
        BACKENDS[name] = builder
        return builder
    return deco


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise InvalidRecord(f"unknown backend {name!r}; known: {sorted(BACKENDS)}", field="backend")
    return name


def build(name: str, settings, *, run_here: Callable | None = None, slots: int | None = None) -> Backend:
    """The backend `name`, configured from the settings; `run_here(lease)` runs a job in this process
    (the inline backend's whole work)."""
    return BACKENDS[check_backend(name)](settings, run_here=run_here, slots=slots)


def job_command(job_id: str, token: str) -> list[str]:
    """The command that runs one leased job: the same for every backend."""
    return [sys.executable, "-m", "kb.cli", "worker", "--job", job_id, "--token", token]


def job_env(settings) -> dict[str, str]:
    """What the job's process needs to open the same store (absolute, since it may start elsewhere)."""
    env = {"KB_HOME": str(Path(settings.home).resolve()), "KB_THREADS": str(settings.threads)}
    if settings.database_url:
        env["KB_DATABASE_URL"] = settings.database_url
    return env


def run_command(argv: list[str], env: dict[str, str], log_path: str | None = None) -> tuple[int, str]:
    """Run a job's command to its end: (exit code, last lines of its output). What a Ray task or a
    Slurm job executes; the cluster's own environment (CUDA_VISIBLE_DEVICES) is kept."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.run(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log_path:
            out.close()
    return proc.returncode, _tail(log_path)


def _tail(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as fh:
        lines = deque(fh, maxlen=TAIL_LINES)
    return b"".join(lines).decode("utf-8", "replace").strip()


# ---- local: a subprocess per job ----------------------------------------------------------------

def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the worker that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except OSError:
        pass                     # not Linux: a killed worker's child runs on until its lease is lost


class _Process:
    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.proc, self.log_path = proc, log_path

    def poll(self) -> tuple[int, str] | None:
        rc = self.proc.poll()
        return None if rc is None else (rc, _tail(str(self.log_path)))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@register("local")
class LocalBackend:
    name = "local"

    def __init__(self, settings, run_here=None, slots: int | None = None):
        self.gpus = gpu_count()
        self.slots = slots or max(1, self.gpus)
        self.busy: dict[int, object] = {}         # GPU index -> lease holding it

    def start(self, lease, argv: list[str], env: dict[str, str]) -> Handle:
        env = {**os.environ, **env}
        if self.gpus:
            free = next(i for i in range(self.gpus) if i not in self.busy)
            self.busy[free] = lease.job_id
            env["CUDA_VISIBLE_DEVICES"] = str(free)
        lease.workdir.mkdir(parents=True, exist_ok=True)
        log_path = lease.workdir / f"attempt-{lease.attempt}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        return _GpuRelease(_Process(proc, log_path), self.busy, lease.job_id)


class _GpuRelease:
    """Frees the job's GPU slot once its process has ended."""

    def __init__(self, inner: _Process, busy: dict, job_id: str):
        self.inner, self.busy, self.job_id = inner, busy, job_id

    def poll(self):
        done = self.inner.poll()
        if done is not None:
            for gpu in [g for g, j in self.busy.items() if j == self.job_id]:
                del self.busy[gpu]
        return done

    def stop(self) -> None:
        self.inner.stop()
        self.poll()


# ---- inline: in this process --------------------------------------------------------------------

class _Finished:
    def __init__(self, rc: int, tail: str = ""):
        self.result = (rc, tail)

    def poll(self):
        return self.result

    def stop(self) -> None:
        pass


@register("inline")
class InlineBackend:
    name, slots = "inline", 1

    def __init__(self, settings, run_here=None, slots: int | None = None):
        if run_here is None:
            raise KBError("the inline backend runs jobs in the worker's process: it needs the worker's store")
        self.run_here = run_here

    def start(self, lease, argv, env) -> Handle:
        try:
            self.run_here(lease)
        except Exception as exc:     # noqa: BLE001 - reported like a subprocess that crashed
            log.exception("job %s crashed in the worker's process", lease.job_id)
            return _Finished(1, f"{type(exc).__name__}: {exc}")
        return _Finished(0)


# ---- ray ----------------------------------------------------------------------------------------

class _RayTask:
    def __init__(self, ray, ref):
        self.ray, self.ref = ray, ref

    def poll(self):
        ready, _ = self.ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            return tuple(self.ray.get(self.ref))
        except Exception as exc:      # noqa: BLE001 - the task itself failed (node lost, worker died)
            return 1, f"ray task failed: {type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self.ray.cancel(self.ref, force=True)


@register("ray")
class RayBackend:
    """Ray tasks on the cluster at KB_RAY_ADDRESS (`ray://host:10001` or `auto`), else a local one.
    A cluster with GPUs gives each task one (`num_gpus=1`; Ray sets its CUDA_VISIBLE_DEVICES)."""
    name = "ray"

    def __init__(self, settings, run_here=None, slots: int | None = None):
        try:
            import ray
        except ImportError:
            raise KBError("the ray backend needs Ray: pip install 'pretrain-kb[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=settings.ray_address or None, ignore_reinit_error=True, log_to_driver=False)
        self.gpus = int(ray.cluster_resources().get("GPU", 0))
        self.slots = slots or max(1, self.gpus or int(ray.cluster_resources().get("CPU", 1)))
        self.task = ray.remote(run_command).options(num_gpus=1 if self.gpus else 0, num_cpus=1, max_retries=0)

    def start(self, lease, argv, env) -> Handle:
        log_path = str(lease.workdir / f"attempt-{lease.attempt}.log")
        lease.workdir.mkdir(parents=True, exist_ok=True)
        return _RayTask(self.ray, self.task.remote(argv, env, log_path))


# ---- slurm, through submitit --------------------------------------------------------------------

class _SlurmJob:
    def __init__(self, job):
        self.job = job

    def poll(self):
        if not self.job.done():
            return None
        try:
            return tuple(self.job.result())
        except Exception as exc:      # noqa: BLE001 - the Slurm job failed outside the command (time limit, node)
            return 1, f"slurm job {self.job.job_id} failed: {type(exc).__name__}: {str(exc)[-1000:]}"

    def stop(self) -> None:
        self.job.cancel(check=False)


@register("slurm")
class SlurmBackend:
    """Slurm jobs through submitit (its logs under KB_HOME/slurm). Settings: KB_SLURM_PARTITION,
    KB_SLURM_GPUS (per job, default 1), KB_SLURM_TIME_MIN (default 60), KB_SLURM_CLUSTER
    (`local` runs jobs as local processes through submitit's LocalExecutor; default: Slurm)."""
    name = "slurm"

    def __init__(self, settings, run_here=None, slots: int | None = None):
        try:
            import submitit
        except ImportError:
            raise KBError("the slurm backend needs submitit: pip install 'pretrain-kb[slurm]'") from None
        self.slots = slots or 4
        cluster = settings.slurm_cluster or "slurm"
        self.executor = submitit.AutoExecutor(folder=str(Path(settings.home).resolve() / "slurm"), cluster=cluster)
        params = {"timeout_min": settings.slurm_time_min, "gpus_per_node": settings.slurm_gpus,
                  "tasks_per_node": 1, "nodes": 1}
        if cluster == "slurm":
            params |= {"slurm_partition": settings.slurm_partition} if settings.slurm_partition else {}
        self.executor.update_parameters(**params)

    def start(self, lease, argv, env) -> Handle:
        log_path = str(lease.workdir / f"attempt-{lease.attempt}.log")
        lease.workdir.mkdir(parents=True, exist_ok=True)
        return _SlurmJob(self.executor.submit(run_command, argv, env, log_path))
