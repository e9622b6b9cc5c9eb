"""`kb demo`: a real example history on the embedded default, with hypotheses and a finished job,
served in the UI.

    kb demo                      # load the shipped history, propose, run one job, serve http://127.0.0.1:8000/ui/
    kb demo --fresh              # train the history again with the proxy trainer (about a minute on 2 cores)
    kb demo --no-serve           # build it and print what it holds, then exit (tests, scripts)
    kb demo --json               # the same, as JSON

The history is 21 proxy-trainer runs (kb/cli/demo_build.py, runner/demo_history.py): a
learning-rate sweep at depths 1 and 2 whose lr=1 runs diverged, a learned-vs-rope ablation with
three seeds a side, a data-mixture variation, and a postmortem and a sweep summary as notes.
Progress goes to stderr, a line a stage with its time; the summary and the URL to stdout.
Running it again in the same home adds nothing: runs and notes are stored by content hash,
and hypotheses are proposed and run once.
"""
from __future__ import annotations

import click

from kb.cli.output import emit_json, num, table

SEARCH = "which learning rate diverged, and why?"


def register(cli: click.Group) -> None:
    cli.add_command(demo)


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to serve the UI on; 0 picks a free one.")
@click.option("--no-serve", is_flag=True, help="Build the demo and print its summary, then exit.")
@click.option("--fresh", is_flag=True, help="Train the history again (into the home) instead of loading the shipped one.")
@click.option("--open", "open_browser", is_flag=True, help="Open the UI in a browser once it is served.")
@click.option("--json", "as_json", is_flag=True, help="Build, print a JSON summary and exit (implies --no-serve).")
@click.pass_obj
def demo(obj, port, no_serve, fresh, open_browser, as_json):
    """Build a real example history (proxy-trainer runs, an ablation, notes, hypotheses, a job) and serve the UI."""
    from kb.cli.demo_build import MIX_PROJECT, PROJECT, Stages

    k = obj.kb()
    steps = Stages(k, say=lambda text: click.echo(text, err=True))
    report = steps.load(steps.history(fresh=fresh))
    steps.index()
    hypotheses = steps.propose()
    ran = steps.run_one(hypotheses)
    steps.index()                      # the job's runs and the ablations they formed
    facts = _facts(k, PROJECT, MIX_PROJECT, ran)
    if as_json:
        emit_json({"ingest": report.as_dict(), "counts": k.count(), **facts, "timings": steps.timings})
        return
    _print_summary(k, report, facts)
    if no_serve:
        return
    from kb.cli.serve import run_server

    def ready(url: str) -> None:
        steps.say("serving the UI (Ctrl-C stops it)")
        click.echo(f"\nopen {url}/ui/\n{TRY}")

    run_server(obj, "127.0.0.1", port, ui=True, open_browser=open_browser, before=ready)


TRY = """  Runs        filter `status = 'diverged'`, open d1-lr1 for its curve and failure
  Failures    both lr=1 runs, with the step and the loss that stopped them
  Scaling     val/loss against params over the sweep's two depths
  Hypotheses  the proposals waiting for review: approve or reject them
  Jobs        the hypothesis the demo ran, with its verdict against seed noise
  Chat        "Why did d1-lr1 diverge?" or "which lr gave the lowest val/loss at depth 2?\""""


def _facts(k, project: str, mix_project: str, ran: dict | None) -> dict:
    """What the demo holds, as the JSON summary and the printed one read it."""
    diverged = k.runs(where="status = 'diverged' and tags.demo exists", sort="config.n_layer")
    best = k.runs(where=f"project = '{project}' and config.n_layer = 1 and status = 'completed'",
                  sort="summary.val/loss", limit=3)
    ablations = {a["id"]: a for r in k.runs(where=f"project = '{project}' and tags.demo exists")
                 for a in k.run(r.id).ablations}
    hits = k.search(SEARCH, limit=3)
    return {
        "projects": {p: len(k.runs(project=p)) for p in (project, mix_project)},
        "diverged": [r.id for r in diverged],
        "best_small": [r.id for r in best],
        "ablations": [{"id": a["id"], "factor": a["factor"], "baseline_run": a["baseline_run"],
                       "variants": a["variants"], "effect": a["effect"]} for a in ablations.values()],
        "hypotheses": [{"id": h["id"], "title": h["title"], "status": h["status"]}
                       for h in k.hypotheses(project=project)],
        "job": None if ran is None else {"hypothesis": ran["id"], "status": ran["status"], "result": ran.get("result"),
                                         "jobs": [j["id"] for j in k.jobs(hypothesis=ran["id"])]},
        "search": [h.payload.get("ref_id") for h in hits],
    }


def _print_summary(k, report, facts: dict) -> None:
    c = k.count()
    projects = ", ".join(f"{n} in {p}" for p, n in facts["projects"].items())
    click.echo(f"demo history in {k.settings.home}: {projects}; {c['notes']} note chunks "
               f"(added {report.added}, updated {report.updated}, unchanged {report.unchanged})\n")
    click.echo("$ kb runs --where \"status = 'diverged'\"")
    rows = []
    for run_id in facts["diverged"]:
        r = k.run(run_id)
        f = r.failures[0] if r.failures else {}
        rows.append([r.id, num(r.config.get("lr")), f.get("step", "-"), f.get("message", "")])
    table(rows, ["id", "lr", "step", "failure"])
    click.echo("\n$ kb runs --where \"project = 'demo-gpt' and config.n_layer = 1 and status = 'completed'\" "
               "--sort summary.val/loss --limit 3")
    table([[r.id, num(r.config.get("lr")), r.config.get("pos"), num(r.summary.get("val/loss"))]
           for r in map(k.run, facts["best_small"])], ["id", "lr", "pos", "val/loss"])
    for a in facts["ablations"]:
        sigma = (a["effect"] or {}).get("seed_sigma")
        click.echo(f"\nablation {a['id']} ({a['factor']}, baseline {a['baseline_run']}, seed sigma {num(sigma)}):")
        table([[v["value"], v.get("seeds", 1), num(v.get("metric")), num(v.get("delta")),
                {True: "yes", False: "no"}.get(v.get("exceeds_seed_spread"), "-")] for v in a["variants"]],
              ["value", "seeds", "val/loss", "delta", "beyond 2 sigma"])
    click.echo("\n$ kb hypotheses")
    table([[h["id"], h["status"], h["title"]] for h in facts["hypotheses"]], ["id", "status", "title"])
    job = facts["job"]
    if job and job["result"] and job["result"].get("effect"):
        e, res = job["result"]["effect"], job["result"]
        low, high = e["interval"]
        click.echo(f"\n{job['hypothesis']} (approved by the demo, {len(job['jobs'])} jobs): {res['outcome']}, {res['metric']} "
                   f"{e['delta']:+.3f} [{low:+.3f}, {high:+.3f}] ({e['method']})")
    click.echo(f"\n$ kb search \"{SEARCH}\"")
    hits = facts["search"]
    table([[i + 1, ref] for i, ref in enumerate(hits)], ["rank", "id"])
