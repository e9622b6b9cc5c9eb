"""Text logs of training scripts: step/metric lines, printed hyperparameters, and how the run ended.

Reads the shapes people print: nanoGPT (`iter 100: loss 4.2345, time 12.3ms, mfu 1.2%`,
`step 500: train loss 3.1, val loss 3.2`), llm.c (`step 1/5000 | train loss 10.98 | norm 5.2 |
lr 6.0e-06 | (123.4 ms | 41234 tok/s)`, `val loss 3.2`), Megatron/NeMo (`iteration 100/10000 |
learning rate: 3.000E-04 | lm loss: 6.123E+00 | grad norm: 1.234 |`), torchrun/srun rank
prefixes (`[rank0]:`, `0: `), `key=value` / `key: value` lines holding a step key, JSON lines
with a step key, and MLPerf `:::MLLOG {json}` events. Printed configs (argparse `Namespace(...)`,
`key = value` blocks before the first step, nanoGPT's `Overriding: k = v`, Megatron's
`name ....... value` argument dump, JSON dumps) become the run's config, typed.

Status rule: `diverged` when a loss went NaN/Inf (printed, or a "loss is NaN" message);
`killed` for kill signals and scheduler time limits; `failed` for any other failure found
(OOM, NCCL, hardware, a Python traceback); otherwise `completed`. A log that just stops is
not assumed to be still running: whoever knows better (a hook) sets the status itself.

`parse_log(text, name)` and `classify_failure(lines)` are pure, for post-run hooks.
"""
from __future__ import annotations

import ast
import json
import math
import re
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from ingest.base import register, rejected
from kb.errors import InvalidRecord
from kb.failures import FATAL, classify, trim as _trim
from kb.records import INT64, Item, Parsed, parse_run

HEAD_BYTES = 256 * 1024      # detection reads this much of a .txt, and 8x more of a .log/.out/.err:
NAMED_HEAD_BYTES = 2 * 1024 * 1024   # Megatron's argument dump and NCCL's INFO lines come first
TAIL_LINES = 50

# a nan followed by "word:" is part of a name (Megatron's "number of nan iterations: 0")
NUM = r"[-+]?(?:nan|inf(?:inity)?)\b(?!\s+[a-z]+\s*:)|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
RANK = re.compile(r"^\s*(?:\[(?:rank|default)?(\d+)\]:|(\d+):\s|\[\d+,(\d+)\]<std(?:out|err)>:)\s?")
LEAD = re.compile(r"""^(?:\s*(?:
      \[[^\]]{0,64}\]                                            # [2024-05-01 10:00:00], [INFO]
    | \d{4}-\d\d-\d\d[T\s][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?           # ISO timestamps
    | \d\d:\d\d:\d\d(?:[.,]\d+)?
    | (?:INFO|DEBUG|WARNING|WARN|ERROR|CRITICAL)(?::[\w.]+:)?     # logging's "INFO:__main__:"
    | [-|:]
    )\s*)+""", re.X)
STEP = re.compile(r"\b(global[_ ]step|iteration|iter|step)\b\s*[:=#]?\s*\[?\s*(\d+)(?:\s*/\s*(\d+))?\]?", re.I)
PAIR = re.compile(rf"(?P<key>[A-Za-z_][\w./\-]*(?:\s[A-Za-z_][\w./\-]*){{0,4}}?)(?:\s*\((?P<paren>[^)]*)\))?"
                  rf"\s*(?:[:=]\s*|\s+)(?P<val>{NUM})(?P<unit>%|ms\b|s\b|tok/s|it/s)?", re.I)
VALUE_FIRST = re.compile(rf"^\(?\s*(?P<val>{NUM})\s*(?P<unit>%|ms|s|tok/s|tokens/s|it/s)\s*"
                         rf"(?P<label>[A-Za-z][\w ]*)?\)?\s*$", re.I)
MLLOG = re.compile(r":::MLLOG\s+(\{.*\})\s*$")
NAMESPACE = re.compile(r"Namespace\((.*)\)\s*$")
ASSIGN = re.compile(r"^(?:Overriding:\s*)?([A-Za-z_][\w.]*)\s*=\s*(.+?)\s*$")
ARGDOTS = re.compile(r"^\s*([A-Za-z_]\w*)\s+\.{3,}\s+(.*?)\s*$")      # Megatron's argument dump
STEP_KEYS = {"step", "iter", "iteration", "global_step", "_step", "iter_num"}
TRAIN_HEADS = {"", "train", "training", "lm", "tr", "train lm"}
VAL_HEADS = {"val", "valid", "validation", "eval", "dev", "test", "val lm", "validation lm"}
GRAD_NORMS = {"norm", "grad norm", "gradient norm", "grad-norm", "gnorm", "total norm", "grad l2 norm"}
MLLOG_CONTROL = {"init_start", "init_stop", "run_start", "run_stop", "block_start", "block_stop",
                 "epoch_start", "epoch_stop", "eval_start", "eval_stop", "cache_clear"}
MLLOG_STEP = ("step", "step_num", "samples_count", "epoch_num")

# ---- one line ---------------------------------------------------------------------------

def split_rank(line: str) -> tuple[int | None, str]:
    m = RANK.match(line)
    if not m:
        return None, line
    return int(next(g for g in m.groups() if g is not None)), line[m.end():]


@lru_cache(maxsize=4096)      # a log repeats a handful of names millions of times
def metric_name(key: str, paren: str | None = None, unit: str | None = None, val_context: bool = False) -> str:
    """One spelling per metric: loss/train loss/lm loss -> train/loss, val loss -> val/loss, ..."""
    k = " ".join(key.lower().replace("_", " ").replace("/", " ").split())
    if k.endswith(" value"):
        k = k[:-len(" value")]                        # Megatron's "lm loss value" (validation)
    if k.endswith("loss") and "scale" not in k:
        head = k[:-len("loss")].strip()
        if head in VAL_HEADS or (val_context and head in TRAIN_HEADS):
            return "val/loss"
        if head in TRAIN_HEADS:
            return "train/loss"
    if k in ("lr", "learning rate"):
        return "lr"
    if k in GRAD_NORMS:
        return "grad_norm"
    if k.endswith("ppl") and val_context:
        return "val/ppl"
    suffix = paren or (unit if unit and unit.lower() in ("ms", "s") else None)
    if suffix:
        k = f"{k} {suffix.lower()}"
    return re.sub(r"[^\w/]+", "_", k).strip("_")


def parse_metric_line(text: str) -> tuple[int | None, dict[str, float]] | None:
    """(step or None, {name: value}) for a line that reports metrics, else None.

    A line without a step key counts only when it is nothing but losses (llm.c's `val loss 3.2`)."""
    body = LEAD.sub("", text, count=1).strip()
    if not body or (not any(c.isdigit() for c in body) and "nan" not in body.lower()):
        return None
    if body.startswith("{") and body.endswith("}"):
        return _dict_line(body)
    m = STEP.search(body)
    step = int(m.group(2)) if m else None
    rest = body[:m.start()] + " | " + body[m.end():] if m else body
    # Megatron's "validation loss at iteration N | lm loss value: ..." names its loss "lm loss"
    val_context = bool(re.match(r"(?:validation|evaluation|eval|valid)\b", body, re.I))
    values: dict[str, float] = {}
    leftover = []
    for seg in re.split(r"[|,;]", rest):
        seg = seg.strip()
        if not seg:
            continue
        found, at = False, 0
        for p in PAIR.finditer(seg):
            name = metric_name(p["key"], p["paren"], p["unit"], val_context)
            leftover.append(seg[at:p.start()])
            at = p.end()
            if name in STEP_KEYS:
                continue
            values[name] = float(p["val"])     # float() reads nan, inf and 1.2E+00 alike
            found = True
        leftover.append(seg[at:])
        if not found and (v := VALUE_FIRST.match(seg)):
            unit, label = v["unit"].lower(), (v["label"] or "").strip()
            name = ("mfu" if "mfu" in label.lower() else metric_name(label) if label else
                    {"ms": "time_ms", "s": "time_s", "%": "percent"}.get(unit, "tokens_per_sec"))
            values[name] = float(v["val"])
    if not values:
        return None
    if step is None:
        # stepless: accept only a bare loss report, so prose with numbers is not a metric line
        if not all(n.endswith("/loss") for n in values) or re.search(r"[A-Za-z0-9]", "".join(leftover)):
            return None
    return step, values


def _dict_line(body: str) -> tuple[int | None, dict[str, float]] | None:
    data = _literal_dict(body)
    if data is None:
        return None
    step = next((data[k] for k in STEP_KEYS if isinstance(data.get(k), int) and not isinstance(data[k], bool)), None)
    if step is None:
        return None
    values = {metric_name(k): float(v) for k, v in data.items()
              if k not in STEP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return (step, values) if values else None


def _literal_dict(body: str) -> dict | None:
    try:
        data = json.loads(body)
    except ValueError:
        try:
            data = ast.literal_eval(body)       # Python dict reprs: {'lr': 0.1}
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    return data if isinstance(data, dict) else None


# ---- config -------------------------------------------------------------------------------

def _typed(value: Any) -> Any:
    """A JSON-safe config value: tuples become lists, non-finite floats and huge ints become text."""
    if isinstance(value, dict):
        return {str(k): _typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_typed(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -INT64 - 1 <= value <= INT64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    return str(value)


def _literal(raw: str) -> tuple[bool, Any]:
    raw = raw.strip()
    for candidate in (raw, raw.split("#", 1)[0].strip()):
        try:
            return True, _typed(ast.literal_eval(candidate))
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            continue
    bare = raw.split("#", 1)[0].strip()
    if bare and re.fullmatch(r"[\w.\-/:+]+", bare):
        return True, bare                  # an unquoted word: torch.bfloat16, adamw, /data/path
    return False, None


def _namespace(inner: str) -> dict:
    """argparse's `Namespace(a=1, b='x')`, read as a call so nested commas and quotes are safe."""
    try:
        call = ast.parse(f"f({inner})", mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return {}
    out = {}
    for kw in getattr(call, "keywords", []):
        if kw.arg is None:
            continue
        try:
            out[kw.arg] = _typed(ast.literal_eval(kw.value))
        except (ValueError, SyntaxError, TypeError):
            out[kw.arg] = ast.unparse(kw.value)     # e.g. device=device(type='cuda'): keep the text
    return out


def _json_block(lines: list[str], i: int) -> tuple[dict | None, int]:
    """A pretty-printed JSON/dict dump starting at line i: (the dict, index after it)."""
    depth, buf = 0, []
    for j in range(i, min(len(lines), i + 2000)):
        text = lines[j]
        buf.append(text)
        depth += text.count("{") - text.count("}")
        if depth <= 0:
            data = _literal_dict("\n".join(buf))
            return (data, j + 1) if data is not None else (None, i + 1)
    return None, i + 1


def _scan(lines: list[str]) -> tuple[list[str], list[int | None], list[tuple[int, int | None, dict]]]:
    """Rank-free lines, their ranks, and the metric events (line index, step, values), steps filled in."""
    bodies, ranks, events = [], [], []
    last = None
    for i, raw in enumerate(lines):
        rank, body = split_rank(raw)
        bodies.append(body)
        ranks.append(rank)
        if ":::MLLOG" in body:
            continue
        parsed = parse_metric_line(body)
        if parsed is None:
            continue
        step, values = parsed
        if step is None:
            step = last if last is not None else 0    # llm.c prints `val loss` before the step it belongs to
        else:
            last = step
        events.append((i, step, values))
    # only the lowest rank's metrics: every rank may print its own local loss
    printing = {ranks[i] for i, _, _ in events if ranks[i] is not None}
    if printing:
        lead = min(printing)
        events = [e for e in events if ranks[e[0]] in (None, lead)]
    return bodies, ranks, events


def classify_failure(lines: list[str]) -> dict | None:
    """How a run ended badly, from its log lines: {kind, step, message, evidence}, or None.

    Kinds: hardware, oom, nccl_timeout, diverged, timeout, exception, killed, other (a segfault)."""
    bodies, ranks, events = _scan(lines)
    failure = classify(bodies, ranks, events)
    return failure.as_dict() if failure else None


# ---- a whole log ------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mllog(payload: str, rec: dict, metrics: dict) -> None:
    """One MLPerf event: a metric when its metadata names a step/epoch/sample count, else a setting."""
    try:
        ev = json.loads(payload)
    except ValueError:
        return
    if not isinstance(ev, dict) or "key" not in ev:
        return
    key, value, meta = str(ev["key"]), ev.get("value"), ev.get("metadata") or {}
    wall = ev["time_ms"] / 1000.0 if _is_number(ev.get("time_ms")) else None
    if key in ("run_start", "run_stop") and wall is not None:
        at = datetime.fromtimestamp(wall, timezone.utc).replace(tzinfo=None).isoformat()
        rec["started_at" if key == "run_start" else "ended_at"] = at
        if key == "run_stop" and meta.get("status"):
            rec["meta"]["mlperf_status"] = str(meta["status"])
        return
    step_key = next((k for k in MLLOG_STEP if _is_number(meta.get(k))), None)
    if step_key and isinstance(value, (int, float)) and not isinstance(value, bool):
        point = [int(round(meta[step_key])), float(value)] + ([wall] if wall is not None else [])
        metrics.setdefault(metric_name(key), {})[point[0]] = point
    elif key not in MLLOG_CONTROL and (value is None or isinstance(value, (str, int, float, bool, list))):
        rec["config"][key] = _typed(value)


def _read_config(bodies: list[str], first_metric: int, config: dict) -> None:
    i = 0
    while i < len(bodies):
        text = bodies[i].strip()
        if text.startswith("{") and i < first_metric and (parse_metric_line(text) is None):
            data, nxt = _json_block(bodies, i)
            if data and not any("loss" in str(k) for k in data):
                config.update(_typed(data))
            i = nxt
            continue
        if "Namespace(" in text and (m := NAMESPACE.search(text)):
            config.update(_namespace(m.group(1)))
        elif (m := ARGDOTS.match(bodies[i])):
            ok, v = _literal(m.group(2))
            if ok:
                config[m.group(1)] = v
        elif (m := ASSIGN.match(text)) and (i < first_metric or text.startswith("Overriding:")):
            ok, v = _literal(m.group(2))
            # lowercase only: an echoed environment (PATH=..., CUDA_HOME=...) is not the run's config
            if ok and m.group(1) not in STEP_KEYS and not m.group(1).isupper():
                config[m.group(1)] = v
        i += 1


def parse_log(text: str, name: str) -> dict:
    """The native record of one training log (metrics, config, failure, status, meta.log_tail).

    Never raises on content; a log with nothing recognisable has empty metrics and config."""
    lines = text.splitlines()
    bodies, ranks, events = _scan(lines)
    rec: dict[str, Any] = {"name": name, "status": "completed", "config": {}, "metrics": {}, "meta": {}}
    series: dict[str, dict[int, list]] = {}
    for body in bodies:
        if ":::MLLOG" in body and (m := MLLOG.search(body)):
            _mllog(m.group(1), rec, series)
    for _, step, values in events:
        for key, v in values.items():
            series.setdefault(key, {})[step] = [step, v]    # a resumed run re-logs steps: last wins
    rec["metrics"] = {k: [pts[s] for s in sorted(pts)] for k, pts in series.items()}
    _read_config(bodies, events[0][0] if events else len(bodies), rec["config"])
    totals = [int(m.group(3)) for i, _, _ in events[:5] if (m := STEP.search(bodies[i])) and m.group(3)]
    if totals:
        rec["meta"]["total_steps"] = totals[-1]
    failure = classify(bodies, ranks, events)
    if failure:
        rec["failure"] = failure.as_dict()
        rec["status"] = {"diverged": "diverged", "killed": "killed", "timeout": "killed"}.get(failure.kind, "failed")
    rec["meta"]["log_tail"] = "\n".join(_trim(x) for x in lines[-TAIL_LINES:])
    return rec


# ---- the ingester -------------------------------------------------------------------------------

NOT_LOGS = {".md", ".markdown", ".rst", ".json", ".jsonl", ".ndjson", ".yaml", ".yml", ".toml", ".py",
            ".csv", ".tsv", ".html", ".ipynb", ".sh", ".cfg", ".ini"}


def _head(path: Path, size: int) -> list[str]:
    with path.open("rb") as fh:
        raw = fh.read(size)
    if b"\0" in raw[:8192]:
        return []                    # binary
    return raw.decode("utf-8", errors="replace").splitlines()


def log_score(path: Path) -> int:
    """How sure we are that `path` is a training log (0-100); the notes ingester defers to this.

    A few step/metric lines near the top make a log; prose that happens to hold numbers does not."""
    if not path.is_file() or path.suffix.lower() in NOT_LOGS:
        return 0
    named = path.suffix.lower() in (".log", ".out", ".err") or ".log" in path.name.lower()
    try:
        head = _head(path, NAMED_HEAD_BYTES if named else HEAD_BYTES)
    except OSError:
        return 0
    hits = 0
    for line in head:
        if ":::MLLOG" in line or parse_metric_line(split_rank(line)[1]) is not None:
            hits += 1
            if hits >= 3:
                break
    if named and hits >= 1:
        return 85
    if hits >= 3:
        return 85 if path.suffix.lower() in ("", ".txt") else 60
    if named and any(FATAL.search(line) for line in head):
        return 40                    # a run that died before its first step: read it, say what it lacks
    return 0


@register("log")
class LogIngester:
    def detect(self, target: str) -> int:
        return log_score(Path(target))

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            yield rejected(path, f"cannot read: {exc.strerror or exc}")
            return
        data = parse_log(text, path.stem)
        if not data["metrics"] and not data["config"]:
            why = "no step/metric lines recognised (expected lines like 'iter 100: loss 4.23' or " \
                  "'step 1/5000 | train loss 10.98')"
            if data.get("failure"):
                why += f"; it ends with {data['failure']['kind']}: {data['failure']['message'][:120]}"
            yield rejected(path, why)
            return
        try:
            record = parse_run(data)
        except InvalidRecord as exc:
            yield rejected(path, exc.error, field=exc.field)
            return
        yield Parsed(record, "log", str(path.resolve()))
