"""What goes in the queue: one ad-hoc training config, or an approved hypothesis's plan as jobs.

    submit_config(k, {"n_layer": 2, "max_steps": 200}, backend="local", seeds=3)
    submit_hypothesis(k, "hyp-1a2b3c4d5e", backend="ray")        # baseline and variant x scales x seeds

A hypothesis becomes a grid of jobs: each side (the baseline run's config, and that config with the
change applied) at each scale of its plan (a parameter count, run at the nearest depth: see
runner.scales), with seeds 0 to k-1.

A cell the store already holds (a finished run of the project with the same experiment and seed,
such as the baseline run itself) is not trained again: its job is written as succeeded with that
run, so the verdict uses it and the seed noise never counts one seed twice. The hypothesis's status
becomes `running`; it is `done`, with its result, when its last job finishes (runner.conclude).
"""
from __future__ import annotations

import hashlib
import uuid
from dataclasses import replace
from pathlib import Path

from sqlalchemy import update

from kb.errors import InvalidRecord, NotFound
from kb.hypotheses import apply_change, get as get_hypothesis
from kb.models import Hypothesis, Job, utcnow
from kb.noise import read_runs
from runner.backends import check_backend
from runner.queue import enqueue, listed
from runner.scales import at_depth, depth_for, params_of, spec_config, train_config, with_change

MAX_SEEDS = 64
REUSABLE = ("completed", "diverged")      # a run that says what its configuration does


# ---- submissions --------------------------------------------------------------------------------

def _check_seeds(seeds) -> None:
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_SEEDS):
        raise InvalidRecord(f"seeds must be a whole number from 1 to {MAX_SEEDS}, not {seeds!r}", field="seeds")


def submit_config(kb, config: dict, *, backend: str = "local", project: str | None = None, name: str | None = None,
                  seeds: int | None = None, scales: list[float] | None = None, max_attempts: int | None = None,
                  tags: list[str] | None = None) -> list[dict]:
    """Queue one training (or one per seed and scale) of an ad-hoc config."""
    check_backend(backend)
    _check_seeds(seeds)
    cfg = train_config(config)
    if project:
        cfg = replace(cfg, project=project)
    if name:
        cfg = replace(cfg, name=name)
    depths = sorted({depth_for(cfg, s) for s in scales}) if scales else [cfg.n_layer]
    jobs = []
    for depth in depths:
        for i in range(seeds or 1):
            one = replace(at_depth(cfg, depth), seed=cfg.seed + i)
            label = cfg.name or f"proxy-d{depth}"
            suffix = "".join([f"-d{depth}" if len(depths) > 1 else "", f"-s{one.seed}" if (seeds or 1) > 1 else ""])
            job_id = "job-" + uuid.uuid4().hex[:12]
            jobs.append(_job(kb, job_id, backend, max_attempts, one, project=one.project, name=label + suffix,
                             tags=list(tags or []), n_layer=depth))
    return enqueue(kb.engine, jobs)


def submit_hypothesis(kb, ref: str, *, backend: str = "local", scales: list[float] | None = None,
                      seeds: int | None = None, max_attempts: int | None = None) -> list[dict]:
    """Queue an approved hypothesis's plan: baseline and variant x scales x seeds (`scales` and
    `seeds` override the plan's)."""
    check_backend(backend)
    _check_seeds(seeds)
    h = get_hypothesis(kb.engine, ref)
    extending = h["status"] == "done" and bool(scales)      # checked again at more scales
    if h["status"] != "approved" and not extending:
        hint = {"proposed": f"approve it first: kb approve {ref}", "rejected": "it was rejected",
                "running": f"its jobs are queued already: kb jobs --hypothesis {ref}",
                "done": "it has run and its result is stored (kb report); --scales runs it at more scales"
                }.get(h["status"], "")
        raise InvalidRecord(f"hypothesis {ref} is {h['status']}, not approved{': ' + hint if hint else ''}",
                            field="hypothesis")
    try:
        base_run = kb.run(h["baseline_run"])
    except NotFound:
        raise NotFound(f"hypothesis {ref}: its baseline run {h['baseline_run']!r} is not in the store") from None
    base = train_config(base_run.config, strict=False)
    variant = with_change(base, train_config(apply_change(base_run.config, h["change"]), strict=False))
    if variant.resolved() == base.resolved():
        raise InvalidRecord(f"hypothesis {ref}: the change {h['change']} sets nothing the runner takes "
                            "(runner/options.py lists what it does)", field="change")
    project = h["project"] or base_run.project
    plan = h["plan"] or {}
    planned = [s.get("params") for s in plan.get("scales", []) if isinstance(s, dict)]
    targets = scales or [p for p in planned if p] or [params_of(base)]
    depths = list(dict.fromkeys(depth_for(base, s) for s in targets))
    n_seeds = seeds or plan.get("seeds") or 2
    _check_seeds(n_seeds)
    held = read_runs(kb, project=project)
    had = {j["id"] for j in listed(kb.engine, hypothesis=ref)}
    jobs = []
    for depth in depths:
        for side, cfg in (("baseline", base), ("variant", variant)):
            for i in range(n_seeds):
                one = replace(at_depth(cfg, depth), seed=i, project=project, name=None)
                job_id = "job-" + hashlib.sha1(f"{ref}|{side}|{depth}|{one.seed}".encode()).hexdigest()[:12]
                if job_id in had:
                    continue          # that cell has run already (a hypothesis checked at more scales)
                name = f"{ref}-{side}-d{depth}-s{one.seed}"
                reused = _held_run(held, one)
                job = _job(kb, job_id, backend, max_attempts, one, project=project, name=name,
                           tags=[f"hyp:{ref}", f"side:{side}"], n_layer=depth, side=side,
                           hypothesis=ref if side == "variant" else None,
                           parent=h["baseline_run"] if side == "variant" else None)
                job["hypothesis"] = ref
                job["reused"] = reused
                jobs.append(job)
    if not jobs:
        raise InvalidRecord(f"hypothesis {ref} has run at those scales and seeds already "
                            f"(kb jobs --hypothesis {ref})", field="scales")
    queued = enqueue(kb.engine, [j for j in jobs if not j["reused"]])
    _record_reused(kb, [j for j in jobs if j["reused"]])
    with kb.engine.begin() as conn:
        conn.execute(update(Hypothesis.__table__).where(Hypothesis.id == ref, Hypothesis.status == h["status"])
                     .values(status="running"))
    if not queued:           # every cell was in the store already
        from runner.conclude import conclude_if_done
        conclude_if_done(kb, ref)
    return listed(kb.engine, hypothesis=ref)


def _job(kb, job_id: str, backend: str, max_attempts: int | None, cfg, *, project: str, name: str,
         tags: list[str], n_layer: int, side: str | None = None, hypothesis: str | None = None,
         parent: str | None = None) -> dict:
    spec = {"config": spec_config(cfg), "project": project, "name": name, "tags": tags, "n_layer": n_layer,
            "seed": cfg.seed, "max_steps": cfg.max_steps, "side": side, "hypothesis": hypothesis, "parent": parent}
    return {"id": job_id, "backend": backend, "spec": spec, "hypothesis": hypothesis,
            "workdir": Path(kb.settings.home).resolve() / "jobs" / job_id,
            "max_attempts": max_attempts or kb.settings.job_max_attempts}


def _held_run(runs, cfg) -> str | None:
    """A finished proxy run of the project that is this experiment with this seed (data paths
    aside: runner.config.TrainConfig.same_experiment), if the store has one."""
    want = cfg.resolved()
    for r in runs:
        if r.status not in REUSABLE or r.config.get("seed") != want.seed:
            continue
        try:
            train_config(r.config)
        except InvalidRecord:
            continue           # not a proxy run's config
        if want.same_experiment(r.config):
            return r.id
    return None


def _record_reused(kb, jobs: list[dict]) -> None:
    """Cells the store holds: jobs born succeeded, pointing at the run that answers them."""
    if not jobs:
        return
    now = utcnow()
    rows = [dict(id=j["id"], hypothesis=j["hypothesis"], status="succeeded", backend=j["backend"], attempts=0,
                 run_id=j["reused"], error=None, spec=j["spec"] | {"reused": True}, created_at=now, updated_at=now,
                 worker=None, lease_until=None, heartbeat_at=None, max_attempts=j["max_attempts"],
                 cancel_requested=False, workdir=str(j["workdir"]), started_at=None, finished_at=now, progress=None)
            for j in jobs]
    with kb.engine.begin() as conn:
        conn.execute(Job.__table__.insert(), rows)


def cancel(kb, job_id: str) -> dict:
    """Cancel a job (runner.queue.cancel); a hypothesis whose last open job this was is concluded."""
    from runner.conclude import conclude_if_done
    from runner.queue import cancel as cancel_job
    job = cancel_job(kb.engine, job_id)
    if job["status"] == "cancelled":
        conclude_if_done(kb, job["hypothesis"])
    return job
