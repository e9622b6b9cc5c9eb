"""`kb migrate`: bring the store's schema to this version (what a deployment runs once at start);
`kb migrate --to URL`: move this knowledge base's SQL store into another database (the team's
PostgreSQL), then point the KB_* settings at it.

    kb migrate                                            # schema at HEAD, then exit
    kb migrate --to postgresql://kb:kb@db.internal/kb
    KB_DATABASE_URL=postgresql://kb:kb@db.internal/kb KB_QDRANT_URL=http://qdrant:6333 kb reindex
"""
from __future__ import annotations

from pathlib import Path

import click

from kb.cli.output import emit_json


def register(cli: click.Group) -> None:
    cli.add_command(migrate)


@click.command()
@click.option("--to", "to_url", metavar="URL",
              help="Copy into this database (SQLAlchemy URL), which must hold no runs yet.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows copied per table as JSON.")
@click.pass_obj
def migrate(obj, to_url, as_json):
    """Bring the schema to this version; with --to, copy every run, note, ablation, hypothesis and
    job into that database, in one transaction there (the vectors are rebuilt from SQL by
    `kb reindex` against the new store)."""
    if to_url is None:
        from kb.db import HEAD
        obj.kb()                      # opening a store migrates it, under a lock other processes share
        if as_json:
            emit_json({"schema": HEAD})
        else:
            click.echo(f"schema at {HEAD}")
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from kb.db import make_engine
    from kb.errors import UnknownFormat
    from kb.store_copy import copy_store
    try:
        url = make_url(to_url)
    except ArgumentError:
        raise UnknownFormat(f"--to: {to_url!r} is not a database URL (e.g. postgresql://user@host/db)") from None
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    target = make_engine(to_url)
    try:
        copied = copy_store(obj.kb().engine, target,
                            progress=None if as_json else _progress())
    finally:
        target.dispose()
    if as_json:
        emit_json({"target": shown, "copied": copied})
        return
    click.echo(f"\ncopied {copied.get('run', 0)} runs, {copied.get('metricseries', 0)} curves, "
               f"{copied.get('note', 0)} note chunks, {copied.get('hypothesis', 0)} hypotheses and "
               f"{copied.get('job', 0)} jobs into {shown}")
    click.echo(f"next: export KB_DATABASE_URL='{shown}' (with its password), set KB_QDRANT_URL for a "
               "Qdrant server if you use one, and run `kb reindex`")


def _progress():
    last = {}

    def show(table: str, n: int) -> None:
        if last.get("table") != table:
            click.echo(f"{table} ", nl=False, err=True)
            last["table"] = table
        click.echo(".", nl=False, err=True)
    return show
