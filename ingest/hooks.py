"""What `kb track -- CMD...` stores: the native record of a finished subprocess, read from its log.

    record = command_record(argv, returncode, log_text, run_id=..., name=..., ...)
    kb.tracking.store(k, record, source=...)          # kb/cli/track.py runs CMD and does this

The log is read by the log ingester's parser (ingest.logs.parse_log), which is why this lives
in ingest/ and not with the in-process hooks in kb/tracking.py.
"""
from __future__ import annotations

import shlex
import signal
from datetime import datetime
from pathlib import Path

from ingest.logs import parse_log
from kb.tracking import merge, provenance

LINE_CAP = 500


def command_name(argv: list[str]) -> str:
    """A run name from a command line: the script's stem (`python train.py` -> train)."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            return Path(arg).stem
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1].rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv else "run"


def command_record(argv: list[str], returncode: int, log_text: str, *, run_id: str, name: str,
                   project: str, config: dict, started: datetime, ended: datetime, cwd: str,
                   pid: int, interrupted: int | None = None, log_path: str | None = None,
                   tail_lines: int = 200) -> dict:
    """The native record of a command that ran to its end, from its exit status and its log.

    Status: a loss that went NaN/Inf in the log -> diverged; a signal kb track forwarded
    (Ctrl-C) -> killed; death by a signal (negative return code, or 128+N from a shell)
    -> killed, naming the signal; exit 0 -> completed; any other exit -> failed, with the
    failure classified from the log (exception, oom, nccl_timeout, ...) or `other`."""
    parsed = parse_log(log_text, name)
    lines = log_text.splitlines()
    found = parsed.get("failure")
    steps = [p[0] for pts in parsed["metrics"].values() for p in pts]
    last = max(steps) if steps else None
    tail = "\n".join(x[:LINE_CAP] for x in lines[-8:])
    signalled = -returncode if returncode < 0 else returncode - 128 if 128 < returncode <= 128 + 64 else None

    if found and found["kind"] == "diverged":
        status, failure = "diverged", found
    elif interrupted is not None:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"interrupted: kb track forwarded {signal_name(interrupted)}"}
    elif returncode < 0:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"killed by {signal_name(-returncode)}"}
    elif returncode == 0:
        status, failure = "completed", None
    elif found:
        status, failure = parsed["status"], found
    elif signalled:
        status, failure = "killed", {"kind": "killed", "step": last, "evidence": tail,
                                     "message": f"exit code {returncode} (128 + {signal_name(signalled)})"}
    else:
        status, failure = "failed", {"kind": "other", "step": last, "evidence": tail,
                                     "message": f"exited with code {returncode}"}

    # a script that printed its own source keeps it (parse_log's code.source and its hash)
    code = {**parsed.get("code", {}), "argv": list(argv),
            "entrypoint": next((a for a in argv if a.endswith(".py")), argv[0]), **provenance(cwd)}
    meta = {**{k: v for k, v in parsed["meta"].items() if k != "log_tail"},
            "hook": "kb track", "exit_code": returncode, "pid": pid,
            "duration_s": round((ended - started).total_seconds(), 3),
            "log_tail": "\n".join(x[:LINE_CAP] for x in lines[-tail_lines:])}
    if returncode < 0:
        meta["signal"] = signal_name(-returncode)
    if log_path:
        meta["log_path"] = log_path
    record = {"id": run_id, "project": project, "name": name, "status": status,
              "config": merge(parsed["config"], config) or {"command": shlex.join(argv)},
              "metrics": parsed["metrics"], "started_at": started.isoformat(), "ended_at": ended.isoformat(),
              "code": code, "meta": meta}
    if failure:
        record["failure"] = failure
    return record


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
