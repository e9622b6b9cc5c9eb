"""The `kb` command. Each command group lives in its own module; errors become exit codes here.

Exit codes: 0 ok, 1 runtime failure, 2 bad input or usage. An error is one line on stderr
(`error: ...`); `--verbose` adds the traceback.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

import click

from kb.cli.output import printable
from kb.errors import InvalidRecord, KBError, NotFound, QueryError, UnknownFormat

BAD_INPUT = (InvalidRecord, QueryError, UnknownFormat, NotFound)
MAX_MESSAGE = 500        # characters of an unexpected error's message


class Context:
    """What every command gets: the settings (flags over KB_* variables) and a lazily opened store."""

    def __init__(self, overrides: dict | None = None):
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.verbose = False
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
    if ctx.obj is None:            # invoked without main(), e.g. by click's test runner
        ctx.obj = Context()
    ctx.obj.overrides = {k: v for k, v in {"home": home, "database_url": database_url}.items() if v is not None}
    ctx.obj.verbose = verbose
    ctx.call_on_close(ctx.obj.close)


def _register() -> None:
    from kb.cli import ask, demo, jobs, loop, migrate, propose, report, runs, scaling, serve, track
    for module in (runs, ask, track, demo, scaling, propose, report, jobs, loop, serve, migrate):
        module.register(cli)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    problem = _not_utf8(args)
    if problem:
        _error(problem)
        return 2
    _register()
    context = Context()
    try:
        # without standalone mode click returns a command's Exit code instead of exiting
        rc = cli.main(args=args, prog_name="kb", standalone_mode=False, obj=context)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        _error("aborted")
        return 1
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()                   # bare `kb` or a bare group: the help is the answer
        return 2
    except click.ClickException as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) else ""
        _error(exc.format_message() + hint)
        return 2
    except BAD_INPUT as exc:
        _error(str(exc), context, multiline=True)    # a query error points at its column below
        return 2
    except KBError as exc:
        _error(str(exc), context)
        return 1
    except BrokenPipeError:
        # the reader went away (`kb runs | head`): nothing left to say, and nobody to say it to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:   # noqa: BLE001 - the edge: anything unexpected is one line, traceback on -v
        from sqlalchemy.exc import ArgumentError
        if isinstance(exc, ArgumentError):     # a database URL SQLAlchemy cannot read: the user's to fix
            _error(f"database URL (--database-url or KB_DATABASE_URL): {exc}", context)
            return 2
        _error(_describe(exc)[:MAX_MESSAGE], context)
        return 1
    return rc if isinstance(rc, int) else 0


def _not_utf8(args: list[str]) -> str | None:
    """Arguments and KB_* settings are text: bytes that are not UTF-8 (which Python carries as lone
    surrogates) would fail later, deep in SQL or JSON, so they are refused here, by position."""
    for i, arg in enumerate(args, start=1):
        if not _is_utf8(arg):
            return f"argument {i} is not valid UTF-8: {_shown(arg)}"
    for name, value in os.environ.items():
        if name.startswith("KB_") and not _is_utf8(value):
            return f"environment variable {name} is not valid UTF-8: {_shown(value)}"
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    try:
        return repr(os.fsencode(text))
    except UnicodeEncodeError:           # a lone surrogate that was never a byte
        return ascii(text)


def _describe(exc: BaseException) -> str:
    """An unexpected error in one line: what failed and the library's own words, not its traceback."""
    from sqlalchemy.exc import DBAPIError, SQLAlchemyError
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return f"database: {exc.orig}"
    if isinstance(exc, SQLAlchemyError):
        return f"database: {exc}"
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or exc}: {exc.filename}"
    return f"{type(exc).__name__}: {exc}"


def _error(message: str, context: Context | None = None, multiline: bool = False) -> None:
    if context is not None and context.verbose:
        traceback.print_exc()
    lines = [line for line in message.splitlines() if line.strip()] or ["(no message)"]
    if not multiline:
        lines = [" ".join(line.strip() for line in lines)]
    text = "\n".join(lines)
    text = printable(text)          # a message may quote bad input back
    click.echo(text if text.startswith("error:") else f"error: {text}", err=True)


def run() -> None:
    sys.exit(main())
