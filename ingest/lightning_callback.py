"""A PyTorch Lightning callback that stores the fit it watches (needs lightning or pytorch_lightning).

    from ingest.lightning_callback import KBLightningCallback
    pl.Trainer(callbacks=[KBLightningCallback(k, project="p")]).fit(model)   # on_exception built in

A leaf, like ingest/callbacks.py: it imports the API and nothing in the project imports it.
"""
from __future__ import annotations

from collections.abc import Mapping

try:
    import lightning.pytorch as pl
except ImportError:          # the standalone `pytorch_lightning` package: the same Callback API
    import pytorch_lightning as pl

from kb.api import open_kb
from kb.records import json_safe
from kb.tracking import TrackedRun, merge, param_count

TRAINER_KEYS = ("max_steps", "max_epochs", "accumulate_grad_batches", "gradient_clip_val",
                "precision", "num_devices", "num_nodes")


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
        config = {"model": json_safe(dict(pl_module.hparams)),
                  "trainer": json_safe({k: getattr(trainer, k, None) for k in TRAINER_KEYS})}
        scale = dict(self.fields.get("scale") or {})
        if "params" not in scale and param_count(pl_module):
            scale["params"] = param_count(pl_module)
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
        scalars = {key: value for key, value in trainer.callback_metrics.items()
                   if getattr(value, "numel", lambda: 1)() == 1}
        if scalars:
            self.run.log(scalars, step=trainer.global_step)

    def on_fit_end(self, trainer, pl_module):
        if self.run is not None and not self.run.stored:
            self.run.finish()

    def on_exception(self, trainer, pl_module, exception):
        if self.run is not None and not self.run.stored:
            self.run.__exit__(type(exception), exception, exception.__traceback__)
