"""Throughput of the proxy trainer against a plain nanoGPT-style loop, and its MFU on a GPU.

    python benchmarks/proxy_trainer.py                 # CPU comparison (+ GPU MFU when there is one)
    python benchmarks/proxy_trainer.py --json
    python benchmarks/proxy_trainer.py --rounds 6 --steps 10 --threads 1

CPU: the same model size for both (4 layers, 4 heads, d 128, context 128, vocab 256, batch 16,
AdamW) on the built-in stdlib corpus. The reference is written here the way nanoGPT's train.py
and model.py do it (biased LayerNorm and Linear, learned positions, tied head, SDPA attention,
random windows of a memmap per batch, clip, step); the proxy side is runner.train's own step
(mixture batches, schedule, the loss check the divergence test needs). Where the proxy is
faster it is by choices it makes on purpose: no biases and fused AdamW. The two alternate in
rounds of `--steps` steps after a warm-up, so a neighbour's load on a shared machine hits both;
the ratio is the median over rounds of proxy / reference (target >= 1.0). One complete
`train()` run of the same config is reported beside it, evaluation and all.

GPU (skipped with a message without one): a GPT-2 124M config (12 layers, d 768, 12 heads,
vocab 50304, context 1024) under bf16 autocast and torch.compile on random tokens written as a
.bin shard, MFU against the chip's dense bf16 peak (target >= 45% on H100/H200).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

CPU_CONFIG = {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 256,
              "batch_size": 16, "optimizer": "adamw", "lr": 1e-3, "warmup_steps": 10,
              "data.mixture": {"code": 1.0}}
GPU_CONFIG = {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50304,
              "batch_size": 64, "micro_batch_size": 16, "lr": 6e-4, "warmup_steps": 10, "eval_batches": 1,
              "device": "cuda", "compile": True}


# ---- the reference: nanoGPT as written -----------------------------------------------------------

class RefAttention(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), RefAttention(d, h), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, h: int, n_layer: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(RefBlock(d, h) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Reference:
    def __init__(self, tokens: np.ndarray, cfg: dict):
        torch.manual_seed(0)
        self.model = RefGPT(cfg["vocab_size"], cfg["seq_len"], cfg["d_model"], cfg["n_head"], cfg["n_layer"])
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=cfg["lr"], betas=(0.9, 0.95))
        self.tokens, self.T, self.B = tokens, cfg["seq_len"], cfg["batch_size"]

    def step(self) -> float:
        ix = torch.randint(len(self.tokens) - self.T - 1, (self.B,))
        x = torch.stack([torch.from_numpy(self.tokens[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.tokens[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


# ---- measuring ---------------------------------------------------------------------------------------

def timed(step, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        step()
    return time.perf_counter() - t


def cpu_comparison(rounds: int, steps: int, threads: int, workdir: Path) -> dict:
    from runner.config import TrainConfig
    from runner.train import Run, train
    from runner.data import default_cache_dir

    torch.set_num_threads(threads)
    cfg = TrainConfig.from_dict({**CPU_CONFIG, "threads": threads, "max_steps": 10**6}).resolved()
    proxy = Run(cfg, workdir / "proxy", default_cache_dir(), {})

    def proxy_step():
        proxy.train_step()
        proxy.step += 1

    ref = Reference(proxy.sources["code"].train[0], CPU_CONFIG)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    timed(proxy_step, 3), timed(ref.step, 3)                 # warm-up: allocator, first-call paths
    proxy_rates, ref_rates = [], []
    for r in range(rounds):
        # alternate which goes first, so neither always follows the other's cache state
        order = [("proxy", proxy_step), ("ref", ref.step)] if r % 2 == 0 else [("ref", ref.step), ("proxy", proxy_step)]
        for name, step in order:
            rate = steps * tokens_per_step / timed(step, steps)
            (proxy_rates if name == "proxy" else ref_rates).append(rate)
    p, q = statistics.median(proxy_rates), statistics.median(ref_rates)
    # each round's two measurements share the machine's load of the moment: their ratio is steadier
    paired = statistics.median(a / b for a, b in zip(proxy_rates, ref_rates))
    whole = train(TrainConfig.from_dict({**CPU_CONFIG, "threads": threads, "max_steps": 2 * steps,
                                         "eval_interval": steps, "eval_batches": 2}),
                  workdir / "whole", resume=False).record
    return {"config": CPU_CONFIG, "threads": threads, "rounds": rounds, "steps_per_round": steps,
            "params": {"proxy": proxy.model.num_params(),
                       "reference": sum(t.numel() for t in ref.model.parameters())},
            "proxy_tokens_per_sec": p, "reference_tokens_per_sec": q, "ratio": paired, "ratio_of_medians": p / q,
            "proxy_rounds": proxy_rates, "reference_rounds": ref_rates,
            "train_run": {"tokens_per_sec": whole["summary"]["tokens_per_sec"],
                          "val_loss": whole["summary"]["val/loss"], "status": whole["status"]}}


def gpu_mfu(steps: int, workdir: Path) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU: torch sees no CUDA device"}
    from runner.config import TrainConfig
    from runner.data import write_shard
    from runner.train import train

    rng = np.random.default_rng(0)
    shard = write_shard(workdir / "random.bin", rng.integers(0, 50257, size=20_000_000, dtype=np.uint16))
    cfg = TrainConfig.from_dict({**GPU_CONFIG, "max_steps": steps, "eval_interval": max(1, steps // 3),
                                 "data.sources": {"random": str(shard)}})
    rec = train(cfg, workdir / "gpu", resume=False).record
    runner = rec["meta"]["runner"]
    return {"device": runner["device"], "params": rec["scale"]["params"], "config": GPU_CONFIG,
            "tokens_per_sec": rec["summary"]["tokens_per_sec"], "mfu": rec["summary"].get("mfu"),
            "mfu_intervals": [v for _, v in rec["metrics"].get("mfu", [])], "status": rec["status"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="steps per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gpu-steps", type=int, default=60)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = {"cpu": cpu_comparison(args.rounds, args.steps, args.threads, Path(tmp)),
               "gpu": gpu_mfu(args.gpu_steps, Path(tmp))}
    out["torch"] = torch.__version__
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return
    c = out["cpu"]
    print(f"CPU, {c['threads']} thread(s), {c['rounds']} interleaved rounds of {c['steps_per_round']} steps "
          f"(4 layers, d 128, context 128, batch 16):")
    print(f"  proxy trainer   {c['proxy_tokens_per_sec']:9.0f} tokens/s  ({c['params']['proxy']:,} params)")
    print(f"  nanoGPT-style   {c['reference_tokens_per_sec']:9.0f} tokens/s  ({c['params']['reference']:,} params)")
    print(f"  ratio           {c['ratio']:9.2f}  (target >= 1.0)")
    print(f"  a whole train() run: {c['train_run']['tokens_per_sec']:.0f} tokens/s, val/loss "
          f"{c['train_run']['val_loss']:.3f}")
    g = out["gpu"]
    if "skipped" in g:
        print(f"GPU MFU: skipped ({g['skipped']})")
    else:
        mfu = g["mfu"]
        print(f"GPU {g['device']}: 124M config, bf16 + compile: {g['tokens_per_sec']:.0f} tokens/s, "
              f"MFU {'unknown peak' if mfu is None or math.isnan(mfu) else f'{100 * mfu:.1f}%'} (target >= 45%)")


if __name__ == "__main__":
    main()
