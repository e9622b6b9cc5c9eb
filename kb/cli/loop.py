"""`kb loop`: propose -> approve -> run -> verdict, repeated; ends with a report.

    kb loop --project tiny --config tiny.yaml --rounds 3 --approve auto
    kb loop --project gpt-sweep --budget 12 --approve manual --backend ray
"""
from __future__ import annotations

import click

from kb.cli.output import emit_json


def register(cli: click.Group) -> None:
    cli.add_command(loop)


@click.command()
@click.option("--project", help="The project to improve (default: the config's project, else proxy).")
@click.option("--goal", default="", help='What to improve, e.g. "lower val/loss" (names the metric).')
@click.option("--rounds", type=int, help="Rounds to run (default 3 when no --budget).")
@click.option("--budget", "budget_hours", type=float, help="Hours of wall time; checked between rounds.")
@click.option("--approve", type=click.Choice(["auto", "manual"]), default="auto", show_default=True,
              help="auto: the top-ranked proposal that fits the run budget; manual: wait for kb approve.")
@click.option("--backend", default="local", show_default=True, help="local | ray | slurm | inline.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="The starting baseline's training config, for a project with no runs yet.")
@click.option("-n", "n", type=int, help="Proposals per round (default 1 with auto, 3 with manual).")
@click.option("--budget-runs", type=int, default=4, show_default=True, help="Most runs per side one plan may take.")
@click.option("--poll", "poll_s", type=float, default=5.0, show_default=True,
              help="Seconds between checks for a human decision (manual).")
@click.option("--out", default="reports", show_default=True, help="Folder for the report (loop-<project>/report.md).")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON: rounds, kept, not_kept, failed runs, best.")
@click.pass_obj
def loop(obj, project, goal, rounds, budget_hours, approve, backend, config_file, n, budget_runs, poll_s, out,
         as_json):
    """Run the experiment loop on PROJECT until the rounds or the budget are spent, or proposals run dry."""
    from kb.cli.track import load_config
    config = load_config(config_file) if config_file else None
    say = (lambda text: click.echo(text, err=True)) if as_json else click.echo
    report = obj.kb().loop(project=project, goal=goal, rounds=rounds, budget_hours=budget_hours, approve=approve,
                           backend=backend, config=config, n=n, budget_runs=budget_runs, poll_s=poll_s, out=out,
                           say=say)
    if as_json:
        emit_json(report.to_json())
        return
    click.echo(f"stopped: {report.stopped}")
    click.echo(f"kept (verified at two scales): {', '.join(report.kept) or 'none'}")
    if report.best and report.best.get("outcome") == "better":
        b = report.best
        click.echo(f"best verified improvement: {b['hypothesis']} {b['change']} {b['delta']:+.4f} "
                   f"[{b['interval'][0]:+.4f}, {b['interval'][1]:+.4f}] against the starting baseline")
    click.echo(f"report: {report.markdown}")
