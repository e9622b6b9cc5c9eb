"""The `kb` command. Each command group lives in its own module; errors become exit codes here.

Exit codes: 0 ok, 1 runtime failure, 2 bad input or usage.
"""
from __future__ import annotations

import logging
import sys

import click

from kb.errors import IndexBusy, InvalidRecord, KBError, NotFound, QueryError, UnknownFormat

BAD_INPUT = (InvalidRecord, QueryError, UnknownFormat, NotFound)


class Context:
    """What every command gets: the settings (flags over KB_* variables) and a lazily opened store."""

    def __init__(self, overrides: dict):
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        self._kb = None

    @property
    def settings(self):
        from kb.settings import Settings
        return Settings(**self.overrides)

    def kb(self):
        if self._kb is None:
            from kb.api import KnowledgeBase
            self._kb = KnowledgeBase.open(self.settings)
        return self._kb

    def close(self):
        if self._kb is not None:
            self._kb.close()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--home", type=click.Path(), help="Embedded storage folder (KB_HOME, default ./.kb).")
@click.option("--database-url", help="SQL store URL (KB_DATABASE_URL), e.g. postgresql+psycopg://u@h/db.")
@click.option("-v", "--verbose", is_flag=True, help="Log what happens to stderr.")
@click.pass_context
def cli(ctx, home, database_url, verbose):
    """pretrain-kb: every run's hyperparameters, curves, failures and ablations, queryable."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = Context({"home": home, "database_url": database_url})
    ctx.call_on_close(ctx.obj.close)


def _register() -> None:
    from kb.cli import ask, demo, runs, track
    for module in (runs, ask, track, demo):
        module.register(cli)


def main(argv: list[str] | None = None) -> int:
    _register()
    try:
        # without standalone mode click returns a command's Exit code instead of exiting
        rc = cli.main(args=argv, prog_name="kb", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return 2
    except BAD_INPUT as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except IndexBusy as exc:
        click.echo(f"error: {exc}", err=True)
        return 1
    except KBError as exc:
        click.echo(f"error: {exc}", err=True)
        return 1
    return rc if isinstance(rc, int) else 0


def run() -> None:
    sys.exit(main())
