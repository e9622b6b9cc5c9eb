"""Hugging Face Trainer output folders: `trainer_state.json`, `config.json`, `training_args.bin`
and `checkpoint-*/` sub-folders; one folder is one run.

Curves come from the newest trainer state: the top-level one (`trainer.save_state()`)
unless a checkpoint holds a later global step; a folder with checkpoints only uses the
newest checkpoint's. log_history keys keep the Trainer's names under a prefix:
`eval_loss` -> `eval/loss`, `test_*` -> `test/*`, anything else -> `train/<key>`
(`loss` -> `train/loss`, `learning_rate` -> `train/learning_rate`). The closing line
Trainer.train() logs (`train_loss`, `train_runtime`, `total_flos`, ...) is the run's
summary, not a curve point.

Status: `completed` when train() logged its closing line, the global step reached
max_steps, or a final model sits at the top level (early stopping ends before
max_steps). Otherwise the run stopped early or is still going: `running` when the
state was written in the last STALE_AFTER_S seconds, else `killed` (with a `killed`
failure at the last step), so a re-ingest after the hour settles it.

config = {"model": config.json, "training": TRAINING_KEYS of the TrainingArguments}.
The arguments come from `training_args.json` when a folder has one, else from
`training_args.bin`, read through torch.load with an unpickler that builds nothing
but plain data: a pickle names classes to call, and a folder handed to `kb ingest`
or `kb watch` must not run code. Classes become stand-ins that keep their state
(a dataclass's fields, an enum's value), so subclasses (TRL's SFTConfig) read too.

Scale: params from the saved safetensors headers (exact, tied weights once, no
tensor read); tokens from num_input_tokens_seen when the Trainer counted them;
flops from the Trainer's own total_flos. Nothing is guessed from batch x context.
"""
from __future__ import annotations

import json
import logging
import math
import pickle
import re
import time
import types
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from ingest.base import register, rejected
from kb.errors import InvalidRecord
from kb.records import Item, Parsed, json_safe, parse_run

log = logging.getLogger(__name__)

STATE = "trainer_state.json"
CHECKPOINT = re.compile(r"checkpoint-(\d+)\Z")
STALE_AFTER_S = 3600
MAX_CONFIG_ITEMS = 64      # id2label of a 1000-class head is noise in a run's config
FINAL_MODELS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
TRAINING_KEYS = (
    "learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "max_steps", "num_train_epochs", "warmup_steps", "warmup_ratio",
    "weight_decay", "lr_scheduler_type", "lr_scheduler_kwargs", "optim", "optim_args",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "label_smoothing_factor",
    "seed", "data_seed", "bf16", "fp16", "tf32", "gradient_checkpointing", "torch_compile",
    "neftune_noise_alpha", "logging_steps", "eval_strategy", "eval_steps", "save_steps",
    "metric_for_best_model", "greater_is_better", "load_best_model_at_end", "dataloader_drop_last",
    "group_by_length", "average_tokens_across_devices",
    # TRL's SFT/DPO configs, which subclass TrainingArguments
    "max_seq_length", "max_length", "packing", "beta", "loss_type",
)


@register("hf-trainer")
class HFTrainerIngester:
    def detect(self, target: str) -> int:
        path = Path(target)
        if path.is_file():
            return 90 if path.name == STATE else 0
        if not path.is_dir():
            return 0
        if (path / STATE).is_file():
            return 95       # above tensorboard's score for the runs/ events inside
        if any((ckpt / STATE).is_file() for _, ckpt in checkpoints(path)):
            return 90
        return 0

    def read(self, target: str) -> Iterator[Item]:
        folder = Path(target).resolve()
        if folder.is_file():
            folder = folder.parent
        try:
            yield read_run(folder)
        except InvalidRecord as exc:
            yield rejected(exc.source or folder, exc.error, line=exc.line, field=exc.field)
        except OSError as exc:
            yield rejected(folder, f"cannot read: {exc}")


def read_run(folder: Path) -> Item:
    ckpts = checkpoints(folder)
    state_path, state = newest_state(folder, ckpts)
    # config.json and the arguments: top level first, then the newest checkpoint's folder
    source = state_path.parent if state_path.parent != folder else (ckpts[-1][1] if ckpts else folder)
    meta: dict[str, Any] = {"checkpoints": [c.name for _, c in ckpts],
                            "state_file": str(state_path.relative_to(folder))}
    warnings: list[str] = []
    metrics, summary = history_curves(state.get("log_history") or [], state_path)
    if isinstance(state.get("best_metric"), (int, float)) and math.isfinite(state["best_metric"]):
        summary["best_metric"] = state["best_metric"]
    for key in ("best_model_checkpoint", "best_global_step", "train_batch_size", "trial_name"):
        if state.get(key) is not None:
            meta[key] = state[key]

    config: dict[str, Any] = {}
    model = model_config(_first(folder, source, "config.json"), meta, warnings)
    if model:
        config["model"] = model
    training = training_config(folder, source, warnings)
    if training:
        config["training"] = training
    if isinstance(state.get("trial_params"), dict):
        config["trial"] = state["trial_params"]

    data: dict[str, Any] = {"project": folder.parent.name or "default", "name": folder.name,
                            "config": config, "metrics": metrics, "summary": summary,
                            "scale": scale_of(folder, source, state, warnings)}
    data.update(status_of(folder, state_path, state, summary))
    started = _tensorboard_start(folder)
    if started:
        data["started_at"] = started
    if warnings:
        meta["warnings"] = warnings
    data["meta"] = meta
    try:
        record = parse_run(data)
    except InvalidRecord as exc:
        return rejected(state_path, exc.error, field=exc.field)
    return Parsed(record, "hf-trainer", str(folder), None)


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint-N sub-folder, oldest first."""
    found = []
    for child in folder.iterdir():
        m = CHECKPOINT.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def newest_state(folder: Path, ckpts: list[tuple[int, Path]]) -> tuple[Path, dict]:
    """The trainer state to read curves from: top-level, unless a checkpoint is further along."""
    top = folder / STATE
    with_state = [(step, c / STATE) for step, c in ckpts if (c / STATE).is_file()]
    if top.is_file():
        state = load_state(top)
        if with_state and with_state[-1][0] > _int(state.get("global_step"), -1):
            return with_state[-1][1], load_state(with_state[-1][1])
        return top, state
    if with_state:
        return with_state[-1][1], load_state(with_state[-1][1])
    raise InvalidRecord(f"no {STATE} here or in a checkpoint-*/ folder", source=str(folder))


def load_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"invalid JSON: {exc.msg} (column {exc.colno})", source=str(path),
                            line=exc.lineno) from None
    except UnicodeDecodeError as exc:
        raise InvalidRecord(f"not UTF-8 (byte {exc.start})", source=str(path)) from None
    if not isinstance(state, dict):
        raise InvalidRecord(f"a trainer state is a JSON object, got {type(state).__name__}", source=str(path))
    if not isinstance(state.get("log_history", []), list):
        raise InvalidRecord("must be a list", source=str(path), field="log_history")
    return state


def metric_key(name: str) -> str:
    for prefix in ("eval", "test"):
        if name.startswith(prefix + "_"):
            return f"{prefix}/{name[len(prefix) + 1:]}"
    return f"train/{name}"


def history_curves(history: list, source: Path) -> tuple[dict, dict]:
    """log_history -> (metrics {key: [[step, value]]}, summary from train()'s closing line)."""
    metrics: dict[str, list[list]] = {}
    summary: dict[str, Any] = {}
    for i, entry in enumerate(history):
        where = f"log_history[{i}]"
        if not isinstance(entry, dict):
            raise InvalidRecord(f"an entry is a JSON object, got {type(entry).__name__}",
                                source=str(source), field=where)
        step = entry.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidRecord(f"step is {step!r}, not a step count", source=str(source), field=f"{where}.step")
        closing = "train_loss" in entry or "total_flos" in entry
        for name, value in entry.items():
            if name == "step" or not _is_number(value):
                continue
            key = metric_key(name)
            if closing:
                if math.isfinite(value):
                    summary[key] = value
                continue
            series = metrics.setdefault(key, [])
            if series and series[-1][0] == step and series[-1][1] == value:
                continue       # epoch and token counts repeat on a step's train and eval lines
            series.append([step, float(value)])
    return metrics, summary


def status_of(folder: Path, state_path: Path, state: dict, summary: dict) -> dict:
    step, max_steps = _int(state.get("global_step"), 0), _int(state.get("max_steps"), 0)
    if ("train/train_loss" in summary or (max_steps and step >= max_steps)
            or any((folder / name).is_file() for name in FINAL_MODELS)):
        return {"status": "completed"}
    if time.time() - state_path.stat().st_mtime < STALE_AFTER_S:
        return {"status": "running"}
    of = f" of {max_steps}" if max_steps else ""
    return {"status": "killed",
            "failure": {"kind": "killed", "step": step,
                        "message": f"stopped at step {step}{of}: no final model or training summary"}}


def model_config(path: Path | None, meta: dict, warnings: list[str]) -> dict:
    if path is None:
        return {}
    try:
        cfg = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        warnings.append(f"{path.name}: not valid JSON ({exc}); model config left out")
        return {}
    if not isinstance(cfg, dict):
        warnings.append(f"{path.name}: not a JSON object; model config left out")
        return {}
    dropped = [k for k, v in cfg.items() if isinstance(v, (dict, list)) and len(v) > MAX_CONFIG_ITEMS]
    if dropped:
        meta["dropped_model_config"] = dropped
    return {k: v for k, v in cfg.items() if k not in dropped}


def training_config(folder: Path, source: Path, warnings: list[str]) -> dict:
    args = None
    as_json = _first(folder, source, "training_args.json")
    if as_json is not None:
        try:
            args = json.loads(as_json.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            warnings.append(f"{as_json.name}: not valid JSON ({exc})")
    if not isinstance(args, dict):
        as_bin = _first(folder, source, "training_args.bin")
        args = load_training_args(as_bin, warnings) if as_bin is not None else None
    if not isinstance(args, dict):
        return {}
    out = {}
    for key in TRAINING_KEYS:
        value = _plain(args.get(key))
        if value is not None:
            out[key] = value
    return out


def load_training_args(path: Path, warnings: list[str]) -> dict | None:
    """The TrainingArguments' fields as plain data, or None with a warning; never runs code."""
    try:
        import torch
        obj = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_plain_pickle)
    except Exception as exc:    # noqa: BLE001 - a damaged pickle fails in any way; all mean "unreadable"
        warnings.append(f"{path.name}: not readable ({type(exc).__name__}: {exc}); training args left out")
        return None
    plain = _plain(obj)
    if not isinstance(plain, dict):
        warnings.append(f"{path.name}: holds {type(plain).__name__}, not TrainingArguments")
        return None
    return plain


class _Stand:
    """Stands in for any class a pickle names: keeps what it was built from, runs nothing."""
    _kb_name = "?"
    _kb_args: tuple = ()
    _kb_state: Any = None

    def __init__(self, *args, **kwargs):
        self._kb_args = args

    def __setstate__(self, state):
        self._kb_state = state


class _PlainUnpickler(pickle.Unpickler):
    SAFE = {("collections", "OrderedDict"): dict, ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset}

    def find_class(self, module: str, name: str):
        if (module, name) in self.SAFE:
            return self.SAFE[module, name]
        return type(name, (_Stand,), {"_kb_name": f"{module}.{name}"})


def _plain_load(f, **kw):
    return _PlainUnpickler(f, **kw).load()


# a pickle module for torch.load's `pickle_module`: the stdlib's, with the safe Unpickler
_plain_pickle = types.ModuleType("kb_plain_pickle")
_plain_pickle.Unpickler, _plain_pickle.load = _PlainUnpickler, _plain_load


def _plain(x, depth: int = 0):
    """Unpickled data as JSON values: a stand-in becomes its state dict, or the value it wrapped."""
    if depth > 8:
        return None
    if isinstance(x, _Stand):
        state = x._kb_state
        if isinstance(state, tuple) and len(state) == 2:      # (dict, slots) from __reduce_ex__
            state = state[0] or state[1]
        if isinstance(state, dict):
            return {k: _plain(v, depth + 1) for k, v in state.items()
                    if isinstance(k, str) and not k.startswith("_")}
        if len(x._kb_args) == 1:          # an enum member or torch.device: its value
            return _plain(x._kb_args[0], depth + 1)
        return x._kb_name
    if isinstance(x, dict):
        return {str(k): _plain(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_plain(v, depth + 1) for v in x]
    return json_safe(x)


def scale_of(folder: Path, source: Path, state: dict, warnings: list[str]) -> dict:
    scale: dict[str, Any] = {}
    params = count_params(folder) or (count_params(source) if source != folder else None)
    if params:
        scale["params"] = params
    tokens = _int(state.get("num_input_tokens_seen"), 0)
    if tokens > 0:
        scale["tokens"] = tokens
    flos = state.get("total_flos")
    if _is_number(flos) and math.isfinite(flos) and flos > 0:
        scale["flops"] = float(flos)
    return scale


def count_params(folder: Path) -> int | None:
    """Parameters stored in a folder's safetensors weights, from the headers alone."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None
        files = [folder / s for s in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        return None
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    total = 0
    try:
        for f in files:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    n = 1
                    for d in st.get_slice(name).get_shape():
                        n *= d
                    total += n
    except (OSError, ValueError, RuntimeError) as exc:
        log.info("cannot count parameters in %s: %s", folder, exc)
        return None
    return total or None


def _tensorboard_start(folder: Path) -> str | None:
    """When the Trainer's TensorBoard writer opened: the unix time in its event file name."""
    stamps = []
    for p in (folder / "runs").glob("*/events.out.tfevents.*"):
        parts = p.name.split(".")
        if len(parts) > 3 and parts[3].isdigit():
            stamps.append(int(parts[3]))
    return datetime.fromtimestamp(min(stamps), tz=timezone.utc).isoformat() if stamps else None


def _first(folder: Path, source: Path, name: str) -> Path | None:
    for base in (folder, source):
        if (base / name).is_file():
            return base / name
    return None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default
