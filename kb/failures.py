"""How a run failed: one `Failure` shape, found in a log's lines or in a raised exception.

    f = classify(lines, ranks, events)     # from a training log (ingest.logs scans it first)
    f = from_exception(exc, step)          # from the exception that ended a tracked run
    record["failure"] = f.as_dict()        # native records take plain dicts

Kinds found in logs: hardware (Xid, ECC, a GPU fallen off the bus), oom, nccl_timeout,
diverged (a loss went NaN/Inf), timeout (a scheduler's time limit), exception (a Python
traceback), killed (a kill signal at the end of the log), other (a segfault, an abort).

Which one is the cause when a log shows several: hardware explains whatever follows it;
else the earliest of oom / diverged / nccl_timeout / timeout; else the last real traceback
(a launcher's ChildFailedError only reports a child that died elsewhere); else a crash or a
kill signal near the end of the log.

Pure functions of their input; used by the log ingester, `kb track` and the runner.
"""
from __future__ import annotations

import math
import re
import traceback
from dataclasses import asdict, dataclass

EVIDENCE_LINES = 8           # lines of a log kept as evidence
EVIDENCE_CHARS = 4000        # a traceback's tail; a recursion error's full repr is megabytes
MESSAGE_CHARS = 500
LINE_CAP = 300               # evidence lines are trimmed: a tensor repr can be megabytes
TAIL_LINES = 50              # a kill signal counts only this near the end of a log

# (line index, step, {metric: value}): the metric lines a log parser found, steps filled in
Event = tuple[int, "int | None", dict]


@dataclass(frozen=True)
class Failure:
    kind: str                # see FailureKind in kb/records.py
    step: int | None         # the last step the run reached before it failed
    message: str             # one line a person reads first: "RuntimeError: CUDA out of memory ..."
    evidence: str = ""       # the lines that show it: a traceback's tail, the log lines around it

    def as_dict(self) -> dict:
        return asdict(self)


# ---- from an exception ------------------------------------------------------------------------

def from_exception(exc: BaseException, step: int | None) -> Failure:
    """KeyboardInterrupt -> killed, anything else -> exception; message "Type: msg"."""
    kind = "killed" if isinstance(exc, KeyboardInterrupt) else "exception"
    text = str(exc)
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    evidence = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure(kind, step, message[:MESSAGE_CHARS], evidence[-EVIDENCE_CHARS:])


# ---- signatures in log lines (matched per line, rank prefix removed) ----------------------------

HARDWARE = re.compile(r"\bXid\b|\bECC error|uncorrectable|double[- ]bit|fallen off the bus|GPU is lost"
                      r"|NVLink error", re.I)
OOM = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|RESOURCE_EXHAUSTED", re.I)
NCCL = re.compile(r"Watchdog caught collective operation timeout|NCCL watchdog|collective operation timeout"
                  r"|ProcessGroupNCCL.*timed out|\bNCCL (?:error|timeout)\b|\bnccl\w*Error\b"
                  r"|NCCL communicator was aborted|DistBackendError", re.I)
DIVERGED = re.compile(r"\bloss\b.{0,30}?(?:\b(?:is|became|went)\b|[=:])\s*[-+]?(?:nan|inf)\b|\bnan loss\b"
                      r"|non-finite loss|\bloss (?:has )?diverged\b", re.I)
TIMEOUT = re.compile(r"DUE TO TIME LIMIT|time limit (?:exceeded|reached)", re.I)
CRASH = re.compile(r"Segmentation fault|core dumped|\bSIGSEGV\b|\bSIGABRT\b|^Aborted\b")
KILLED = re.compile(r"\bKilled\b|\bSIG(?:KILL|TERM|INT|HUP)\b|exited with signal|(?:terminated|killed) by signal"
                    r"|received signal|Signal \d+ \(SIG\w+\)|\bCANCELLED\b|exitcode: -9")
SIGNATURES = (("hardware", HARDWARE), ("oom", OOM), ("nccl_timeout", NCCL), ("diverged", DIVERGED),
              ("timeout", TIMEOUT), ("other", CRASH), ("killed", KILLED))
FATAL = re.compile("|".join(p.pattern for _, p in SIGNATURES) + r"|Traceback \(most recent call last\)", re.I)
TRACEBACK = "Traceback (most recent call last):"
EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
WRAPPERS = ("ChildFailedError",)     # torchrun's summary of a child that died: the cause is elsewhere


def trim(line: str) -> str:
    line = line.rstrip()
    return line if len(line) <= LINE_CAP else line[:LINE_CAP] + " ..."


def tracebacks(lines: list[str], ranks: list[int | None]) -> list[tuple[int, int, str]]:
    """Every Python traceback as (first line, exception line, exception text); frames of one rank only."""
    out = []
    for t, text in enumerate(lines):
        if not text.lstrip().startswith(TRACEBACK):
            continue
        for j in range(t + 1, min(len(lines), t + 500)):
            if ranks[j] != ranks[t]:
                continue                        # another rank's output interleaved with this one
            body = lines[j]
            if not body.strip() or body[:1].isspace():
                continue                        # frames are indented
            if EXC_LINE.match(body.strip()) and not body.startswith(("During handling", "The above exception")):
                out.append((t, j, body.strip()))
            break
    return out


def step_before(events: list[Event], index: int) -> int | None:
    """The last step a metric line reported at or before line `index`."""
    step = None
    for i, s, _ in events:
        if i > index:
            break
        if s is not None:
            step = s
    return step


def evidence(lines: list[str], ranks: list[int | None], index: int, blocks: list[tuple[int, int, str]]) -> str:
    """The traceback holding line `index` (its last lines, one rank's), else the lines around it."""
    for start, end, _ in blocks:
        if start <= index <= end:
            body = [lines[k] for k in range(start, end + 1) if lines[k].strip() and ranks[k] == ranks[start]]
            return "\n".join(trim(x) for x in body[-EVIDENCE_LINES:])
    near = [lines[k] for k in range(max(0, index - 1), min(len(lines), index + 3)) if lines[k].strip()]
    return "\n".join(trim(x) for x in near)


def classify(lines: list[str], ranks: list[int | None] | None = None,
             events: list[Event] | None = None) -> Failure | None:
    """How a log says its run ended badly, or None.

    `lines` without rank prefixes, `ranks` the rank each line came from (None: unprefixed),
    `events` the metric lines found in them (a loss that went NaN there is a divergence)."""
    ranks = ranks if ranks is not None else [None] * len(lines)
    events = events or []
    blocks = tracebacks(lines, ranks)
    hits: dict[str, int] = {}
    metric_lines = {i for i, _, _ in events}
    # a signal ends a run, so it counts only near the end ("installed SIGTERM handler" at the top does not)
    tail = len(lines) - TAIL_LINES
    for i, text in enumerate(lines):
        if i in metric_lines or not FATAL.search(text):      # a metric line's NaN is read from its values
            continue
        for kind, pattern in SIGNATURES:
            if kind not in hits and pattern.search(text) and (i >= tail or kind not in ("other", "killed")):
                hits[kind] = i
    nonfinite = next(((i, s, n, v) for i, s, vals in events for n, v in vals.items()
                      if n.endswith("loss") and not math.isfinite(v)), None)
    if nonfinite and "hardware" not in hits and nonfinite[0] <= hits.get("diverged", nonfinite[0]):
        i, step, name, value = nonfinite
        prior = [lines[k] for k, s, _ in events if k < i][-1:]
        return Failure("diverged", step, f"{name} is {value} at step {step}",
                       "\n".join(trim(x) for x in prior + [lines[i]]))
    # hardware explains what follows it; among the rest the earliest in the log is the cause
    root = ["hardware"] if "hardware" in hits else []
    root = root or sorted((k for k in ("oom", "diverged", "nccl_timeout", "timeout") if k in hits), key=hits.get)[:1]
    if root:
        i = hits[root[0]]
        # raised inside a traceback: the error happened before its first line was printed, and the
        # exception line says it better than the frame's source line that happened to match
        block = next(((start, exc) for start, end, exc in blocks if start <= i <= end), None)
        at, message = block if block else (i, lines[i].strip())
        return Failure(root[0], step_before(events, at), trim(message), evidence(lines, ranks, i, blocks))
    real = [b for b in blocks if not any(w in b[2].split(":")[0] for w in WRAPPERS)]
    if real:
        start, end, exc = real[-1]
        kind = "killed" if exc.split(":")[0].endswith("KeyboardInterrupt") else "exception"
        return Failure(kind, step_before(events, start), trim(exc), evidence(lines, ranks, end, blocks))
    for kind in ("other", "killed"):
        if kind in hits:
            i = hits[kind]
            return Failure(kind, step_before(events, i), trim(lines[i].strip()), evidence(lines, ranks, i, blocks))
    if blocks:          # only a launcher's wrapper traceback: still an exception
        start, end, exc = blocks[-1]
        return Failure("exception", step_before(events, start), trim(exc), evidence(lines, ranks, end, blocks))
    return None
