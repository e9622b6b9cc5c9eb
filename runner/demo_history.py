"""The history `kb demo` shows, trained for real by the proxy trainer on CPU: a learning-rate sweep
at two depths whose highest rate diverges, a positional-encoding ablation with three seeds a side,
a data-mixture variation, and two notes written from what the runs measured.

    python -m runner.demo_history kb/demo_history          # what the package ships (1-2 min on 2 cores)
    files = generate(Path("out"), steps=150, say=print)     # [out/runs.jsonl, out/notes/*.md]

Runs are native records as runner.train writes them (curves, failure, resolved config,
provenance), with stable ids (`d1-lr0.003`, `d1-rope-s2`, `mix-prose0.3`) so a regenerated
history updates the same runs. Every run is tagged `demo`. Project `demo-gpt` holds the sweep and
the ablation; the mixture runs are project `demo-mix`, because a mixture law is fitted over all of
a project's runs (kb.mixture) and the sweep's other rates and depths would read as mixture noise.

Each training runs in a process of its own on one CPU thread, two at a time (the tiny models gain
nothing from a second thread; a second process uses the second core). `steps` scales the whole history (KB_DEMO_STEPS in `kb demo --fresh`: tests use
a few steps); the lr=1 runs diverge at any length: they blow up within their first 15 steps.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROJECT, MIX_PROJECT = "demo-gpt", "demo-mix"
TAG = "demo"
STEPS = 150
# a depth-1 model (d_model 64) takes ~15 ms a step at these sizes, depth 2 (d_model 128) ~60 ms
BASE = {"seq_len": 64, "batch_size": 16, "eval_batches": 2, "checkpoint_interval": 0, "threads": 1,
        "device": "cpu"}
SWEEP = {1: (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 1.0), 2: (3e-4, 1e-3, 3e-3, 1e-2, 1.0)}
ABLATION_LR, SEEDS = 3e-3, 3          # the ablation's baseline is the depth-1 sweep's run at this rate
PROSE = (0.1, 0.3, 0.5, 0.7, 0.9)     # the mixture's prose weight; code takes the rest


@dataclass
class Cell:
    """One training of the history: its record's id, what it sets on the base config, its tags."""
    id: str
    project: str
    options: dict
    tags: list[str] = field(default_factory=list)
    label: str = ""


def lr_text(lr: float) -> str:
    return f"{lr:g}"


def cells() -> list[Cell]:
    out = []
    for depth, lrs in SWEEP.items():
        for lr in lrs:
            out.append(Cell(f"d{depth}-lr{lr_text(lr)}", PROJECT, {"n_layer": depth, "lr": lr}, ["lr-sweep"],
                            f"d{depth} lr={lr_text(lr)} seed 0"))
    for seed in range(1, SEEDS):          # seed 0 of the learned side is the sweep's run
        out.append(Cell(f"d1-lr{lr_text(ABLATION_LR)}-s{seed}", PROJECT,
                        {"n_layer": 1, "lr": ABLATION_LR, "seed": seed}, ["ablation:pos"],
                        f"d1 lr={lr_text(ABLATION_LR)} pos=learned seed {seed}"))
    for seed in range(SEEDS):
        out.append(Cell(f"d1-rope-s{seed}", PROJECT, {"n_layer": 1, "lr": ABLATION_LR, "pos": "rope", "seed": seed},
                        ["ablation:pos"], f"d1 lr={lr_text(ABLATION_LR)} pos=rope seed {seed}"))
    for prose in PROSE:
        mixture = {"prose": prose, "code": round(1 - prose, 6)}
        out.append(Cell(f"mix-prose{prose:g}", MIX_PROJECT,
                        {"n_layer": 1, "lr": ABLATION_LR, "data": {"mixture": mixture}}, ["mixture"],
                        f"d1 mixture prose {prose:g} / code {1 - prose:g}"))
    tagged = f"d1-lr{lr_text(ABLATION_LR)}"
    for c in out:
        if c.id == tagged:
            c.tags.append("ablation:pos")
    return out


def generate(folder: Path | str, steps: int = STEPS, say: Callable[[str], None] | None = None,
             cache_dir: Path | str | None = None, workers: int | None = None) -> list[Path]:
    """Train every cell, write folder/runs.jsonl and folder/notes/*.md; the files written.

    `workers` trainings run at once, each a process on one torch thread (default: two, or one on
    a one-core machine); the records do not depend on it (each run's batches and init are its seed's)."""
    from kb.records import json_safe
    from runner.data import builtin_folder, default_cache_dir

    say = say or (lambda text: None)
    folder = Path(folder)
    (folder / "notes").mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    t0 = time.perf_counter()
    builtin_folder(cache_dir)             # once here, not in each worker at the same time
    if time.perf_counter() - t0 > 1:
        say(f"built the training corpus (the Python standard library, as bytes) in {time.perf_counter() - t0:.0f} s")
    plan = cells()
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    records: dict[str, dict] = {}
    # the depth-2 runs take four times as long: started first, they do not trail at the end
    order = sorted(range(len(plan)), key=lambda i: -plan[i].options.get("n_layer", 1))
    with tempfile.TemporaryDirectory(prefix="kb-demo-") as work, \
            ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(train_cell, plan[i], steps, str(Path(work) / plan[i].id), str(cache_dir)): i
                   for i in order}
        say(f"training {len(plan)} runs, {workers} at a time, {steps} steps each, on CPU")
        for done, future in enumerate(as_completed(futures), start=1):
            cell = plan[futures[future]]
            rec, seconds = future.result()
            records[cell.id] = rec
            say(f"training {done}/{len(plan)}: {cell.label} ... {_outcome(rec)} ({seconds:.1f} s)")
    ordered = [records[c.id] for c in plan]
    runs = folder / "runs.jsonl"
    runs.write_text("".join(json.dumps(json_safe(r), default=str, allow_nan=False) + "\n" for r in ordered))
    notes = write_notes(folder, ordered)
    say(f"trained {len(ordered)} runs in {time.perf_counter() - started:.0f} s; wrote {runs} and {len(notes)} notes")
    return [runs, *notes]


def train_cell(cell: Cell, steps: int, workdir: str, cache_dir: str) -> tuple[dict, float]:
    """One cell's training (in a worker process): its record and the seconds it took."""
    import torch

    from runner.config import TrainConfig
    from runner.train import train

    torch.set_num_threads(1)
    options = {**BASE, "max_steps": steps, "eval_interval": min(25, steps), **cell.options,
               "project": cell.project, "name": cell.id}
    t0 = time.perf_counter()
    result = train(TrainConfig.from_dict(options), Path(workdir), resume=False, cache_dir=cache_dir,
                   record_fields={"id": cell.id, "tags": [TAG, "proxy", *cell.tags]})
    return result.record, time.perf_counter() - t0


def write_notes(folder: Path, records: list[dict]) -> list[Path]:
    """The postmortem and the sweep summary under folder/notes, written from the records."""
    out = []
    for name, text in (("postmortem-lr1-divergence.md", postmortem(records)), ("sweep-summary.md", summary(records))):
        out.append(folder / "notes" / name)
        out[-1].write_text(text)
    return out


def _outcome(rec: dict) -> str:
    if rec["status"] == "diverged":
        return f"diverged at step {rec['failure']['step']}"
    val = rec["summary"].get("val/loss")
    return f"{rec['status']}, val/loss {val:.3f}" if val is not None else rec["status"]


# ---- the notes, written from the runs ---------------------------------------------------------------

def _by_id(records: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in records}


def _val(rec: dict) -> float | None:
    return rec["summary"].get("val/loss") if rec["status"] == "completed" else None


def _lr_at(rec: dict, step: int) -> float | None:
    return next((v for s, v in rec["metrics"].get("lr", []) if s == step), None)


def postmortem(records: list[dict]) -> str:
    runs = _by_id(records)
    diverged = [r for r in records if r["status"] == "diverged"]
    lines = ["---", f"project: {PROJECT}", "---", "",
             "# Postmortem: the lr=1 runs of the demo-gpt sweep diverged", "", "## What happened", ""]
    for r in diverged:
        f, cfg = r["failure"], r["config"]
        at = _lr_at(r, f["step"])
        when = (f"during the {cfg['warmup_steps']}-step warmup" if f["step"] < cfg["warmup_steps"]
                else f"after the {cfg['warmup_steps']}-step warmup")
        lines.append(f"- `{r['id']}` (depth {cfg['n_layer']}, d_model {cfg['d_model']}) diverged at step {f['step']} "
                     f"of {cfg['max_steps']}, {when}" + (f", with the lr at {at:.3g}" if at is not None else "")
                     + f": {f['message']}.")
    lines += ["", "## Why we think so", ""]
    for depth, lrs in SWEEP.items():
        below = [runs[f"d{depth}-lr{lr_text(lr)}"] for lr in lrs]
        done = [r for r in below if _val(r) is not None]
        if done:
            top = max(done, key=lambda r: r["config"]["lr"])
            lines.append(f"At depth {depth} the highest rate that finished, `{top['id']}` (lr {lr_text(top['config']['lr'])}), "
                         f"ended at val/loss {_val(top):.3f}; the step from it to lr 1 is where training stops being stable "
                         "for AdamW with beta2 0.95 and gradient clipping at 1.0 at this width.")
    lines += ["", "## What we changed", "",
              f"Sweeps of this model stay at or below lr 0.1; the ablations use lr {lr_text(ABLATION_LR)}.", ""]
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    runs = _by_id(records)
    lines = ["---", f"project: {PROJECT}", "---", "", "# Sweep summary: demo-gpt learning rates, positional encoding, mixture", "",
             "## Learning-rate sweep", "", "| depth | lr | run | status | val/loss |", "|---|---|---|---|---|"]
    best = {}
    for depth, lrs in SWEEP.items():
        for lr in lrs:
            r = runs[f"d{depth}-lr{lr_text(lr)}"]
            v = _val(r)
            lines.append(f"| {depth} | {lr_text(lr)} | `{r['id']}` | {r['status']} | {'-' if v is None else f'{v:.3f}'} |")
            if v is not None and (depth not in best or v < _val(best[depth])):
                best[depth] = r
    lines.append("")
    for depth, r in best.items():
        lines.append(f"The best rate at depth {depth} was lr {lr_text(r['config']['lr'])} (`{r['id']}`, val/loss {_val(r):.3f}).")
    learned = [runs[f"d1-lr{lr_text(ABLATION_LR)}" + (f"-s{s}" if s else "")] for s in range(SEEDS)]
    rope = [runs[f"d1-rope-s{s}"] for s in range(SEEDS)]
    lines += ["", "## Positional encoding: learned vs rope", ""]
    sides = [("learned", learned), ("rope", rope)]
    if all(_val(r) is not None for _, rs in sides for r in rs):
        for name, rs in sides:
            vals = [_val(r) for r in rs]
            ids = ", ".join(f"`{r['id']}`" for r in rs)
            lines.append(f"- {name}: val/loss {statistics.fmean(vals):.3f} mean, {statistics.stdev(vals):.3f} sd over "
                         f"{len(vals)} seeds ({ids})")
        delta = statistics.fmean(map(_val, rope)) - statistics.fmean(map(_val, learned))
        lines += ["", f"Rope minus learned: {delta:+.3f} in val/loss at depth 1, lr {lr_text(ABLATION_LR)}."]
    lines += ["", "## Data mixture (project demo-mix)", "", "| prose | code | run | val/loss |", "|---|---|---|---|"]
    for prose in PROSE:
        r = runs[f"mix-prose{prose:g}"]
        v = _val(r)
        lines.append(f"| {prose:g} | {1 - prose:g} | `{r['id']}` | {'-' if v is None else f'{v:.3f}'} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m runner.demo_history", description="Train the demo history.")
    ap.add_argument("folder", help="where runs.jsonl and notes/ go (the package ships kb/demo_history)")
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args(argv)
    generate(Path(args.folder), steps=args.steps, say=lambda text: print(text, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
