"""A Hugging Face `TrainerCallback` that stores the run it watches (needs transformers).

    from ingest.callbacks import KBCallback
    trainer = Trainer(..., callbacks=[cb := KBCallback(k, project="p")])
    with cb:                         # optional: Trainer has no exception hook; this stores a crash
        trainer.train()

A leaf: it imports the API (to open a KnowledgeBase from settings) and nothing in the project
imports it, so transformers is loaded only by a script that asks for this callback. The
Lightning callback is in ingest/lightning_callback.py.
"""
from __future__ import annotations

import math
from pathlib import Path

from transformers import TrainerCallback

from ingest.hf_trainer import TRAINING_KEYS, metric_key
from kb.api import open_kb
from kb.records import json_safe
from kb.tracking import MAX_CONFIG_ITEMS, TrackedRun, merge, param_count


class KBCallback(TrainerCallback):
    """Records a Trainer run: on_log entries become curves (the hf-trainer ingester's names:
    loss -> train/loss, eval_loss -> eval/loss), train()'s closing line the summary, config
    {"training": TrainingArguments, "model": model.config}; stored at on_train_end.

    Trainer has no exception hook, so a crash is stored only inside `with callback:`
    around `trainer.train()`; the exception is re-raised. Only the main process writes."""

    def __init__(self, kb=None, project: str = "default", name: str | None = None,
                 config: dict | None = None, index: bool = True, **fields):
        self.kb = open_kb(kb)
        self.project, self.name, self.config, self.index, self.fields = project, name, config, index, fields
        self.run: TrackedRun | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        settings = args.to_dict() if hasattr(args, "to_dict") else vars(args)
        config = {"training": {k: json_safe(settings[k]) for k in TRAINING_KEYS if settings.get(k) is not None}}
        if model is not None and _model_config(model):
            config["model"] = _model_config(model)
        scale = dict(self.fields.get("scale") or {})
        if model is not None and "params" not in scale and param_count(model):
            scale["params"] = param_count(model)
        name = self.name or getattr(args, "run_name", None) or Path(args.output_dir or "run").name
        self.run = TrackedRun(self.kb, self.project, merge(config, self.config or {}), name,
                              index=self.index, hook="hf-callback", **{**self.fields, "scale": scale})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run is None or self.run.stored or not logs:
            return
        numbers = {metric_key(k): v for k, v in logs.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "train_loss" in logs or "total_flos" in logs:     # train()'s closing line
            self.run.summary.update({k: v for k, v in numbers.items() if math.isfinite(v)})
        elif numbers:
            self.run.log(numbers, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is None or self.run.stored:
            return
        if getattr(state, "total_flos", 0) and "flops" not in self.run.scale:
            self.run.scale["flops"] = float(state.total_flos)
        if getattr(state, "num_input_tokens_seen", 0) and "tokens" not in self.run.scale:
            self.run.scale["tokens"] = int(state.num_input_tokens_seen)
        self.run.finish()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.run is not None and not self.run.stored and exc is not None:
            self.run.__exit__(exc_type, exc, tb)
        return False


def _model_config(model) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {}
    data = json_safe(cfg.to_dict())
    return {k: v for k, v in data.items() if not (isinstance(v, (dict, list)) and len(v) > MAX_CONFIG_ITEMS)}
