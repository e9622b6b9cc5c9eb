"""Text logs of training scripts: step/metric lines, printed hyperparameters, printed code,
and how the run ended.

Reads the shapes people print: nanoGPT (`iter 100: loss 4.2345, time 12.3ms, mfu 1.2%`,
`step 500: train loss 3.1, val loss 3.2`), llm.c's stdout (`step    1/74 | loss 11.0096 (+nanz)|
norm 15.02 (+nanz)| lr 3.00e-04 | 44.57 ms | 9.6% bf16 MFU | 91886 tok/s`, `val loss 3.2`, the CPU
`step 0: train loss 5.35 (took 1452.1 ms)`) and its `main.log` (`s:1 trl:10.98 lr:0.000006 norm:15.23`,
`s:0 tel:10.98`), the modded-nanogpt speedrun (`step:125/1390 val_loss:4.3121 train_time:13234ms
step_avg:105.87ms`), Megatron/NeMo (`iteration 100/10000 | learning rate: 3.000E-04 | lm loss:
6.123E+00 | grad norm: 1.234 |`), torchrun/srun rank prefixes (`[rank0]:`, `0: `), `key=value` /
`key: value` lines holding a step key, JSON lines with a step key, and MLPerf `:::MLLOG {json}`
events.

A script printed at the top of its own log (the speedrun prints its whole source, then a `====`
line) is stored as the run's code (`code.source`, `code.source_sha256`) and is never read for
metrics, failures or config, except for the defaults of its settings dataclass (`class
Hyperparameters`): see ingest/log_code.py. What the program printed about its settings (reprs,
`key = value`, dumps, command lines, tables) becomes the config: see ingest/log_config.py.

Status rule: `diverged` when a loss went NaN/Inf (printed, or a "loss is NaN" message);
`killed` for kill signals and scheduler time limits; `failed` for any other failure found
(OOM, NCCL, hardware, a Python traceback; kb/failures.py); otherwise `completed`. A log that
just stops is not assumed to be still running: whoever knows better (a hook) sets the status.

`parse_log(text, name)` and `classify_failure(lines)` are pure, for post-run hooks.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from ingest.base import register, rejected
from ingest.log_code import find_code, hyperparameters
from ingest.log_config import STEP_KEYS, literal_dict, read_config
from kb.errors import InvalidRecord
from kb.failures import FATAL, classify, trim as _trim
from kb.records import INT64, Item, Parsed, RunRecord, json_safe, parse_run, path_text

HEAD_BYTES = 256 * 1024      # detection reads this much of a .txt, and 8x more of a .log/.out/.err:
NAMED_HEAD_BYTES = 2 * 1024 * 1024   # Megatron's argument dump and NCCL's INFO lines come first
TAIL_LINES = 50
UNREAD_SHOWN = 20           # printed settings left out of a record, named in meta.unread
SOURCE_CHARS = 1 << 20       # a printed script is kept up to this much; its hash covers all of it

# a nan followed by "word:" is part of a name (Megatron's "number of nan iterations: 0")
NUM = r"[-+]?(?:nan|inf(?:inity)?)\b(?!\s+[a-z]+\s*:)|[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
RANK = re.compile(r"^\s*(?:\[(?:rank|default)?(\d+)\]:|(\d+):\s|\[\d+,(\d+)\]<std(?:out|err)>:)\s?")
LEAD = re.compile(r"""^(?:\s*(?:
      \[[^\]]{0,64}\]                                            # [2024-05-01 10:00:00], [INFO]
    | \d{4}-\d\d-\d\d[T\s][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?           # ISO timestamps
    | \d\d:\d\d:\d\d(?:[.,]\d+)?
    | (?:INFO|DEBUG|WARNING|WARN|ERROR|CRITICAL)(?::[\w.]+:)?     # logging's "INFO:__main__:"
    | [-|:]
    )\s*)+""", re.X)
# a step printed as a float by Lightning's progress bar (`global_step=794.0`, `global_step=9e+3`) is still a step
STEP = re.compile(r"\b(global[_ ]step|iteration|iter|step)\b\s*[:=#]?\s*\[?\s*(\d+(?:\.0+)?(?:[eE]\+?\d+)?)"
                  r"(?:\s*/\s*(\d+))?\]?", re.I)
# a key starts a word: tried from inside one, a long word costs time quadratic in its length
PAIR = re.compile(rf"(?<![\w./\-])(?P<key>[A-Za-z_][\w./\-]*(?:\s[A-Za-z_][\w./\-]*){{0,4}}?)"
                  rf"(?:\s*\((?P<paren>[^()]{{0,64}})\))?\s*(?:[:=]\s*|\s+)(?P<val>{NUM})"
                  rf"(?P<unit>%|\s?ms\b|s\b|tok/s|it/s)?", re.I)
VALUE_FIRST = re.compile(rf"^\(?\s*(?P<val>{NUM})\s*(?P<unit>%|ms|s|tok/s|tokens/s|it/s)\s*"
                         rf"(?P<label>[A-Za-z][\w ]*)?\)?\s*$", re.I)
MLLOG = re.compile(r":::MLLOG\s+(\{.*\})\s*$")
# llm.c's main.log: `s:<step>` then `key:value` pairs (llmc/logger.h writes trl, tel, lr, norm, eval;
# eval is the HellaSwag accuracy)
MAIN_NUM = r"[-+]?(?:nan|inf(?:inity)?|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)(?=\s|$)"   # C's printf: nan, -nan
MAIN_LOG = re.compile(rf"^s:(\d+)((?:\s+[A-Za-z_]\w*:{MAIN_NUM})+)\s*$")
MAIN_LOG_KEYS = {"trl": "train/loss", "tel": "val/loss", "lr": "lr", "norm": "grad_norm", "eval": "hellaswag_acc"}
# Lightning's ModelCheckpoint: "Epoch 0, global step 9000: 'val_loss' reached 7.04238 (best ...), saving model to '...'"
CHECKPOINT = re.compile(rf"\bglobal step (\d+): '([^']+)' (?:reached ({NUM})|was not in top)")
TRAIN_HEADS = {"", "train", "training", "lm", "tr", "train lm", "reduced train"}   # NeMo: reduced_train_loss
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
    unit = unit.strip() if unit else None
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
    if body.startswith("s:") and (m := MAIN_LOG.match(body)):
        pairs = re.findall(rf"([A-Za-z_]\w*):({MAIN_NUM})", m.group(2))
        step = step_number(m.group(1))
        values = {MAIN_LOG_KEYS.get(k) or metric_name(k): float(v) for k, v in pairs}
        values.pop("", None)
        return (step, values) if step is not None and values else None
    if "global step" in body and (m := CHECKPOINT.search(body)):
        step = step_number(m.group(1))
        return (step, {metric_name(m.group(2)): float(m.group(3))}) if m.group(3) and step is not None else None
    m = STEP.search(body)
    step = step_number(m.group(2)) if m else None
    if m and step is None:
        return None                  # `step 1e999`: no step a store can hold, so not a metric line
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
    values.pop("", None)             # `_ 2.0`: a name made only of separators names nothing
    if not values:
        return None
    if step is None:
        # stepless: accept only a bare loss report, so prose with numbers is not a metric line
        if not all(n.endswith("/loss") for n in values) or re.search(r"[A-Za-z0-9]", "".join(leftover)):
            return None
    return step, values


def _dict_line(body: str) -> tuple[int | None, dict[str, float]] | None:
    data = literal_dict(body)
    if data is None:
        return None
    step = next((step_number(data[k]) for k in STEP_KEYS
                 if isinstance(data.get(k), int) and not isinstance(data[k], bool)), None)
    if step is None:
        return None
    values = {}
    for k, v in data.items():
        if k in STEP_KEYS or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        try:
            values[metric_name(str(k))] = float(v)
        except OverflowError:
            continue                 # an integer past any float: no curve value
    values.pop("", None)
    return (step, values) if values else None


def step_number(text: str | float) -> int | None:
    """A printed step as an int, or None when it is no step a store holds (negative, past 64 bits, inf)."""
    try:
        step = int(round(float(text))) if not isinstance(text, str) or not text.isdigit() else int(text)
    except (OverflowError, ValueError):
        return None
    return step if 0 <= step <= INT64 else None


Events = list[tuple[int, "int | None", dict]]     # (line index, step, {metric: value})


def _scan(lines: list[str]) -> tuple[list[str], list[int | None], Events, list[tuple[int, int]]]:
    """Rank-free lines with printed code blanked, their ranks, the metric events (line index,
    step, values; steps filled in) and the printed code's line ranges."""
    bodies, ranks = [], []
    for raw in lines:
        rank, body = split_rank(raw)
        bodies.append(body)
        ranks.append(rank)
    # every printed script has an import; most logs have none, and skip the code search
    blocks = find_code(bodies) if any(x.startswith(("import ", "from ")) for x in bodies) else []
    if blocks:
        bodies = list(bodies)
        for start, end in blocks:
            bodies[start:end] = [""] * (end - start)      # a script's text is not its output
    events = []
    last = None
    for i, body in enumerate(bodies):
        if not body or ":::MLLOG" in body:
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
    return bodies, ranks, events, blocks


def classify_failure(lines: list[str]) -> dict | None:
    """How a run ended badly, from its log lines: {kind, step, message, evidence}, or None.

    Kinds: hardware, oom, nccl_timeout, diverged, timeout, exception, killed, other (a segfault)."""
    bodies, ranks, events, _ = _scan(lines)
    failure = classify(bodies, ranks, events)
    return failure.as_dict() if failure else None


# ---- a whole log ------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mllog(payload: str, rec: dict, metrics: dict) -> None:
    """One MLPerf event: a metric when its metadata names a step/epoch/sample count, else a setting."""
    try:
        ev = json.loads(payload)
    except (ValueError, RecursionError):
        return
    if not isinstance(ev, dict) or "key" not in ev:
        return
    key, value, meta = str(ev["key"]), ev.get("value"), ev.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    wall = ev["time_ms"] / 1000.0 if _is_number(ev.get("time_ms")) else None
    if key in ("run_start", "run_stop") and wall is not None:
        at = _utc_time(wall)
        if at is not None:
            rec["started_at" if key == "run_start" else "ended_at"] = at
        if key == "run_stop" and meta.get("status"):
            rec["meta"]["mlperf_status"] = str(meta["status"])
        return
    step_key = next((k for k in MLLOG_STEP if _is_number(meta.get(k))), None)
    if step_key and isinstance(value, (int, float)) and not isinstance(value, bool):
        step, name = step_number(meta[step_key]), metric_name(key)
        if step is None or not name or (isinstance(value, int) and value.bit_length() > 1000):
            return                   # no step or name a curve holds, or an integer past any float
        metrics.setdefault(name, {})[step] = [step, float(value)] + ([wall] if wall is not None else [])
    elif key not in MLLOG_CONTROL and (value is None or isinstance(value, (str, int, float, bool, list))):
        rec["config"][key] = json_safe(value)


def _utc_time(seconds: float) -> str | None:
    """ISO-8601 UTC of a Unix time; None past what a datetime holds (a garbled `time_ms`)."""
    try:
        return datetime.fromtimestamp(seconds, timezone.utc).replace(tzinfo=None).isoformat()
    except (OverflowError, OSError, ValueError):
        return None


def parse_log(text: str, name: str) -> dict:
    """The native record of one training log (metrics, config, code, failure, status, meta.log_tail).

    Never raises on content; a log with nothing recognisable has empty metrics and config."""
    lines = text.splitlines()
    bodies, ranks, events, blocks = _scan(lines)
    rec: dict[str, Any] = {"name": name, "status": "completed", "config": {}, "metrics": {}, "meta": {}}
    series: dict[str, dict[int, list]] = {}
    for body in bodies:
        if ":::MLLOG" in body and (m := MLLOG.search(body)):
            _mllog(m.group(1), rec, series)
    for _, step, values in events:
        for key, v in values.items():
            series.setdefault(key, {})[step] = [step, v]    # a resumed run re-logs steps: last wins
    rec["metrics"] = {k: [pts[s] for s in sorted(pts)] for k, pts in series.items()}
    code: dict[str, Any] = {}
    if blocks:
        # printed code: the whole source kept as the run's code; only its settings dataclass is config
        source = "\n\n".join("\n".join(split_rank(x)[1] for x in lines[a:b]) for a, b in blocks)
        code = {"source": source[:SOURCE_CHARS], "source_sha256": hashlib.sha256(source.encode()).hexdigest()}
        if len(source) > SOURCE_CHARS:
            code["source_chars"] = len(source)
        rec["config"].update(hyperparameters(source))
    printed = read_config(bodies, events[0][0] if events else len(bodies), code)
    rec["config"] = {**rec["config"], **printed}
    if code:
        rec["code"] = code
    totals = [step_number(m.group(3)) for i, _, _ in events[:5] if (m := STEP.search(bodies[i])) and m.group(3)]
    if totals and totals[-1] is not None:
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
    # read as the reader reads it: NULs (a crashed node's preallocated zeros) are no text, and a
    # binary file simply has no metric lines
    return raw.replace(b"\0", b"").decode("utf-8-sig", errors="replace").splitlines()


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
    hits = _hits(head)
    if hits < 3 and not named and head and find_code(head[:200]):
        # a script printed first (the speedrun's is 100 KB and growing): look past it for the run
        head = _head(path, NAMED_HEAD_BYTES)
        bodies = [split_rank(x)[1] for x in head]
        ends = find_code(bodies)
        hits = _hits(head[ends[-1][1]:] if ends else head)
    if named and hits >= 1:
        return 85
    if hits >= 3:
        return 85 if path.suffix.lower() in ("", ".txt") else 60
    if named and any(FATAL.search(line) for line in head):
        return 40                    # a run that died before its first step: read it, say what it lacks
    return 0


def _hits(head: list[str]) -> int:
    hits = 0
    for line in head:
        if ":::MLLOG" in line or parse_metric_line(split_rank(line)[1]) is not None:
            hits += 1
            if hits >= 3:
                break
    return hits


@register("log")
class LogIngester:
    def detect(self, target: str) -> int:
        return log_score(Path(target))

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            yield rejected(path, f"cannot read: {exc.strerror or exc}")
            return
        # a log is read whatever bytes it holds: undecodable ones become U+FFFD, and NULs (the
        # zeros a crashed node leaves at the end of a preallocated file) are no text at all
        text = raw.decode("utf-8-sig", errors="replace").replace("\x00", "")
        # llm.c writes `<output dir>/main.log`: the folder names the run
        name = path_text(path.parent.name if path.name == "main.log" and path.parent.name else path.stem)
        data = parse_log(text, name)
        if not data["metrics"] and not data["config"]:
            why = "no step/metric lines recognised (expected lines like 'iter 100: loss 4.23' or " \
                  "'step 1/5000 | train loss 10.98')"
            if data.get("failure"):
                why += f"; it ends with {data['failure']['kind']}: {data['failure']['message'][:120]}"
            yield rejected(path, why)
            return
        try:
            record = storable(data)
        except InvalidRecord as exc:
            yield rejected(path, exc.error, field=exc.field)
            return
        yield Parsed(record, "log", str(path.resolve()))


def storable(data: dict) -> RunRecord:
    """The validated record of a parsed log. A printed setting or metric the store cannot hold
    (a name past the name limit, a dump nested past the depth limit) is left out and named in
    `meta.unread` with why: one odd line of a log does not cost the run its curves."""
    try:
        return parse_run(data)
    except InvalidRecord:
        pass
    unread = []
    for part in ("config", "metrics"):
        kept = {}
        for key, value in data[part].items():
            try:
                parse_run({part: {key: value}})
                kept[key] = value
            except InvalidRecord as exc:
                unread.append({"field": exc.field, "error": exc.error})
        data[part] = kept
    if unread and not data["config"] and not data["metrics"]:
        raise InvalidRecord(f"nothing it printed can be stored: {unread[0]['error']}", field=unread[0]["field"])
    if unread:
        data["meta"]["unread"] = unread[:UNREAD_SHOWN]
        if len(unread) > UNREAD_SHOWN:
            data["meta"]["unread_count"] = len(unread)
    return parse_run(data)
