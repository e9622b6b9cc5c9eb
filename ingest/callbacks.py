"""Training-framework callbacks that store the run they watch: a Hugging Face `TrainerCallback`
and a PyTorch Lightning callback. Both are built on first access (module `__getattr__`), so
importing this module (or `ingest.hooks`) imports neither transformers nor lightning.

    trainer = Trainer(..., callbacks=[cb := KBCallback(k, project="p")])
    with cb:                         # optional: Trainer has no exception hook; this stores a crash
        trainer.train()

    pl.Trainer(callbacks=[KBLightningCallback(k, project="p")]).fit(model)   # on_exception built in
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from ingest.hooks import MAX_CONFIG_ITEMS, TrackedRun, merge, open_kb, plain

def __getattr__(name: str):
    builders = {"KBCallback": _hf_callback, "KBLightningCallback": _lightning_callback}
    if name not in builders:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = builders[name]()
    globals()[name] = cls
    return cls


def _model_config(model) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {}
    data = plain(cfg.to_dict())
    return {k: v for k, v in data.items() if not (isinstance(v, (dict, list)) and len(v) > MAX_CONFIG_ITEMS)}


def _param_count(model) -> int | None:
    try:
        return sum(p.numel() for p in model.parameters()) or None
    except (AttributeError, TypeError):
        return None


def _hf_callback():
    from transformers import TrainerCallback

    from ingest.hf_trainer import TRAINING_KEYS, metric_key

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
            config = {"training": {k: plain(settings[k]) for k in TRAINING_KEYS
                                   if settings.get(k) is not None and plain(settings[k]) is not None}}
            if model is not None and _model_config(model):
                config["model"] = _model_config(model)
            scale = dict(self.fields.get("scale") or {})
            if model is not None and "params" not in scale and _param_count(model):
                scale["params"] = _param_count(model)
            name = self.name or getattr(args, "run_name", None) or Path(args.output_dir or "run").name
            self.run = TrackedRun(self.kb, self.project, merge(config, self.config or {}), name,
                                  index=self.index, hook="hf-callback",
                                  **{**self.fields, "scale": scale})

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

    return KBCallback


def _lightning_callback():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class KBLightningCallback(pl.Callback):
        """Records a Lightning fit: the loss of every training step (train/loss), and every scalar
        in callback_metrics after each validation and training epoch; config {"model": hparams,
        "trainer": its step/epoch/precision settings}. Stored at on_fit_end, or at on_exception
        as failed (killed for KeyboardInterrupt). Only global rank 0 writes."""

        def __init__(self, kb=None, project: str = "default", name: str | None = None,
                     config: dict | None = None, index: bool = True, **fields):
            self.kb = open_kb(kb)
            self.project, self.name, self.config, self.index, self.fields = project, name, config, index, fields
            self.run: TrackedRun | None = None

        def on_fit_start(self, trainer, pl_module):
            if not trainer.is_global_zero:
                return
            config = {"model": plain(dict(pl_module.hparams)),
                      "trainer": plain({k: getattr(trainer, k, None) for k in (
                          "max_steps", "max_epochs", "accumulate_grad_batches", "gradient_clip_val",
                          "precision", "num_devices", "num_nodes")})}
            scale = dict(self.fields.get("scale") or {})
            if "params" not in scale and _param_count(pl_module):
                scale["params"] = _param_count(pl_module)
            self.run = TrackedRun(self.kb, self.project, merge(config, self.config or {}),
                                  self.name or type(pl_module).__name__, index=self.index,
                                  hook="lightning-callback", **{**self.fields, "scale": scale})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.run is None or self.run.stored:
                return
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None:
                self.run.log({"train/loss": loss}, step=trainer.global_step)

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                self._log_callback_metrics(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            self._log_callback_metrics(trainer)

        def _log_callback_metrics(self, trainer):
            if self.run is None or self.run.stored:
                return
            scalars = {}
            for key, value in trainer.callback_metrics.items():
                if getattr(value, "numel", lambda: 1)() == 1:
                    scalars[key] = value
            if scalars:
                self.run.log(scalars, step=trainer.global_step)

        def on_fit_end(self, trainer, pl_module):
            if self.run is not None and not self.run.stored:
                self.run.finish()

        def on_exception(self, trainer, pl_module, exception):
            if self.run is not None and not self.run.stored:
                self.run.__exit__(type(exception), exception, exception.__traceback__)

    return KBLightningCallback
