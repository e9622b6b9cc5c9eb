"""Optimizers and the learning-rate schedule of the proxy trainer.

    opts = make_optimizers(model, cfg, device)   # [AdamW] or [Muon, AdamW]
    set_lr(opts, lr_at(step, cfg) / cfg.lr)      # every group follows the one schedule

AdamW decays the weight matrices only: gains, biases and embeddings are left alone (decaying an
embedding row pulls rare tokens to zero). `muon` is torch.optim.Muon on the hidden matrices
(attention and MLP weights), with Moonshot's RMS matching (`match_rms_adamw`) so it takes
AdamW's learning rate and weight decay; embeddings, the output head and gains stay on AdamW,
as Muon's authors prescribe. The fused q/k/v matrix is orthogonalised as one matrix.

Schedules: linear warmup to `lr` over `warmup_steps`, then `cosine` or `linear` decay to
`min_lr` at `max_steps`, or `wsd` (warmup, stable, decay): constant until the last
`decay_frac` of the steps, then linear to `min_lr`.
"""
from __future__ import annotations

import math

import torch

from runner.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) under cfg's schedule."""
    peak, low, warm, total = cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "wsd":
        start = max(warm, total - cfg.decay_frac * total)
        progress = min(1.0, max(0.0, (step - start) / max(1.0, total - start)))
        return peak - (peak - low) * progress
    progress = min(1.0, (step - warm) / max(1, total - warm))
    if cfg.schedule == "linear":
        return peak - (peak - low) * progress
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """{hidden: block matrices, head: an untied output matrix, rest: embeddings, gains}."""
    groups: dict[str, list] = {"hidden": [], "head": [], "rest": []}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith("blocks.") and p.ndim == 2:
            groups["hidden"].append(p)
        elif name.startswith("lm_head."):
            groups["head"].append(p)
        else:
            groups["rest"].append(p)
    return groups


def make_optimizers(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> list[torch.optim.Optimizer]:
    g = param_groups(model)
    # one kernel per step instead of a loop over tensors: ~9x faster on CPU, and the usual on GPU
    fused = {"fused": True} if device.type in ("cuda", "cpu") else {}
    adam_groups = [{"params": g["rest"], "weight_decay": 0.0}]
    if g["head"]:
        adam_groups.append({"params": g["head"], "weight_decay": cfg.weight_decay})
    opts: list[torch.optim.Optimizer] = []
    if cfg.optimizer == "muon":
        opts.append(torch.optim.Muon(g["hidden"], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     momentum=cfg.beta1, adjust_lr_fn="match_rms_adamw"))
    else:
        adam_groups.append({"params": g["hidden"], "weight_decay": cfg.weight_decay})
    opts.append(torch.optim.AdamW(adam_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **fused))
    for opt in opts:
        for group in opt.param_groups:
            group["base_lr"] = cfg.lr
    return opts


def set_lr(optimizers: list[torch.optim.Optimizer], factor: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
