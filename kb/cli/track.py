"""`kb track -- CMD...` and `kb watch DIR`: runs recorded as they happen, without touching the script.

    kb track --project gpt-small --config cfg.yaml -- python train.py --lr 3e-4
    kb watch runs/ --quiet-seconds 120

`kb track` runs CMD with stdout and stderr merged, echoed live (to stderr under --json, so
stdout stays machine-readable) and written whole to a log file in the temp folder; when
CMD ends it stores one run (see ingest.hooks.command_record) and exits with CMD's exit
code (128+N when CMD died by signal N), so it is transparent in scripts. CMD runs in its
own process group: a Ctrl-C reaches kb track, which forwards SIGINT once, SIGTERM on a
second Ctrl-C and SIGKILL on a third, and records the run as killed. SIGTERM and SIGHUP
sent to kb track are forwarded too. Because of the group, a CMD that reads the terminal
would be stopped; training scripts do not. Python children get PYTHONUNBUFFERED=1 so
their lines arrive (and interleave with tracebacks) as printed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from kb.cli.output import emit_json

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ESCALATE = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)     # repeated Ctrl-C presses harder


def register(cli: click.Group) -> None:
    cli.add_command(track)
    cli.add_command(watch)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--project", default="default", show_default=True, help="Store the run under this project.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="The run's config (JSON, or YAML when PyYAML is installed), merged over what the log prints.")
@click.option("--name", help="Run name (default: the script's name).")
@click.option("--no-index", is_flag=True, help="Only write SQL; leave vectors to `kb serve` or the next command.")
@click.option("--json", "as_json", is_flag=True, help="Print the stored run on stdout; CMD's output goes to stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def track(obj, project, config_file, name, no_index, as_json, command):
    """Run COMMAND (after `--`) and store its run when it ends, however it ends.

    Exits with COMMAND's exit code; prints the stored run id to stderr."""
    from ingest.hooks import command_name, command_record
    from kb.errors import InvalidRecord, KBError
    from kb.tracking import new_run_id, source_uri, store, utcnow

    argv = list(command)
    config = load_config(config_file) if config_file else {}
    name = name or command_name(argv)
    k = obj.kb()          # before the run: a misconfigured store should fail now, not after a week
    started = utcnow()
    run_id = new_run_id(name, started)
    log_path = Path(tempfile.gettempdir()) / f"kb-track-{run_id}.log"
    sink = sys.stderr.buffer if as_json else sys.stdout.buffer
    t0 = time.monotonic()
    try:
        pid, returncode, interrupted = run_teed(argv, sink, log_path)
    except OSError as exc:
        click.echo(f"kb track: cannot run {argv[0]}: {exc.strerror or exc}", err=True)
        raise click.exceptions.Exit(127)
    ended = utcnow()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    record = command_record(argv, returncode, text, run_id=run_id, name=name, project=project, config=config,
                            started=started, ended=ended, cwd=os.getcwd(), pid=pid, interrupted=interrupted,
                            log_path=str(log_path))
    exit_code = returncode if returncode >= 0 else 128 - returncode
    try:
        stored = store(k, record, source=source_uri(record["code"]["host"], pid, started), index=not no_index)
    except (InvalidRecord, KBError) as exc:
        click.echo(f"kb track: error: {exc}", err=True)
        raise click.exceptions.Exit(exit_code or (2 if isinstance(exc, InvalidRecord) else 1))
    failure = record.get("failure")
    what = record["status"] + (f", {failure['kind']}: {failure['message']}" if failure else "")
    click.echo(f"kb track: stored run {stored} ({what}); log {log_path} "
               f"[{time.monotonic() - t0:.1f}s, exit {exit_code}]", err=True)
    if as_json:
        emit_json({"id": stored, "status": record["status"], "exit_code": exit_code,
                   "failure": failure, "log": str(log_path), "duration_s": record["meta"]["duration_s"]})
    if exit_code:
        raise click.exceptions.Exit(exit_code)


def run_teed(argv: list[str], sink, log_path: Path) -> tuple[int, int, int | None]:
    """Run argv, copying its merged output to `sink` and `log_path` as it comes.

    Returns (pid, return code, first signal forwarded or None)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc: subprocess.Popen | None = None
    forwarded: list[int] = []

    def forward(signum, _frame):
        forwarded.append(signum)
        presses = sum(1 for s in forwarded if s == signal.SIGINT)
        sig = ESCALATE[min(presses, len(ESCALATE)) - 1] if signum == signal.SIGINT else signum
        if proc is not None:
            print(f"\nkb track: sending {signal.Signals(sig).name} to {proc.pid}", file=sys.stderr, flush=True)
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass            # already gone; its exit status tells the rest

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                    process_group=0)
            if forwarded:       # Ctrl-C while it was starting: it never saw the signal
                os.killpg(proc.pid, signal.SIGINT)
            fd = proc.stdout.fileno()
            while chunk := os.read(fd, 65536):
                log_file.write(chunk)
                if sink is not None:
                    try:
                        sink.write(chunk)
                        sink.flush()
                    except (BrokenPipeError, ValueError):
                        sink = None        # `kb track ... | head`: keep recording, stop echoing
            proc.stdout.close()
            returncode = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return proc.pid, returncode, (forwarded[0] if forwarded else None)


def load_config(path: str) -> dict:
    from kb.errors import InvalidRecord

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRecord(f"cannot read: {exc.strerror or exc}", source=path) from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise InvalidRecord("reading YAML needs PyYAML (pip install pyyaml); or give JSON", source=path) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise InvalidRecord(f"invalid YAML: {getattr(exc, 'problem', exc)}", source=path,
                                line=mark.line + 1 if mark else None) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRecord(f"invalid JSON: {exc.msg} (column {exc.colno})", source=path,
                                line=exc.lineno) from None
    if not isinstance(data, dict):
        raise InvalidRecord(f"a config is a mapping, got {type(data).__name__}", source=path)
    return data


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--quiet-seconds", type=float, default=60.0, show_default=True,
              help="A run whose files have not changed for this long is finished.")
@click.option("--interval", type=float, default=10.0, show_default=True, help="Seconds between scans.")
@click.option("--once", is_flag=True, help="Scan once and exit (exit 2 if a record was rejected).")
@click.option("--project", help="Store every run under this project.")
@click.option("--no-index", is_flag=True, help="Only write SQL; leave vectors to `kb serve` or the next command.")
@click.option("--json", "as_json", is_flag=True, help="A JSON report per scan (one line each without --once).")
@click.pass_obj
def watch(obj, directory, quiet_seconds, interval, once, project, no_index, as_json):
    """Ingest runs under DIRECTORY once they have finished.

    Each entry of DIRECTORY is a run (a folder holding only folders is a folder of runs).
    A run is finished when its files were quiet for --quiet-seconds, or it wrote an end
    marker: a _SUCCESS or DONE file, an HF trainer_state.json at max_steps, a W&B exit
    record. Unchanged runs are skipped without being read (state in KB_HOME/watch-state.json)."""
    from ingest.watch import Watcher
    from kb.errors import IndexUnavailable, ReadOnlyStore

    k = obj.kb()
    watcher = Watcher(k, directory, quiet_seconds=quiet_seconds, project=project)
    try:
        while True:
            report = watcher.scan_once()
            if report.ingested and not no_index:
                try:
                    k.sync_index()
                except (IndexUnavailable, ReadOnlyStore) as exc:
                    # the runs are stored; what awaits indexing stays queued in SQL for whoever can
                    click.echo(f"warning: {exc}", err=True)
                # a watcher runs for days: let go of the embedded index between scans
                k.close()
            _print_scan(report, as_json, once)
            if once:
                if report.failed:
                    raise click.exceptions.Exit(2)
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("kb watch: stopped", err=True)


def _print_scan(report, as_json: bool, once: bool) -> None:
    for f in report.failed:
        where = f["source"] + (f":{f['line']}" if f.get("line") else "")
        click.echo(f"error: {where}: {f['field'] + ': ' if f.get('field') else ''}{f['error']}", err=True)
    data = report.as_dict()
    if as_json:
        if once:
            emit_json(data)
        elif report.ingested or report.failed:
            click.echo(json.dumps(data, default=str))
        return
    for item in report.ingested:
        click.echo(f"ingested {item['path']}: added {item['added']}, updated {item['updated']}, "
                   f"unchanged {item['unchanged']} ({item['reason']})")
    if once:
        click.echo(f"ingested {len(report.ingested)}, waiting {len(report.waiting)}, "
                   f"unchanged {report.unchanged}, ignored {len(report.ignored)}", err=True)
