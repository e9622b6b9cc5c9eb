"""Weights & Biases runs: the `.wandb` log a run writes locally (online or offline), and exports
of runs made with W&B's public API.

Targets:
  wandb/                           a folder of run-*/offline-run-* folders (`latest-run` link skipped)
  wandb/offline-run-<time>-<id>/   one run folder, holding run-<id>.wandb
  run-<id>.wandb                   the log itself
  runs.json / runs.csv             an export (shape below)

The `.wandb` log (wandb 0.31 writes no config.yaml or summary file beside it) is LevelDB's log
format: a 7-byte header (":W&B", magic 0xBEE1 as u16, version u8), then 32 KiB blocks of
chunks, each with a 7-byte header (crc32 of type byte + data, length u16, type u8: 1 full,
2 first, 3 middle, 4 last) and a piece of one protobuf `wandb_internal_pb2.Record`. A block
with under 7 bytes left is padded. The checksum is verified; a torn or corrupt tail (a run
still being written, a crash) ends the read with a warning and keeps what came before it; a
corrupt chunk in the middle costs only the records in its block.

One run becomes one native record:
  project, name     the run record's project and display name (run id when unnamed)
  config            the run's config and later config updates, `_wandb` dropped; {"value": ...}
                    wrappers (config.yaml style) unwrapped when every entry is one
  metrics           history rows {key: [[_step, value, _timestamp]]}, numbers only; nested keys
                    joined with "."; `_step`, `_runtime`, `_timestamp` and media dropped
  summary           the final summary, keys starting with "_" and media dropped
  status            exit code 0 completed, other failed; no exit record: running
  tags, notes       the run's tags and notes
  code              git commit, program, args, host
  meta              wandb_run_id, entity, group, job_type, sweep_id, exit_code, wandb_version,
                    log_problem (when the tail was unreadable)
Source URI: the absolute run folder.

Export shape: a JSON list of runs, or {"project": ..., "runs": [...]}; each run is
  {"name": str, "id": str, "project": str, "entity": str, "state": "finished|failed|crashed|
   killed|preempted|running", "config": {...}, "summary": {...}, "history": [{"_step": 0,
   "_timestamp": 1.7e9, "train/loss": 2.3}, ...], "tags": [...], "notes": str,
   "created_at": ISO-8601, "group": str, "job_type": str}
with only name/config/summary needed, as written from the public API by
  [{"name": r.name, "id": r.id, "project": r.project, "state": r.state, "config": r.config,
    "summary": r.summary._json_dict, "history": list(r.scan_history()), "tags": r.tags,
    "created_at": r.created_at} for r in wandb.Api().runs("entity/project")]
A CSV export is W&B's documented recipe (`pd.DataFrame({"summary": ..., "config": ...,
"name": ...}).to_csv()`): columns name, config, summary (JSON or Python-repr dicts), and
optionally id, state, project, tags, history. Source URI: `<abs file>#<id or name or index>`.

    kb ingest ./wandb        kb ingest runs.json --format wandb
"""
from __future__ import annotations

import ast
import csv
import io
import json
import logging
import math
import struct
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from ingest.base import read_json_file, read_text_file, register, rejected
from kb.errors import InvalidRecord
from kb.records import Item, Parsed, json_safe, parse_run

log = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<4sHB")     # ":W&B", 0xBEE1, version
CHUNK = struct.Struct("<IHB")            # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
STATES = {"finished": "completed", "failed": "failed", "crashed": "failed", "killed": "killed",
          "preempted": "killed", "preempting": "killed", "running": "running", "pending": "running"}
EXPORT_MARKERS = ('"state"', '"history"', '"_wandb"', '"_step"', '"_timestamp"', '"_runtime"')


PART_RUNS = 8           # runs of a folder read by one worker at a time: a run's log is the costly part


@register("wandb")
class WandbIngester:
    def detect(self, target: str) -> int:
        path = Path(target)
        if path.is_file():
            if path.suffix == ".wandb":
                return 95
            if path.suffix == ".json":
                return 80 if _looks_json_export(path) else 0
            if path.suffix == ".csv":
                return 80 if _looks_csv_export(path) else 0
            return 0
        if path.is_dir():
            if _log_file(path) is not None:
                return 95
            if _run_folders(path):
                return 95 if path.name == "wandb" else 90
        return 0

    def read(self, target: str) -> Iterator[Item]:
        path = Path(target).expanduser()
        try:
            if path.is_file() and path.suffix in (".json", ".csv"):
                yield from _read_export(path.resolve())
                return
            if path.is_file():
                yield _read_run(path.resolve(), source=str(path.resolve().parent))
                return
            if not path.is_dir():
                yield rejected(path, "no such W&B run folder, log or export")
                return
            folders = [path] if _log_file(path) is not None else _run_folders(path)
        except OSError as exc:
            yield rejected(path, f"cannot read: {exc.strerror or exc}")
            return
        if not folders:
            yield rejected(path, "no W&B runs here (no run-*/offline-run-* folder with a .wandb log)")
        yield from self.read_part(target, folders)

    def parts(self, target: str) -> list[list[Path]] | None:
        """A folder of many runs in groups of PART_RUNS, each read apart (ingest.pipeline)."""
        path = Path(target).expanduser()
        try:
            if not path.is_dir() or _log_file(path) is not None:
                return None
            folders = _run_folders(path)
        except OSError:
            return None         # read() names the error
        if len(folders) <= PART_RUNS:
            return None
        return [folders[i:i + PART_RUNS] for i in range(0, len(folders), PART_RUNS)]

    def read_part(self, target: str, folders: list[Path]) -> Iterator[Item]:
        for folder in folders:
            log_path = _log_file(folder)
            if log_path is None:
                yield rejected(folder, "run folder without a .wandb log")
                continue
            yield _read_run(log_path.resolve(), source=str(folder.resolve()))


# -- the .wandb log ---------------------------------------------------------------------------

def read_log(data: bytes, problems: list[str]) -> Iterator[Any]:
    """Every Record in a .wandb log. A torn tail ends the read; a corrupt chunk costs the records
    that touch its block (the read resumes at the next block, as LevelDB's reader does). Both
    are noted in `problems`."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    if len(data) < FILE_HEADER.size or FILE_HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise InvalidRecord("not a W&B log (no :W&B header)")
    pos, pending, resyncing = FILE_HEADER.size, None, False
    while pos < len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK.size:                 # a block's tail too short for a header is padding
            pos += room
            continue
        if pos + CHUNK.size > len(data):
            problems.append(f"truncated chunk header at byte {pos}")
            return
        crc, length, kind = CHUNK.unpack_from(data, pos)
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if zlib.crc32(bytes([kind]) + body) != crc:
            # A chunk never crosses its block's end, so a length that would is itself corrupt;
            # one that only runs past the file's end is a tail still being written.
            if CHUNK.size + length > room:
                problems.append(f"checksum mismatch at byte {pos} (corrupt chunk length {length})")
            elif pos + CHUNK.size + length > len(data):
                problems.append(f"truncated record at byte {pos}")
                return
            else:
                problems.append(f"checksum mismatch at byte {pos}")
            pos, pending, resyncing = (pos // BLOCK + 1) * BLOCK, None, True
            continue
        pos += CHUNK.size + length
        if kind in (FULL, FIRST):
            resyncing = False
            if pending is not None:
                problems.append(f"record cut short before byte {pos - CHUNK.size - length}")
            pending = [body]
            if kind == FIRST:
                continue
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending.append(body)
            if kind == MIDDLE:
                continue
        else:
            if not resyncing:                 # after a skipped block, its record's tail is expected
                problems.append(f"stray chunk of type {kind} at byte {pos - CHUNK.size - length}")
            continue
        piece, pending = b"".join(pending), None
        record = pb.Record()
        try:
            record.ParseFromString(piece)
        except DecodeError:
            problems.append(f"undecodable record ending at byte {pos}")
            continue
        yield record
    if pending is not None:
        problems.append("log ends inside a record")


def _read_run(log_path: Path, source: str) -> Item:
    try:
        data = log_path.read_bytes()
    except OSError as exc:
        return rejected(log_path, f"cannot read: {exc.strerror or exc}")
    problems: list[str] = []
    try:
        native = _native_from_log(read_log(data, problems))
        if problems:
            log.warning("%s: %s; read what was intact", log_path, "; ".join(problems))
            native["meta"]["log_problem"] = "; ".join(problems)
        if native.pop("_saw_run") is False:
            raise InvalidRecord("no run record: the log is empty or unreadable"
                                + (f" ({problems[0]})" if problems else ""))
        record = parse_run(native)
    except InvalidRecord as exc:
        return rejected(log_path, exc.error, field=exc.field)
    return Parsed(record, "wandb", source, None)


def _native_from_log(records: Iterator[Any]) -> dict:
    config: dict = {}
    summary: dict = {}
    metrics: dict[str, list] = {}
    info: dict = {"meta": {}, "code": {}, "_saw_run": False}
    start = exit_ = None
    last_time = None
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            info["_saw_run"] = True
            _apply(config, r.config.update, r.config.remove, "config")
            _apply(summary, r.summary.update, r.summary.remove, "summary")
            info.update(project=r.project or None, name=r.display_name or r.run_id or None,
                        tags=list(r.tags), notes=r.notes)
            info["meta"].update(wandb_run_id=r.run_id, entity=r.entity, group=r.run_group,
                                job_type=r.job_type, sweep_id=r.sweep_id)
            info["code"].update(git_commit=r.git.commit, host=r.host)
            if r.HasField("start_time"):
                start = r.start_time.seconds + r.start_time.nanos / 1e9
        elif kind == "config":
            _apply(config, rec.config.update, rec.config.remove, "config")
        elif kind == "summary":
            _apply(summary, rec.summary.update, rec.summary.remove, "summary")
        elif kind == "history":
            t = _history_row(rec.history, metrics)
            last_time = t if t is not None else last_time
        elif kind == "environment":
            env = rec.environment           # wandb writes several; later ones add hardware facts only
            found = {"entrypoint": env.program or env.code_path, "argv": list(env.args), "host": env.host}
            info["code"].update({k: v for k, v in found.items() if v})
            if start is None and env.HasField("started_at"):
                start = env.started_at.seconds + env.started_at.nanos / 1e9
        elif kind == "header":
            info["meta"]["wandb_version"] = rec.header.version_info.producer
        elif kind == "exit":
            exit_ = rec.exit
    status = "running" if exit_ is None else ("completed" if exit_.exit_code == 0 else "failed")
    ended = None
    if exit_ is not None:
        info["meta"]["exit_code"] = exit_.exit_code
        ends = [t for t in (last_time, start + exit_.runtime if start and exit_.runtime else None) if t]
        ended = max(ends) if ends else None
    return _present({
        "project": info.get("project"), "name": info.get("name"), "status": status,
        "config": wandb_config(_decoded(config, "config")), "metrics": metrics,
        "summary": _summary(_decoded(summary, "summary")),
        "tags": info.get("tags", []), "notes": info.get("notes", ""),
        "started_at": _time(start), "ended_at": _time(ended),
        "code": {k: v for k, v in info["code"].items() if v} or None,
        "meta": {k: v for k, v in info["meta"].items() if v not in (None, "")},
        "_saw_run": info["_saw_run"],
    })


class _Raw(str):
    """A value_json not decoded yet: wandb rewrites the summary on every log call, so only the
    last value of each key is worth decoding (a third of the read time otherwise)."""


def _apply(target: dict, updates, removes, what: str) -> None:
    """Config and summary records carry (key or nested_key, value_json) edits, applied in order."""
    for item in updates:
        path = list(item.nested_key) or [item.key]
        node = target
        for p in path[:-1]:
            if isinstance(node.get(p), _Raw):
                node[p] = _json(node[p], what, path)
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[path[-1]] = _Raw(item.value_json)
    for item in removes:
        path = list(item.nested_key) or [item.key]
        node = target
        for p in path[:-1]:
            if isinstance(node.get(p), _Raw):
                node[p] = _json(node[p], what, path)
            node = node.get(p) if isinstance(node.get(p), dict) else {}
        node.pop(path[-1], None)


def _decoded(tree: dict, what: str, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, _Raw):
            out[k] = _json(v, what, [*prefix, k])
        elif isinstance(v, dict):
            out[k] = _decoded(v, what, (*prefix, k))
        else:
            out[k] = v
    return out


def _history_row(history, metrics: dict[str, list]) -> float | None:
    """Add one history row's numbers to `metrics`; returns the row's _timestamp."""
    row = {}
    # recent protos may carry a typed `value` oneof beside value_json; older wandb lacks it
    typed = "value" in type(history).DESCRIPTOR.fields_by_name["item"].message_type.oneofs_by_name
    for item in history.item:
        path = list(item.nested_key) or [item.key]
        which = item.WhichOneof("value") if typed else None
        if which == "json":
            row[tuple(path)] = _json(item.json, "history", path)
        elif which is not None and which != "none":
            row[tuple(path)] = getattr(item, which)
        elif item.value_json:
            try:     # most values are numbers: float() reads them (NaN, Infinity too) 5x faster
                row[tuple(path)] = float(item.value_json)
            except ValueError:
                row[tuple(path)] = _json(item.value_json, "history", path)
    step = row.get(("_step",), history.step.num)
    ts = row.get(("_timestamp",))
    ts = float(ts) if _is_number(ts) else None
    if not _is_number(step) or not math.isfinite(step):
        return ts
    for path, value in row.items():
        if any(p.startswith("_") for p in path) or not _is_number(value):
            continue
        metrics.setdefault(".".join(path), []).append([int(step), float(value), ts])
    return ts


# -- exports ----------------------------------------------------------------------------------

def _read_export(path: Path) -> Iterator[Item]:
    if path.suffix == ".csv":
        text, error = read_text_file(path)
        if error:
            yield error
            return
        yield from _read_csv(path, text)
        return
    data, error = read_json_file(path)
    if error:
        yield error
        return
    project = None
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        project, data = data.get("project"), data["runs"]
    if not isinstance(data, list):
        yield rejected(path, "a W&B export is a list of runs or {\"runs\": [...]}", field="runs")
        return
    for i, run in enumerate(data):
        yield _export_item(path, f"[{i}]", i, None, run, project)


def _read_csv(path: Path, text: str) -> Iterator[Item]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    columns = {c.strip().lower(): c for c in (reader.fieldnames or []) if c}
    if not {"config", "summary"} <= set(columns):
        yield rejected(path, "a W&B CSV export needs `config` and `summary` columns", line=1)
        return
    for i, row in enumerate(reader):
        run: dict[str, Any] = {}
        try:
            for name, col in columns.items():
                cell = row.get(col)
                if cell in (None, ""):
                    continue
                if name == "tags" and cell[:1] != "[":       # "a, b", as W&B's runs table writes it
                    run[name] = [t.strip() for t in cell.split(",") if t.strip()]
                elif name in ("config", "summary", "history", "tags"):
                    run[name] = _cell(cell, name)
                else:
                    run[name] = cell
        except InvalidRecord as exc:
            yield rejected(path, exc.error, line=reader.line_num, field=exc.field)
            continue
        yield _export_item(path, "", i, reader.line_num, run, None)


def _cell(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)      # pandas writes dicts as their Python repr
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise InvalidRecord("neither JSON nor a Python literal", field=name) from None


def _export_item(path: Path, prefix: str, index: int, line: int | None, run: Any,
                 project: str | None) -> Item:
    def where(field: str) -> str:
        return f"{prefix}.{field}" if prefix and field else (prefix or field)
    try:
        native = _native_from_export(run, project)
        record = parse_run(native)
    except InvalidRecord as exc:
        field = "created_at" if exc.field == "started_at" else exc.field   # the export's name for it
        return rejected(path, exc.error, line=line, field=where(field))
    key = run.get("id") or run.get("name") or index
    return Parsed(record, "wandb", f"{path}#{key}", line)


def _native_from_export(run: Any, project: str | None) -> dict:
    if not isinstance(run, dict):
        raise InvalidRecord(f"a run is an object, got {type(run).__name__}")
    for field, kind in (("config", dict), ("summary", dict), ("history", list), ("tags", list)):
        if run.get(field) is not None and not isinstance(run[field], kind):
            raise InvalidRecord(f"must be a {'list' if kind is list else 'object'}, "
                                f"got {type(run[field]).__name__}", field=field)
    state = run.get("state")
    if state is not None and state not in STATES:
        raise InvalidRecord(f"unknown state {state!r}; known: {sorted(STATES)}", field="state")
    metrics: dict[str, list] = {}
    for i, row in enumerate(run.get("history") or []):
        if not isinstance(row, dict):
            raise InvalidRecord(f"a history row is an object, got {type(row).__name__}",
                                field=f"history.{i}")
        step = row.get("_step", i)
        if not _is_number(step) or not math.isfinite(step) or step != int(step):
            raise InvalidRecord(f"_step {step!r} is not an integer", field=f"history.{i}._step")
        ts = row.get("_timestamp")
        ts = float(ts) if _is_number(ts) else None
        for key, value in row.items():
            if not key.startswith("_") and _is_number(value):
                metrics.setdefault(key, []).append([int(step), float(value), ts])
    meta = {"wandb_run_id": run.get("id"), "entity": run.get("entity"), "group": run.get("group"),
            "job_type": run.get("job_type"), "sweep_id": run.get("sweep"), "wandb_state": state}
    return _present({
        "project": run.get("project") or project, "name": run.get("name") or run.get("id"),
        "status": STATES.get(state, "completed"), "config": wandb_config(run.get("config") or {}),
        "metrics": metrics, "summary": _summary(run.get("summary") or {}),
        "tags": [str(t) for t in run.get("tags") or []], "notes": run.get("notes") or "",
        "started_at": run.get("created_at"),
        "meta": {k: v for k, v in meta.items() if v not in (None, "")},
    })


# -- values -----------------------------------------------------------------------------------

def wandb_config(config: dict) -> dict:
    """The user's config: internal keys dropped, {"value": v, "desc": d} wrappers unwrapped."""
    user = {k: v for k, v in config.items() if not k.startswith("_")}
    wrapped = user and all(isinstance(v, dict) and "value" in v and set(v) <= {"value", "desc"}
                           for v in user.values())
    if wrapped:
        user = {k: v["value"] for k, v in user.items()}
    return json_safe(user)


def _summary(summary: dict) -> dict:
    """User keys only; media (dicts with `_type`) dropped."""
    def clean(value):
        if isinstance(value, dict):
            if "_type" in value:
                return _DROP
            out = {k: c for k, v in value.items() if not k.startswith("_")
                   for c in [clean(v)] if c is not _DROP}
            return out
        if isinstance(value, list):
            items = [clean(v) for v in value]
            return _DROP if any(v is _DROP for v in items) else items
        return value
    return json_safe(clean(summary))


_DROP = object()


def _json(text: str, what: str, path: list[str]) -> Any:
    try:
        return json.loads(text)       # wandb writes NaN and Infinity bare, as json.loads reads them
    except ValueError:
        raise InvalidRecord("value is not JSON", field=f"{what}.{'.'.join(path)}") from None


def _present(native: dict) -> dict:
    """Leave out what the source did not say, so the native record's defaults apply."""
    return {k: v for k, v in native.items() if v is not None}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


# -- finding runs -----------------------------------------------------------------------------

def _log_file(folder: Path) -> Path | None:
    logs = sorted(folder.glob("run-*.wandb"))
    return logs[-1] if logs else None


def _run_folders(path: Path) -> list[Path]:
    """run-*/offline-run-* folders with a log; links (wandb's `latest-run`) would repeat a run."""
    return [c for c in sorted(path.iterdir())
            if c.name.startswith(("run-", "offline-run-")) and c.is_dir() and not c.is_symlink()
            and _log_file(c) is not None]


def _looks_json_export(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            head = fh.read(8192)
    except OSError:
        return False
    return head.lstrip()[:1] in ("[", "{") and '"summary"' in head and any(m in head for m in EXPORT_MARKERS)


def _looks_csv_export(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            header = next(csv.reader([fh.readline()]), [])
    except OSError:
        return False
    names = {c.strip().lower() for c in header}
    return {"config", "summary"} <= names
