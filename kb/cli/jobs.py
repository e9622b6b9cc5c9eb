"""`kb submit`, `kb worker`, `kb jobs`, `kb cancel`: proxy trainings through the job queue.

    kb submit hyp-1a2b3c4d5e --backend local          # an approved hypothesis's plan
    kb submit --config tiny.yaml --seeds 3            # one ad-hoc config, three seeds
    kb worker --once                                  # run what is queued, then exit
    kb jobs --status running
    kb cancel job-0123456789ab
"""
from __future__ import annotations

import sys

import click

from kb.cli.output import emit_json, num, table


def register(cli: click.Group) -> None:
    for cmd in (submit, worker, jobs, cancel):
        cli.add_command(cmd)


@click.command()
@click.argument("hypothesis", required=False)
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="A training config (YAML or JSON; runner/options.py names its keys) to run as one job.")
@click.option("--backend", default="local", show_default=True, help="local | ray | slurm | inline.")
@click.option("--scales", help="Parameter counts to run at, comma-separated (e.g. 2e5,1e6); default: the plan's.")
@click.option("--seeds", type=int, help="Seeds per side and scale (default: the plan's; a config: 1).")
@click.option("--project", help="A config's project (default: the file's `project`, else proxy).")
@click.option("--name", help="A config's run name.")
@click.option("--max-attempts", type=int, help="Attempts per job before it fails (default KB_JOB_MAX_ATTEMPTS, 3).")
@click.option("--json", "as_json", is_flag=True, help="The jobs queued: a list of SPEC's Job.")
@click.pass_obj
def submit(obj, hypothesis, config_file, backend, scales, seeds, project, name, max_attempts, as_json):
    """Queue proxy trainings: HYPOTHESIS's plan (it must be approved), or --config FILE."""
    from kb.cli.track import load_config
    from runner.backends import check_backend
    from runner.scales import parse_scales

    if (hypothesis is None) == (config_file is None):
        raise click.UsageError("give a HYPOTHESIS id or --config FILE, one of them")
    if max_attempts is not None and max_attempts < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max-attempts")
    check_backend(backend)
    scale_list = parse_scales(scales)
    options = {k: v for k, v in (("max_attempts", max_attempts),) if v is not None}
    k = obj.kb()
    if hypothesis is not None:
        if project or name:
            raise click.UsageError("--project and --name are for --config; a hypothesis names its own")
        queued = k.submit(hypothesis, backend=backend, scales=scale_list, seeds=seeds, **options)
    else:
        config = load_config(config_file)
        queued = k.submit(config=config, backend=backend, scales=scale_list, seeds=seeds, project=project,
                          name=name, **options)
    if as_json:
        emit_json(queued)
        return
    _table(queued)
    waiting = sum(j["status"] == "queued" for j in queued)
    held = sum(j["status"] == "succeeded" for j in queued)
    click.echo(f"{waiting} job(s) queued on {backend}" + (f"; {held} answered by runs the store holds" if held else "")
               + (f". Run them: kb worker --backend {backend}" if waiting else ""))


@click.command()
@click.option("--backend", default="local", show_default=True, help="local | ray | slurm | inline.")
@click.option("--once", is_flag=True, help="Work until nothing is queued or running here, then exit.")
@click.option("--slots", type=int, help="Jobs at once (default: one per GPU, one on CPU; ray: the cluster's GPUs).")
@click.option("--max-jobs", type=int, help="Start at most this many jobs, then exit when they end.")
@click.option("--job", "job_id", help="Run this one job in this process (what backends start).")
@click.option("--token", help="The lease a dispatcher handed over with --job.")
@click.option("--json", "as_json", is_flag=True, help="The jobs finished here: a list of SPEC's Job.")
@click.pass_obj
def worker(obj, backend, once, slots, max_jobs, job_id, token, as_json):
    """Execute queued jobs and write their runs back; Ctrl-C puts running jobs back in the queue."""
    from runner.backends import check_backend
    check_backend(backend)
    if token and not job_id:
        raise click.UsageError("--token goes with --job")
    for flag, value in (("--slots", slots), ("--max-jobs", max_jobs)):
        if value is not None and value < 1:
            raise click.BadParameter("must be at least 1", param_hint=flag)
    k = obj.kb()
    with _Bars(enabled=not as_json and sys.stderr.isatty()) as bars:
        finished = k.work(backend=backend, once=once, slots=slots, max_jobs=max_jobs, job=job_id, token=token,
                          on_change=bars.show, on_progress=bars.progress)
    if as_json:
        emit_json(finished)
        return
    for j in finished:
        click.echo(f"{j['id']}  {j['status']}" + (f"  run {j['run']}" if j["run"] else "")
                   + (f"  {j['error']}" if j["error"] else ""))


class _Bars:
    """Rich progress bars, one per running job (steps done of max_steps), on a terminal only."""

    def __init__(self, enabled: bool):
        self.enabled, self.tasks, self.bars = enabled, {}, None

    def __enter__(self) -> "_Bars":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
            self.bars.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bars is not None:
            self.bars.stop()

    def show(self, running: list[dict]) -> None:
        for job in running:
            if job["progress"]:
                self.progress(job["id"], job["progress"], job.get("name"))

    def progress(self, job_id: str, progress: dict, name: str | None = None) -> None:
        if self.bars is None:
            return
        loss = (progress.get("metrics") or {}).get("val/loss")
        shown = f"val/loss {loss:.4f}" if isinstance(loss, float) else ""
        if job_id not in self.tasks:
            self.tasks[job_id] = self.bars.add_task(name or job_id, total=progress.get("max_steps"), loss=shown)
        self.bars.update(self.tasks[job_id], completed=progress.get("step", 0), loss=shown)


@click.command()
@click.option("--status", help="Only jobs with this status (queued, running, succeeded, failed, cancelled).")
@click.option("--hypothesis", help="Only this hypothesis's jobs.")
@click.option("--json", "as_json", is_flag=True, help="A list of SPEC's Job.")
@click.pass_obj
def jobs(obj, status, hypothesis, as_json):
    """List jobs, oldest first."""
    found = obj.kb().jobs(status=status, hypothesis=hypothesis)
    if as_json:
        emit_json(found)
        return
    if not found:
        click.echo("no jobs" + (f" with status {status}" if status else ""))
        return
    _table(found)


def _table(found: list[dict]) -> None:
    rows = []
    for j in found:
        p = j.get("progress") or {}
        step = f"{p['step']}/{num(p.get('max_steps'))}" if p.get("step") is not None else "-"
        status = j["status"] + (" (cancelling)" if j["cancel_requested"] and j["status"] == "running" else "")
        rows.append([j["id"], status, j["backend"], f"{j['attempts']}/{j['max_attempts']}", step,
                     j["run"] or "-", j["hypothesis"] or "-", (j["error"] or "")[:60]])
    table(rows, ["id", "status", "backend", "attempts", "step", "run", "hypothesis", "error"])


@click.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="The job after the request.")
@click.pass_obj
def cancel(obj, job, as_json):
    """Cancel JOB: a queued job at once, a running one at its next check."""
    j = obj.kb().cancel(job)
    if as_json:
        emit_json(j)
    elif j["status"] == "cancelled":
        click.echo(f"{j['id']} cancelled")
    else:
        click.echo(f"{j['id']} is running: asked to stop; it ends as cancelled at its next check")
