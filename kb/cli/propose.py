"""`kb propose`, `kb approve`, `kb reject`, `kb hypotheses`: the proposer and the human gate.

    kb propose --goal "lower val/loss" -n 3 --project gpt-sweep
    kb approve hyp-1a2b3c4d5e --reason "cheap, clear ablation"     # --by defaults to $USER
    kb hypotheses --status proposed --json
"""
from __future__ import annotations

import os

import click

from kb.cli.output import emit_json, num, table


def register(cli: click.Group) -> None:
    for cmd in (propose, approve, reject, hypotheses):
        cli.add_command(cmd)


@click.command()
@click.option("--goal", default="", help='What to improve, e.g. "lower val/loss at fixed compute" (names the metric).')
@click.option("-n", "n", type=int, default=3, show_default=True, help="Hypotheses to propose at most.")
@click.option("--project", help="Propose changes to this project's runs only.")
@click.option("--metric", help="The metric to improve (default: the one the goal names, else val/loss).")
@click.option("--budget-runs", type=int, default=None, help="Most training runs one validation plan may take (default 8).")
@click.option("--budget-flops", type=float, default=None, help="Most FLOPs one validation plan may take.")
@click.option("--json", "as_json", is_flag=True, help="The stored hypotheses: a list of SPEC's Hypothesis.")
@click.pass_obj
def propose(obj, goal, n, project, metric, budget_runs, budget_flops, as_json):
    """Propose grounded hypotheses from the runs; each is stored with status `proposed`."""
    options = {k: v for k, v in (("metric", metric), ("budget_runs", budget_runs),
                                 ("budget_flops", budget_flops)) if v is not None}
    found = obj.kb().propose(goal=goal, n=n, project=project, **options)
    if as_json:
        emit_json(found)
        return
    for i, h in enumerate(found):
        if i:
            click.echo("")
        _describe(h)


def _describe(h: dict) -> None:
    p, plan = h["predicted"], h["plan"] or {}
    click.echo(f"{h['id']}  [{h['source']}] {h['title']}")
    click.echo(f"  change:    {', '.join(f'{k} = {v!r}' for k, v in h['change'].items())} on {h['baseline_run']}")
    low, high = p["interval"]
    level = f"{p['level']:.0%} " if p.get("level") else ""
    click.echo(f"  predicted: {p['metric']} {p['delta']:+.4g} ({level}interval {low:+.4g} to {high:+.4g}); {p['method']}")
    click.echo(f"  why:       {h['rationale']}")
    click.echo(f"  evidence:  {', '.join(h['evidence'])}")
    for r in h["risks"] or ["none found in the failures on record"]:
        click.echo(f"  risk:      {r}")
    if plan:
        scales = ", ".join(num(s.get("params")) for s in plan.get("scales", []))
        click.echo(f"  plan:      {plan['seeds']} seeds at params {scales}, {num(plan.get('steps'))} steps, "
                   f"{plan['runs']} runs{'' if plan.get('fits_budget', True) else ' (over budget)'}: {plan['why']}")


def _who(by: str | None) -> str:
    # the edge reads the environment, as the contract's default says: $USER
    return by or os.environ.get("USER") or os.environ.get("LOGNAME") or ""


def _decision(status: str):
    verb = "approve" if status == "approved" else "reject"

    @click.command(name=verb, help=f"Record the human decision to {verb} HYPOTHESIS, with who and why.")
    @click.argument("hypothesis")
    @click.option("--by", help="Who decides (default: $USER).")
    @click.option("--reason", default="", help="Why, for whoever reads the history later.")
    @click.option("--json", "as_json", is_flag=True, help="The hypothesis after the decision.")
    @click.pass_obj
    def decide(obj, hypothesis, by, reason, as_json):
        k = obj.kb()
        h = (k.approve if status == "approved" else k.reject)(hypothesis, by=_who(by), reason=reason)
        if as_json:
            emit_json(h)
        else:
            d = h["decision"]
            click.echo(f"{h['id']} {status} by {d['by']} at {d['at']}" + (f": {d['reason']}" if d["reason"] else ""))
    return decide


approve = _decision("approved")
reject = _decision("rejected")


@click.command()
@click.option("--status", help="Only hypotheses with this status (proposed, approved, rejected, ...).")
@click.option("--project", help="Only this project's hypotheses.")
@click.option("--json", "as_json", is_flag=True, help="A list of SPEC's Hypothesis.")
@click.pass_obj
def hypotheses(obj, status, project, as_json):
    """List hypotheses, newest first."""
    found = obj.kb().hypotheses(status=status, project=project)
    if as_json:
        emit_json(found)
        return
    if not found:
        click.echo("no hypotheses" + (f" with status {status}" if status else ""))
        return
    rows = []
    for h in found:
        p = h["predicted"] or {}
        effect = f"{p['delta']:+.3g}" if isinstance(p.get("delta"), (int, float)) else "-"
        rows.append([h["id"], h["status"], h["project"] or "-", h["source"] or "-",
                     f"{p.get('metric', '')} {effect}".strip(), h["title"][:70]])
    table(rows, ["id", "status", "project", "source", "predicted", "title"])
