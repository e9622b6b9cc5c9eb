"""The proxy training loop: one config in, one native run record out.

    from runner.train import train, TrainConfig
    result = train(TrainConfig.from_dict({"n_layer": 2, "max_steps": 100}), workdir=Path("runs/a"))
    result.record        # native run record: status, resolved config, scale, curves, provenance
    result.checkpoint    # workdir/checkpoint.pt, from which `resume=True` continues

Evaluates every `eval_interval` steps (val/loss per source and their mean) and calls
`on_eval(step, metrics)` there; `should_stop()` is asked before each step (a cancel: status
`killed`, checkpoint written). A train loss that is not finite or above `divergence_factor`
times the first one ends the run as `diverged` at that step. Checkpoints every
`checkpoint_interval` steps, written atomically; `resume=True` continues from the last one with
the same results as a run never interrupted (batches are a function of seed and step; the RNG
state travels in the checkpoint). Stops at max_steps, or earlier at a token or time budget.
An exception inside the loop ends the run as `failed` (kind `oom` for out-of-memory), recorded
like any other end; bad configs and data raise InvalidRecord before anything trains.

On a GPU: bf16 autocast, torch.compile, TF32 matmuls and fused AdamW, and MFU reported against
the chip's dense bf16 peak. On a CPU: fp32 with `threads` torch threads.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from kb.errors import InvalidRecord, KBError
from kb.failures import from_exception
from kb.records import json_safe
from kb.tracking import new_run_id, provenance, utcnow
from runner.config import TrainConfig
from runner.data import MixtureBatches, default_cache_dir, load_sources
from runner.model import GPT
from runner.optim import lr_at, make_optimizers, set_lr

__all__ = ["train", "TrainConfig", "TrainResult"]
log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
RECORD = "run.json"             # the finished run's record, for `kb ingest` when nothing stored it
REPO = Path(__file__).resolve().parent.parent
# dense bf16 peak FLOP/s by device name, for MFU (the datasheets' numbers without sparsity)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


@dataclass
class TrainResult:
    record: dict
    checkpoint: Path | None
    steps_done: int


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRecord("device cuda asked for, but torch sees no GPU", field="device")
    return device


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in gpu), None)


class Run:
    """The state of one training: model, optimizers, curves, counters; saved and restored whole."""

    def __init__(self, cfg: TrainConfig, workdir: Path, cache_dir: Path, fields: dict):
        self.cfg = cfg
        self.workdir = workdir
        self.device = pick_device(cfg.device)
        if self.device.type == "cpu" and cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")      # TF32 for what autocast leaves in fp32
        names = list(cfg.data_mixture)
        self.sources = load_sources(cfg.data_sources, cache_dir, names)
        top = max(s.max_token() for s in self.sources.values())
        if top >= cfg.vocab_size:
            raise InvalidRecord(f"the data holds token {top}, beyond vocab_size {cfg.vocab_size}",
                                field="vocab_size")
        self.batches = MixtureBatches(self.sources, cfg.data_mixture, cfg.seq_len, cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model = GPT(cfg.model_config()).to(self.device)
        self.optimizers = make_optimizers(self.model, cfg, self.device)
        self.compiled = self.model
        if cfg.compile if cfg.compile is not None else self.device.type == "cuda":
            self.compiled = torch.compile(self.model)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self.config = cfg.to_config({n: s.origin for n, s in self.sources.items()})
        self.fields = dict(fields)
        self.started_at = utcnow()
        self.id = self.fields.pop("id", None) or new_run_id(cfg.name, self.started_at)
        self.step = 0
        self.metrics: dict[str, list[list]] = {}
        self.first_loss: float | None = None
        self.elapsed = 0.0
        self.rates: list[float] = []        # tokens/s of each eval interval
        self.mfus: list[float] = []

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self) -> Path:
        path = self.workdir / CHECKPOINT
        state = {
            "id": self.id, "started_at": self.started_at.isoformat(), "config": self.config,
            "step": self.step, "metrics": self.metrics, "first_loss": self.first_loss,
            "elapsed": self.elapsed, "rates": self.rates, "mfus": self.mfus,
            "model": self.model.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers],
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        tmp = path.with_name(f"{CHECKPOINT}.tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)        # a crash mid-write leaves the previous checkpoint whole
        return path

    def restore(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        if not self.cfg.same_experiment(state["config"]):
            raise KBError(f"{path} is a checkpoint of another config; resume=False starts afresh "
                          f"(or use another workdir)")
        self.model.load_state_dict(state["model"])
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        self.id, self.started_at = state["id"], datetime.fromisoformat(state["started_at"])
        self.step, self.metrics, self.first_loss = state["step"], state["metrics"], state["first_loss"]
        self.elapsed, self.rates, self.mfus = state["elapsed"], state["rates"], state["mfus"]
        torch.set_rng_state(state["rng"].cpu())
        if state["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)

    # ---- steps and evaluation ----------------------------------------------------------------

    def log(self, key: str, value: float, step: int | None = None) -> None:
        self.metrics.setdefault(key, []).append([self.step if step is None else step, float(value)])

    def train_step(self) -> float:
        """One optimizer step; the mean train loss of its batch (measured before the update)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        set_lr(self.optimizers, lr / cfg.lr)
        x, y = self.batches.train_batch(self.step, cfg.batch_size)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        accum = cfg.batch_size // cfg.micro_batch_size
        total = torch.zeros((), device=self.device)
        self.model.train()
        for i in range(accum):
            part = slice(i * cfg.micro_batch_size, (i + 1) * cfg.micro_batch_size)
            with self.autocast:
                loss = self.compiled(x[part], y[part])
            (loss / accum).backward()
            total += loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        loss_value = (total / accum).item()
        if math.isfinite(loss_value):       # a NaN gradient step would only poison the checkpoint
            for opt in self.optimizers:
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.log("train/loss", loss_value)
        self.log("lr", lr)
        return loss_value

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        self.model.eval()
        out = {}
        for name in self.sources:
            losses = []
            for x, y in self.batches.val_batches(name, cfg.eval_batches, cfg.micro_batch_size):
                with self.autocast:
                    losses.append(self.compiled(x.to(self.device), y.to(self.device)).item())
            out[f"val/loss/{name}"] = sum(losses) / len(losses)
        # the plain mean over sources: a target that stays put when a run changes the mixture
        out["val/loss"] = sum(out.values()) / len(out)
        for key, value in out.items():
            self.log(key, value)
        return out


def train(cfg: TrainConfig, workdir: Path | str, on_eval: Callable[[int, dict], None] | None = None,
          should_stop: Callable[[], bool] | None = None, resume: bool = True, *,
          cache_dir: Path | str | None = None, record_fields: dict | None = None) -> TrainResult:
    """Train the proxy GPT `cfg` describes in workdir; the run's record, checkpoint and steps done.

    record_fields go into the record as they are (id, tags, hypothesis, parent, notes)."""
    cfg = cfg.resolved()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(cfg, workdir, Path(cache_dir) if cache_dir else default_cache_dir(), record_fields or {})
    ckpt = workdir / CHECKPOINT
    if resume and ckpt.exists():
        run.restore(ckpt)
        log.info("resuming %s from step %d", run.id, run.step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_token = run.model.flops_per_token()
    peak = peak_flops(run.device)
    status, failure, reason = "completed", None, "max_steps"
    evaluated_at = -1
    interval_start, interval_steps = time.perf_counter(), 0
    loop_start, elapsed_before = time.perf_counter(), run.elapsed
    try:
        while run.step < cfg.max_steps:
            # wall time of the whole loop (evaluations and checkpoints too), over every resume
            run.elapsed = elapsed_before + time.perf_counter() - loop_start
            if should_stop is not None and should_stop():
                status, reason = "killed", "stopped"
                failure = {"kind": "killed", "step": run.step, "message": f"stopped on request at step {run.step}"}
                break
            if cfg.max_tokens and run.step * tokens_per_step >= cfg.max_tokens:
                reason = "max_tokens"
                break
            if cfg.max_seconds and run.elapsed >= cfg.max_seconds:
                reason = "max_seconds"
                break
            loss = run.train_step()
            if run.first_loss is None:
                run.first_loss = loss
            if not math.isfinite(loss) or loss > cfg.divergence_factor * run.first_loss:
                status, reason = "diverged", "diverged"
                why = "is not finite" if not math.isfinite(loss) else \
                    f"is above {cfg.divergence_factor:g}x the first loss {run.first_loss:.4g}"
                failure = {"kind": "diverged", "step": run.step,
                           "message": f"train/loss {loss:.6g} at step {run.step} {why}"}
                break
            run.step += 1
            interval_steps += 1
            if run.step % cfg.eval_interval == 0 or run.step == cfg.max_steps:
                if run.device.type == "cuda":
                    torch.cuda.synchronize(run.device)
                rate = interval_steps * tokens_per_step / (time.perf_counter() - interval_start)
                run.rates.append(rate)
                run.log("tokens_per_sec", rate)
                if peak:
                    run.mfus.append(rate * flops_per_token / peak)
                    run.log("mfu", run.mfus[-1])
                metrics = run.evaluate()
                evaluated_at = run.step
                if on_eval is not None:
                    on_eval(run.step, {"train/loss": loss, "lr": run.metrics["lr"][-1][1],
                                       "tokens_per_sec": rate, **metrics})
                interval_start, interval_steps = time.perf_counter(), 0
            if cfg.checkpoint_interval and run.step % cfg.checkpoint_interval == 0:
                run.save()
    except (Exception, KeyboardInterrupt) as exc:
        failure = from_exception(exc, run.step).as_dict()
        if isinstance(exc, torch.OutOfMemoryError):
            failure["kind"] = "oom"
        status, reason = ("killed", "interrupted") if isinstance(exc, KeyboardInterrupt) else ("failed", "exception")
        log.exception("run %s failed at step %d", run.id, run.step)
    run.elapsed = elapsed_before + time.perf_counter() - loop_start
    checkpoint = None
    if status in ("completed", "killed") and reason != "interrupted":
        if status == "completed" and evaluated_at != run.step and run.step > 0:
            run.evaluate()              # a budget stopped it between evals: measure where it ended
        checkpoint = run.save()
    elif ckpt.exists():
        checkpoint = ckpt
    record = build_record(run, status, failure, reason, flops_per_token)
    write_json(workdir / RECORD, record)
    return TrainResult(record=record, checkpoint=checkpoint, steps_done=run.step)


def write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(json_safe(record), default=str))
    os.replace(tmp, path)


def build_record(run: Run, status: str, failure: dict | None, reason: str, flops_per_token: float) -> dict:
    cfg = run.cfg
    tokens = run.step * cfg.batch_size * cfg.seq_len
    params = run.model.num_params()
    summary = {"steps": run.step, "tokens": tokens, "wall_seconds": round(run.elapsed, 3), "stop_reason": reason}
    for key, points in run.metrics.items():
        if key.startswith("val/loss") and points:
            summary[key] = points[-1][1]
    if run.metrics.get("train/loss"):
        summary["train/loss"] = run.metrics["train/loss"][-1][1]
    if run.rates:
        # the median interval: the first one carries compilation and warm-up
        summary["tokens_per_sec"] = statistics.median(run.rates)
    if run.mfus:
        summary["mfu"] = statistics.median(run.mfus)
    # a summary holds finite numbers only (the store's rule); a NaN loss stays in its curve
    summary = {k: v for k, v in summary.items() if not isinstance(v, float) or math.isfinite(v)}
    code = {"entrypoint": sys.argv[0] or None, "argv": list(sys.argv), "command": shlex.join(sys.argv),
            **provenance(REPO)}
    device = run.device
    meta = {"runner": {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "precision": "bf16" if device.type == "cuda" else "fp32",
        "compiled": run.compiled is not run.model, "flops_per_token": flops_per_token,
        "runtime": cfg.runtime(), "data_files": {n: s.files for n, s in run.sources.items()},
        "workdir": str(run.workdir.resolve()), "command": shlex.join(sys.argv)}}
    record = {
        "id": run.id, "project": cfg.project, "name": cfg.name, "status": status, "config": run.config,
        "scale": {"params": params, "tokens": tokens, "flops": 6.0 * params * tokens},
        "metrics": run.metrics, "summary": summary, "tags": ["proxy"],
        "started_at": run.started_at.isoformat(), "ended_at": utcnow().isoformat(),
        "code": code, "meta": meta}
    if failure:
        record["failure"] = failure
    for key, value in run.fields.items():
        record[key] = value
    return record


def main(argv: list[str] | None = None) -> int:
    """`python -m runner.train --config cfg.json --workdir DIR`: one run, its record in DIR/run.json."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m runner.train", description="Train one proxy GPT.")
    ap.add_argument("--config", help="JSON file of options (runner/options.py); none: the defaults")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="an option on top of the file, e.g. --set lr=1e-3 --set pos='\"rope\"'")
    ap.add_argument("--fresh", action="store_true", help="ignore the workdir's checkpoint")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.config).read_text()) if args.config else {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            data[key] = json.loads(value)
        except json.JSONDecodeError:
            data[key] = value           # a bare word: `--set norm=rmsnorm`
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = train(TrainConfig.from_dict(data), Path(args.workdir), resume=not args.fresh,
                       on_eval=lambda step, m: log.info("step %d: %s", step,
                                                        ", ".join(f"{k} {v:.4g}" for k, v in m.items())))
    except KBError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidRecord) else 1
    rec = result.record
    print(json.dumps({"id": rec["id"], "status": rec["status"], "summary": rec["summary"],
                      "record": str(Path(args.workdir) / RECORD)}, default=str))
    return 0 if rec["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
