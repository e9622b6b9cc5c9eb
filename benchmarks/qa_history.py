"""A generated pretraining history whose facts are known, for the QA evaluation
(benchmarks/qa_eval.py) and its CI slice (tests/test_qa_quality.py).

    h = make_history("full")       # 500 native runs in 6 projects, 10 notes, 12 MLflow runs, 8 TensorBoard runs
    build(kb, h, folder)           # benchmarks/qa_build.py: the files a team would have, ingested the real way

What a team's history looks like: learning-rate x warmup x batch sweeps at four model sizes
(125M / 350M / 760M / 1.3B, as `scale.params`), a token-budget scaling study, norm and position
ablations with seeds, data-mixture runs logged under other names (`eval_loss`, `learning_rate`),
long-context runs, and a production run's restarts with OOMs, NCCL timeouts, a bad GPU and a
divergence. Too-high learning rates diverge (sooner with a short warmup), with failure records
and evidence lines; postmortems and design notes carry facts no run has (benchmarks/qa_notes.py).
A legacy project lives in MLflow and a warmup study in TensorBoard.

Final losses come from a Chinchilla-style law (L = E + A/N^a + B/D^b, Hoffmann et al.'s fitted
constants) plus penalties for a learning rate away from the size's best, a short warmup, layernorm,
learned positions, the data mixture, and a per-run seed noise; every value is rounded to 4
decimals as written, so the facts the questions are scored against are exactly what was ingested.
"""
from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from benchmarks.qa_notes import NOTES

# nominal size -> (n_layer, d_model, params, Chinchilla tokens (20 per param), best lr, lowest lr that diverges)
SIZES = {
    "125M": (12, 768, 125_000_000, 2_500_000_000, 6e-4, 6e-3),
    "350M": (24, 1024, 350_000_000, 7_000_000_000, 3e-4, 3e-3),
    "760M": (24, 1536, 760_000_000, 15_000_000_000, 3e-4, 3e-3),
    "1.3B": (24, 2048, 1_300_000_000, 26_000_000_000, 2e-4, 1e-3),
}
LRS = (1e-4, 3e-4, 6e-4, 1e-3, 3e-3, 6e-3)
MIXES = {"web": 0.0, "web+code": -0.012, "web+code+math": 0.009, "web+books": -0.021}
SHORT_WARMUP = 500       # a warmup this short lets the next-lower lr diverge too

# what each plan builds; "ci" is the slice tests/test_qa_quality.py runs (~100 runs)
PLANS = {
    "full": {"sweep": (("125M", "350M", "760M", "1.3B"), (500, 2000), (256, 512), (0, 1, 2)),
             "scaling": (("125M", "350M", "760M", "1.3B"), (0.5, 1, 2, 4), (0, 1, 2)),
             "arch": (("125M", "350M", "760M"), (0, 1, 2)),
             "mix": (("350M", "760M"), (1, 2), (0, 1, 2)),
             "long": (("125M", "350M"), (0, 1, 2)),
             "prod": 44, "mlflow": 12, "tensorboard": 8},
    "ci": {"sweep": (("125M", "350M"), (500, 2000), (256,), (0, 1)),
           "scaling": (("125M", "350M"), (1, 4), (0, 1)),
           "arch": (("125M",), (0, 1)),
           "mix": (("350M",), (1,), (0, 1)),
           "long": ((), ()),
           "prod": 12, "mlflow": 6, "tensorboard": 4},
}
MLFLOW_PROJECT, TB_PROJECT = "mlflow-legacy", "tb-warmup"
EPOCH = datetime(2025, 1, 6, 9, 0, tzinfo=timezone.utc)


@dataclass
class History:
    plan: str
    records: list[dict]                 # native run records, as written to runs.jsonl
    notes: dict[str, str]               # file name -> Markdown
    mlflow: list[dict]                  # what MlflowClient logs: name, params, metrics, status
    tensorboard: list[dict]             # what SummaryWriter logs: name, hparams, metrics
    facts: list[dict] = field(default_factory=list)   # every run, flat: the truth questions are scored on

    def by_id(self) -> dict[str, dict]:
        return {f["id"]: f for f in self.facts if f.get("id")}


def _noise(key: str, sigma: float = 0.004) -> float:
    """A seed's deviation, the same on every machine (no dependence on PYTHONHASHSEED)."""
    return random.Random(zlib.crc32(key.encode())).gauss(0.0, sigma)


def final_loss(size: str, lr: float, tokens: float, *, warmup: int = 2000, batch: int = 256,
               norm: str = "rmsnorm", pos: str = "rope", mix: str = "web+code", seq_len: int = 2048,
               rope_theta: float = 10_000.0, noise: float = 0.0) -> float:
    _, _, params, _, best_lr, _ = SIZES[size]
    loss = 1.69 + 406.4 / params ** 0.34 + 410.7 / tokens ** 0.28
    loss += 0.12 * math.log10(lr / best_lr) ** 2
    loss += 0.012 if warmup <= SHORT_WARMUP else 0.0
    loss += 0.006 if batch >= 512 else 0.0
    loss += 0.011 if norm == "layernorm" else 0.0
    loss += 0.024 if pos == "learned" else 0.0
    loss += MIXES[mix]
    # longer context lowers the loss only when rope's base is large enough to reach that far
    loss += {2048: 0.0, 4096: -0.008, 8192: -0.013}[seq_len] * (1 if rope_theta >= 5e5 or seq_len <= 4096 else -1.5)
    return round(loss + noise, 4)


def diverges(size: str, lr: float, warmup: int) -> bool:
    limit = SIZES[size][5]
    if warmup <= SHORT_WARMUP:
        limit = LRS[max(0, LRS.index(limit) - 1)]
    return lr >= limit


def curves(final: float, steps: int, *, diverge_at: int | None = None, stop_at: int | None = None,
           spike_at: int | None = None, train_key: str = "train/loss", val_key: str = "val/loss") -> dict:
    """train/loss at 40 points and val/loss at 8, both falling from 10.9 to `final` (val) at `steps`.

    A divergence blows the loss up over its last 3 points and ends both curves in NaN; a crash
    (`stop_at`) cuts them off; a spike adds 1.8 to the train loss at two points."""
    tau = steps / 50
    tail = (1 + steps / tau) ** -0.6
    scale = (10.9 - final) / (1 - tail)

    def at(t: int) -> float:
        return final + scale * ((1 + t / tau) ** -0.6 - tail)

    end = min(x for x in (steps, diverge_at, stop_at) if x is not None)
    train = [[s, round(at(s) - 0.02, 4)] for s in (steps * i // 40 for i in range(41)) if s <= end]
    val = [[s, round(at(s), 4)] for s in (steps * i // 8 for i in range(1, 9)) if s <= end]
    if spike_at is not None:
        for p in train:
            if spike_at <= p[0] < spike_at + steps // 20:
                p[1] = round(p[1] + 1.8, 4)
    if diverge_at is not None:
        for i, p in enumerate(train[-3:]):
            p[1] = round(p[1] * (1.6 + i), 4)
        train.append([diverge_at + steps // 40, "NaN"])
        val.append([diverge_at + steps // 40, "NaN"])
    return {train_key: train, val_key: val}


def _model(size: str, norm: str = "rmsnorm", pos: str = "rope") -> dict:
    layers, width = SIZES[size][:2]
    return {"n_layer": layers, "d_model": width, "n_head": width // 64, "norm": norm, "pos": pos,
            "vocab_size": 50304}


def _lr_tag(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")          # 3e-4, 1e-3


def _run(project: str, rid: str, name: str, size: str, lr: float, tokens: float, *, warmup: int = 2000,
         batch: int = 256, seed: int = 0, norm: str = "rmsnorm", pos: str = "rope", mix: str = "web+code",
         seq_len: int = 2048, rope_theta: float | None = None, day: int = 0, tags=(), vocab: str = "native",
         notes: str = "") -> dict:
    """One run record and its fact row; diverging learning rates make diverged runs."""
    loss = final_loss(size, lr, tokens, warmup=warmup, batch=batch, norm=norm, pos=pos, mix=mix,
                      seq_len=seq_len, rope_theta=rope_theta or 10_000.0, noise=_noise(rid))
    steps = int(tokens // (batch * seq_len)) // 100 * 100
    blown = diverges(size, lr, warmup)
    diverge_at = (warmup + steps // 20) // 10 * 10 if blown else None
    if vocab == "native":
        config = {"model": _model(size, norm, pos) | ({"rope_theta": rope_theta} if rope_theta else {}),
                  "optim": {"name": "adamw", "lr": lr, "warmup_steps": warmup, "weight_decay": 0.1,
                            "beta2": 0.95, "grad_clip": 1.0},
                  "data": {"mixture": mix, "batch_size": batch, "seq_len": seq_len}, "seed": seed}
        metric_keys = ("train/loss", "val/loss")
    else:       # the data team's trainer logs HF-style names; the vocabulary maps them
        config = {"model": _model(size, norm, pos),
                  "optimizer": {"learning_rate": lr, "warmup_steps": warmup, "weight_decay": 0.1},
                  "data": {"mixture": mix, "global_batch_size": batch, "max_seq_len": seq_len}, "seed": seed}
        metric_keys = ("train_loss", "eval_loss")
    # a recovered loss spike, as the 760M runs at lr 1e-3 had: realism for the anomaly detector
    spike = steps // 3 if size == "760M" and lr == 1e-3 and not blown else None
    metrics = curves(loss, steps, diverge_at=diverge_at, spike_at=spike, train_key=metric_keys[0],
                     val_key=metric_keys[1])
    rec = {"id": rid, "project": project, "name": name, "config": config,
           "scale": {"params": SIZES[size][2], "tokens": int(tokens)}, "metrics": metrics,
           "tags": list(tags), "started_at": (EPOCH + timedelta(days=day, hours=seed)).isoformat()}
    fact = {"id": rid, "name": name, "project": project, "size": size, "lr": lr, "tokens": int(tokens),
            "warmup": warmup, "batch": batch, "seed": seed, "norm": norm, "pos": pos, "mix": mix,
            "seq_len": seq_len, "rope_theta": rope_theta, "status": "completed", "val": loss, "failure": None,
            "steps": steps, "vocab": vocab}
    if blown:
        rec["status"] = "diverged"
        train = metrics[metric_keys[0]]
        evidence = [f"step {train[-4][0]} | loss {train[-4][1]} | grad_norm 8.7",
                    f"step {train[-2][0]} | loss {train[-2][1]} | grad_norm 61.2",
                    f"step {train[-1][0]} | loss nan | grad_norm nan"]
        rec["failure"] = {"kind": "diverged", "step": train[-1][0], "message": "loss is NaN; training stopped",
                          "evidence": evidence}
        rec["notes"] = notes or "grad norm blew up right after warmup; loss went NaN"
        fact |= {"status": "diverged", "val": None, "failure": "diverged", "fail_step": train[-1][0]}
    else:
        rec["summary"] = {metric_keys[1]: loss, metric_keys[0]: metrics[metric_keys[0]][-1][1]}
        if notes:
            rec["notes"] = notes
    return rec, fact


def sweep_runs(plan: dict) -> list[tuple[dict, dict]]:
    sizes, warmups, batches, seeds = plan["sweep"]
    out = []
    for day, size in enumerate(sizes):
        for lr in LRS:
            for warmup in warmups:
                for batch in batches:
                    for seed in seeds:
                        rid = f"sw-{size.lower()}-lr{_lr_tag(lr)}-wu{warmup}-b{batch}-s{seed}"
                        name = f"sweep {size} lr={lr:g} warmup={warmup} bs={batch} seed={seed}"
                        tags = ["lr-sweep"] + (["baseline"] if lr == SIZES[size][4] and warmup == 2000 else [])
                        out.append(_run("gpt-sweep", rid, name, size, lr, SIZES[size][3], warmup=warmup,
                                        batch=batch, seed=seed, day=3 * day, tags=tags))
    return out


def scaling_runs(plan: dict) -> list[tuple[dict, dict]]:
    sizes, mults, seeds = plan["scaling"]
    out = []
    for size in sizes:
        for mult in mults:
            for seed in seeds:
                tokens = SIZES[size][3] * mult
                rid = f"sl-{size.lower()}-{mult:g}x-s{seed}"
                out.append(_run("scaling-laws", rid, f"scaling {size} {tokens / 1e9:g}B tokens seed {seed}",
                                size, SIZES[size][4], tokens, batch=512, seed=seed, day=20, tags=["scaling"]))
    return out


def arch_runs(plan: dict) -> list[tuple[dict, dict]]:
    sizes, seeds = plan["arch"]
    out = []
    for size in sizes:
        for norm in ("layernorm", "rmsnorm"):
            for pos in ("learned", "rope"):
                for seed in seeds:
                    rid = f"arch-{size.lower()}-{norm}-{pos}-s{seed}"
                    tags = ["ablation:norm"] + (["baseline"] if norm == "layernorm" and pos == "learned" else [])
                    out.append(_run("gpt-arch", rid, f"arch {size} {norm} {pos} seed {seed}", size,
                                    SIZES[size][4], SIZES[size][3], norm=norm, pos=pos, seed=seed, day=30,
                                    tags=tags))
    return out


def mix_runs(plan: dict) -> list[tuple[dict, dict]]:
    sizes, mults, seeds = plan["mix"]
    out = []
    for size in sizes:
        for mix in MIXES:
            for mult in mults:
                for seed in seeds:
                    slug = mix.replace("+", "-")
                    rid = f"mix-{size.lower()}-{slug}-{mult:g}x-s{seed}"
                    out.append(_run("data-mix", rid, f"mix {size} {mix} {mult:g}x seed {seed}", size,
                                    SIZES[size][4], SIZES[size][3] * mult, mix=mix, seed=seed, day=45,
                                    tags=["data"], vocab="hf"))
    return out


def long_runs(plan: dict) -> list[tuple[dict, dict]]:
    sizes, seeds = plan["long"]
    out = []
    for size in sizes:
        for seq_len in (2048, 4096, 8192):
            for theta in (10_000.0, 500_000.0):
                for seed in seeds:
                    rid = f"lc-{size.lower()}-ctx{seq_len}-theta{int(theta)}-s{seed}"
                    out.append(_run("long-ctx", rid, f"long-ctx {size} ctx={seq_len} theta={int(theta)} seed {seed}",
                                    size, SIZES[size][4], SIZES[size][3], batch=256, seq_len=seq_len,
                                    rope_theta=theta, seed=seed, day=60, tags=["long-context"]))
    return out


# the production 1.3B run's attempts that ended badly: attempt -> (status, kind, step, message, evidence)
PROD_FAILURES = {
    3: ("failed", "oom", 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.05 GiB",
        ["micro_batch_size=16 activation_checkpointing=False", "GPU 5 has a total capacity of 79.15 GiB"]),
    7: ("failed", "nccl_timeout", 14350, "Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE) "
        "ran for 600312 milliseconds before timing out", ["[Rank 12] NCCL WARN NET/IB : Got completion with error 12",
                                                            "node gpu-r14-03"]),
    8: ("failed", "nccl_timeout", 2210, "Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLGATHER) "
        "ran for 600045 milliseconds before timing out", ["[Rank 40] NCCL WARN NET/IB : Got completion with error 12",
                                                           "node gpu-r14-06"]),
    11: ("failed", "hardware", 9120, "uncorrectable ECC error on GPU 3", ["Xid 48: DBE (double bit error)",
                                                                          "node gpu-r09-02"]),
    15: ("killed", "killed", 20480, "preempted by the scheduler (SIGTERM)", ["slurmstepd: JOB CANCELLED DUE TO PREEMPTION"]),
    21: ("failed", "oom", 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB",
         ["micro_batch_size=16 activation_checkpointing=False", "GPU 0 has a total capacity of 79.15 GiB"]),
    26: ("diverged", "diverged", None, "loss is NaN; training stopped", None),
    33: ("failed", "nccl_timeout", 31870, "Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE) "
         "ran for 600201 milliseconds before timing out", ["[Rank 7] NCCL WARN NET/IB : Got completion with error 12",
                                                           "node gpu-r14-01"]),
}


def prod_runs(plan: dict) -> list[tuple[dict, dict]]:
    """The production run's attempts: the same recipe relaunched, with the knobs people turn after a
    failure (micro-batch, checkpointing, lr for one attempt)."""
    out = []
    for attempt in range(1, plan["prod"] + 1):
        rid = f"prod-1b3-a{attempt:02d}"
        bad = PROD_FAILURES.get(attempt)
        micro = 16 if bad and bad[1] == "oom" else 8
        lr = 1e-3 if bad and bad[1] == "diverged" else 2e-4
        rec, fact = _run("prod-1b3", rid, f"prod 1.3B attempt {attempt}", "1.3B", lr, 26_000_000_000,
                         warmup=2000, batch=512, seed=attempt, day=70 + attempt, tags=["production"])
        rec["config"]["parallel"] = {"micro_batch_size": micro, "activation_checkpointing": micro == 8,
                                     "tensor_parallel": 2}
        rec["parent"] = f"prod-1b3-a{attempt - 1:02d}" if attempt > 1 else None
        fact |= {"micro_batch": micro}
        if bad and bad[1] != "diverged":
            status, kind, step, message, evidence = bad
            steps = fact["steps"]
            rec["metrics"] = curves(fact["val"], steps, stop_at=step) if step > 10 else {}
            if not rec["metrics"]:
                rec["metrics"] = {"train/loss": [[0, 10.9]]}
            rec["status"] = status
            rec["failure"] = {"kind": kind, "step": step, "message": message, "evidence": evidence}
            vals = rec["metrics"].get("val/loss") or []
            rec["summary"] = {"val/loss": vals[-1][1]} if vals else {}
            fact |= {"status": status, "failure": kind, "fail_step": step, "val": vals[-1][1] if vals else None}
        out.append((rec, fact))
    return out


def mlflow_runs(n: int) -> list[dict]:
    """A legacy project logged to MLflow: flat params, `val_loss` curves."""
    out = []
    for i in range(n):
        lr, warmup = (1e-4, 3e-4, 6e-4, 1e-3, 2e-3, 3e-3)[i % 6], (250, 1000)[i // 6 % 2]
        loss = round(3.35 + 0.1 * math.log10(lr / 6e-4) ** 2 + (0.015 if warmup == 250 else 0) + _noise(f"ml{i}"), 4)
        status = "FAILED" if lr >= 3e-3 and warmup == 250 else "FINISHED"
        steps = list(range(0, 3001, 250))
        val = [round(loss + 6.0 * (1 - s / 3000) ** 2, 4) for s in steps]
        out.append({"name": f"legacy-lr{lr:g}-wu{warmup}", "params": {"lr": lr, "warmup_steps": warmup,
                    "n_layer": 12, "d_model": 768, "batch_size": 256},
                    "metrics": {"val_loss": list(zip(steps, val)), "train_loss": [(s, v - 0.03) for s, v in zip(steps, val)]},
                    "status": status, "val": val[-1]})
    return out


def tensorboard_runs(n: int) -> list[dict]:
    """A warmup study logged with SummaryWriter; values are float32 in the event files, so the
    truth is the float32 value."""
    import numpy as np
    out = []
    for i in range(n):
        warmup = (100, 250, 500, 1000, 2000, 4000, 150, 750)[i]
        loss = round(3.6 + 0.06 * abs(math.log2(warmup / 1000)) + _noise(f"tb{i}"), 4)
        steps = list(range(0, 2001, 200))
        val = [round(loss + 5.0 * (1 - s / 2000) ** 2, 4) for s in steps]
        out.append({"name": f"wu-{warmup}", "hparams": {"warmup_steps": warmup, "lr": 6e-4},
                    "metrics": {"val/loss": list(zip(steps, val)), "train/loss": [(s, v - 0.02) for s, v in zip(steps, val)]},
                    "val": float(np.float32(val[-1]))})
    return out


def make_history(plan: str = "full") -> History:
    p = PLANS[plan]
    pairs = sweep_runs(p) + scaling_runs(p) + arch_runs(p) + mix_runs(p) + long_runs(p) + prod_runs(p)
    records = [r for r, _ in pairs]
    facts = [f for _, f in pairs]
    ml, tb = mlflow_runs(p["mlflow"]), tensorboard_runs(p["tensorboard"])
    for r in ml:
        facts.append({"id": None, "name": r["name"], "project": MLFLOW_PROJECT, "lr": r["params"]["lr"],
                      "warmup": r["params"]["warmup_steps"], "val": r["val"],
                      "status": "completed" if r["status"] == "FINISHED" else "failed"})
    for r in tb:
        facts.append({"id": None, "name": r["name"], "project": TB_PROJECT, "lr": r["hparams"]["lr"],
                      "warmup": r["hparams"]["warmup_steps"], "val": r["val"], "status": "completed"})
    notes = {name: text for name, text in NOTES.items() if plan == "full" or name in CI_NOTES}
    return History(plan, records, notes, ml, tb, facts)


CI_NOTES = ("postmortem-sweep-divergence.md", "postmortem-nccl-timeouts.md", "design-rmsnorm.md",
            "tokenizer-decision.md", "untrusted-vendor-note.md", "oncall-oom.md")
