"""`kb ingest`, `kb runs`, `kb show`, `kb reindex`, `kb search`: getting runs in and finding them."""
from __future__ import annotations

import sys

import click

from kb.cli.output import emit_json, num, one_line, table

RESULT_METRICS = ("val/loss", "train/loss")     # canonical names (kb.vocab), whatever the source logged


def register(cli: click.Group) -> None:
    for cmd in (ingest, runs, show, reindex, search):
        cli.add_command(cmd)


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--format", "fmt", help="Override detection: native, mlflow, wandb, tensorboard, hf-trainer, log, notes, table.")
@click.option("--project", help="Store every run under this project.")
@click.option("--map", "maps", multiple=True, metavar="COLUMN=KEY",
              help="Tables (csv, tsv, parquet): put COLUMN at KEY (scale.params, summary.val/loss, "
                   "config.optim.lr, name, tags, ..., or - to drop it). Repeatable; an error when no "
                   "target is read as a table.")
@click.option("--no-index", is_flag=True, help="Only write SQL; leave vectors to `kb serve` or the next command.")
@click.option("--show-skipped", is_flag=True, help="List the files a folder walk skipped (not runs), with why.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout.")
@click.pass_obj
def ingest(obj, paths, fmt, project, maps, no_index, show_skipped, as_json):
    """Ingest runs and notes from PATHS (files, folders or tracking URIs)."""
    from ingest.table import parse_mapping
    mapping = parse_mapping(maps)          # a malformed --map fails before anything is opened
    k = obj.kb()
    # redrawn by the callback, not by rich's refresh thread: with a thread running, a big ingest
    # is not read by forked workers (ingest.pipeline)
    with _progress(auto_refresh=False) as bar:
        task = bar.add_task("ingesting", total=None)
        report = k.ingest(*paths, format=fmt, project=project, mapping=mapping or None, index=False,
                          progress=_redrawing(bar, task))
    if not no_index:       # also reconciles: a lost or stale index is rebuilt from SQL here
        from kb.errors import IndexUnavailable, ReadOnlyStore
        with _progress() as bar:
            task = bar.add_task("indexing", total=None)
            try:
                k.sync_index(progress=lambda done, total: bar.update(task, completed=done, total=total))
            except (IndexUnavailable, ReadOnlyStore) as exc:
                # the runs are committed; what awaits indexing stays queued in SQL for whoever can
                click.echo(f"warning: {exc}", err=True)
    if as_json:
        emit_json(report.as_dict())
    else:
        skipped = len(report.skipped)
        hint = "" if not skipped or show_skipped else " (not runs; --show-skipped lists them)"
        click.echo(f"added {report.added}, updated {report.updated}, unchanged {report.unchanged}, "
                   f"failed {len(report.failed)}, skipped {skipped}{hint}")
        if show_skipped:
            for s in report.skipped:
                click.echo(f"skipped: {s['source']}: {s['reason']}")
    for f in report.failed:
        where = f["source"] + (f":{f['line']}" if f.get("line") else "")
        click.echo(one_line(f"error: {where}: {f['field'] + ': ' if f.get('field') else ''}{f['error']}"), err=True)
    if report.failed:
        raise click.exceptions.Exit(2)


@click.command()
@click.option("--where", "where", help="Filter, e.g. \"config.optim.lr > 1e-3 or status = 'diverged'\".")
@click.option("--sort", help="Sort key, '-' prefix for descending, e.g. summary.val/loss.")
@click.option("--limit", type=click.IntRange(min=1, max=2**63 - 1), help="At most N runs.")   # SQL's LIMIT: 64 bits
@click.option("--project", help="Only this project.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def runs(obj, where, sort, limit, project, as_json):
    """List runs."""
    _check_query(where, sort)
    found = obj.kb().runs(where=where, sort=sort, limit=limit, project=project)
    if as_json:
        emit_json([r.as_dict() for r in found])
        return
    rows = []
    for r in found:
        metric = next((m for m in RESULT_METRICS if m in r.canonical), None)
        rows.append([r.id, r.project, r.name, r.status, num(r.lr), num(r.params),
                     f"{metric}={num(r.canonical[metric]['value'])}" if metric else ""])
    table(rows, ["id", "project", "name", "status", "lr", "params", "result"])
    click.echo(f"{len(found)} run(s)", err=True)


@click.command()
@click.argument("run")
@click.option("--json", "as_json", is_flag=True)
@click.option("--points/--no-points", default=False, help="With --json: include every curve point.")
@click.pass_obj
def show(obj, run, as_json, points):
    """One run: config, summary, failures, anomalies, ablations."""
    d = obj.kb().run(run)
    if as_json:
        data = d.as_dict()
        if not points:
            data["metrics"] = {k: {"points": len(v), "first": v[0], "last": v[-1]} for k, v in d.metrics.items()}
        emit_json(data)
        return
    click.echo(d.card)
    click.echo(f"source: {d.source['kind']} {d.source['uri']}")
    if d.canonical:
        click.echo("canonical: " + " ".join(f"{name}={num(c['value'])}" + ("" if c["key"].endswith("." + name) else
                                            f" ({c['key']})") for name, c in d.canonical.items()))
    for key, s in sorted(d.stats.items()):
        click.echo(f"curve {key}: {s['points']} points, steps {s['first_step']}..{s['last_step']}, "
                   f"final {num(s.get('final'))}, best {num(s.get('best'))} at {s.get('best_step', '-')}")
    for f in d.failures:
        click.echo(f"failure [{f['origin']}] {f['kind']} at step {f['step']}: {f['message']}")
        for line in (f["evidence"] or "").splitlines()[-6:]:
            click.echo(f"    | {line}")
    for a in d.anomalies:
        click.echo(f"anomaly {a['kind']} {a['key']} at step {a['step']}: {a['evidence']}")
    for a in d.ablations:
        click.echo(f"ablation {a['id']}: {a['factor']} ({a['metric']}) effect {a['effect']}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def reindex(obj, as_json):
    """Rebuild the vector index from SQL."""
    k = obj.kb()
    with _progress() as bar:
        task = bar.add_task("indexing", total=None)
        report = k.reindex(progress=lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        emit_json({"indexed": report.indexed})
    else:
        click.echo(f"indexed {report.indexed}")


@click.command()
@click.argument("text")
@click.option("--limit", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--kind", type=click.Choice(["run", "note", "failure", "ablation"]),
              help="Only records of this kind (default: runs and notes).")
@click.option("--project")
@click.option("--where", "where", help="Only runs matching this query, e.g. \"status = 'diverged'\".")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def search(obj, text, limit, kind, project, where, as_json):
    """Semantic search over run cards and notes (failures and ablations with --kind)."""
    _check_query(where, None)
    hits = obj.kb().search(text, limit=limit, where=where, kind=kind, project=project)
    if as_json:
        emit_json([{"id": h.payload.get("ref_id"), "kind": h.payload.get("kind"), "score": h.score} for h in hits])
        return
    table([[f"{h.score:.3f}", h.payload.get("kind"), h.payload.get("ref_id"), h.payload.get("label", "")]
           for h in hits], ["score", "kind", "id", "name"])


def _check_query(where: str | None, sort: str | None) -> None:
    """A malformed --where or --sort fails before the store is opened, its column counted in the
    text as typed (`--project` is added to the query later)."""
    from kb.query import parse, parse_sort
    if where:
        parse(where)
    if sort:
        parse_sort(sort)


def _short(src: str) -> str:
    return src if len(src) < 40 else "..." + src[-37:]


def _progress(auto_refresh: bool = True):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty(),
                    auto_refresh=auto_refresh)


def _redrawing(bar, task, every_s: float = 0.1):
    """A progress callback that updates the bar and redraws it at most every `every_s`."""
    import time
    last = 0.0

    def update(source: str, done: int) -> None:
        nonlocal last
        bar.update(task, completed=done, description=_short(source))
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            bar.refresh()
    return update
