"""`kb demo`: build an example history on the embedded default and show what the store holds."""
from __future__ import annotations

import click

from kb.cli.output import emit_json, num, table


def register(cli: click.Group) -> None:
    cli.add_command(demo)


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def demo(obj, as_json):
    """Ingest an example pretraining history, then query it the way a researcher would."""
    from kb.demo import example_history

    k = obj.kb()
    files = example_history(k.settings.home / "example")
    report = k.ingest(*map(str, files))
    diverged = k.runs(where="status = 'diverged'")
    best = k.runs(where="project = 'gpt-sweep' and scale.params < 1e8", sort="summary.val/loss", limit=3)
    hits = k.search("which learning rate diverged after warmup?", limit=3)
    if as_json:
        emit_json({"ingest": report.as_dict(), "counts": k.count(),
                   "diverged": [r.id for r in diverged], "best_small": [r.id for r in best],
                   "search": [h.payload.get("ref_id") for h in hits]})
        return
    c = k.count()
    click.echo(f"example history in {k.settings.home}: {c['runs']} runs, {c['notes']} note chunks "
               f"(added {report.added}, unchanged {report.unchanged})\n")
    click.echo("$ kb runs --where \"status = 'diverged'\"")
    table([[r.id, r.status, num(r.config['optim']['lr'])] for r in diverged], ["id", "status", "lr"])
    click.echo("\n$ kb runs --where \"project = 'gpt-sweep' and scale.params < 1e8\" --sort summary.val/loss --limit 3")
    table([[r.id, num(r.config['optim']['lr']), num(r.summary.get('val/loss'))] for r in best],
          ["id", "lr", "val/loss"])
    click.echo("\n$ kb search \"which learning rate diverged after warmup?\"")
    table([[f"{h.score:.3f}", h.payload.get("kind"), h.payload.get("ref_id")] for h in hits],
          ["score", "kind", "id"])
    click.echo("\nnext: kb show base-lr0.001   |   kb runs --where \"tags.baseline exists\"")
