"""Ingest speed per source, on stores written by the real libraries.

    python benchmarks/ingest_sources.py [--mlflow-runs 2000] [--tb-folders 500] [--points 200]

Builds (once, cached under benchmarks/.cache/) a MLflow tracking store on SQLite through
MlflowClient.log_batch and a TensorBoard tree through torch's SummaryWriter, then ingests
each with `KnowledgeBase.ingest` into a fresh embedded store, in one process and then by the
ingest workers (ingest.pipeline), and prints runs/s, points/s and the ratio.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

from synth import flat_params, make_runs  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"


def build_mlflow(path: Path, n: int, points: int) -> tuple[str, int]:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{path}"
    runs = make_runs(n, curves=3, points=points, seed=3)
    if path.exists():
        return uri, sum(len(p) for r in runs for p in r["metrics"].values())
    tmp = path.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
    exp = client.create_experiment("bench-sources")
    t = time.perf_counter()
    for i, r in enumerate(runs):
        run = client.create_run(exp, run_name=r["name"])
        metrics = [Metric(k, v, int(ts * 1000), s) for k, pts in r["metrics"].items() for s, v, ts in pts]
        client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in flat_params(r["config"]).items()])
        client.set_terminated(run.info.run_id)
        if (i + 1) % 250 == 0:
            print(f"  (building mlflow store: {i + 1}/{n} runs, {time.perf_counter() - t:.0f} s)", flush=True)
    tmp.rename(path)
    return uri, sum(len(p) for r in runs for p in r["metrics"].values())


def build_tensorboard(root: Path, n: int, points: int) -> int:
    from torch.utils.tensorboard import SummaryWriter
    done = root / ".complete"
    total = n * 3 * points
    if done.exists():
        return total
    shutil.rmtree(root, ignore_errors=True)
    for i in range(n):
        w = SummaryWriter(log_dir=str(root / f"sweep-{i // 50}" / f"run-{i:04d}"))
        for step in range(points):
            w.add_scalar("train/loss", 10.0 / (1 + step) + 2.5, step, walltime=1.7e9 + step)
            w.add_scalar("val/loss", 10.0 / (1 + step) + 2.6, step, walltime=1.7e9 + step)
            w.add_scalar("lr", 3e-4, step, walltime=1.7e9 + step)
        w.close()
    done.touch()
    return total


def ingest(target: str, label: str, runs: int, points: int) -> None:
    """Read in one process (KB_INGEST_WORKERS=0), then by the default worker processes."""
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    took = {}
    for workers, how in ((0, "in one process"), (None, "with workers")):
        with tempfile.TemporaryDirectory() as d:
            k = KnowledgeBase.open(Settings(home=Path(d), ingest_workers=workers))
            t = time.perf_counter()
            report = k.ingest(target, index=False)
            took[how] = dt = time.perf_counter() - t
            k.close()
        assert report.added == runs and not report.failed, (label, report.as_dict())
        print(f"{label:12s} {how:15s} {runs} runs, {points:,} points in {dt:.1f} s = {runs / dt:.0f} runs/s, "
              f"{points / dt:,.0f} points/s")
    print(f"{label:12s} workers / one process: {took['in one process'] / took['with workers']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlflow-runs", type=int, default=2000)
    ap.add_argument("--tb-folders", type=int, default=500)
    ap.add_argument("--points", type=int, default=200)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    CACHE.mkdir(exist_ok=True)
    uri, ml_points = build_mlflow(CACHE / f"mlflow-{args.mlflow_runs}x{args.points}.db", args.mlflow_runs, args.points)
    ingest(uri, "mlflow", args.mlflow_runs, ml_points)
    tb_root = CACHE / f"tb-{args.tb_folders}x{args.points}"
    tb_points = build_tensorboard(tb_root, args.tb_folders, args.points)
    ingest(str(tb_root), "tensorboard", args.tb_folders, tb_points)


if __name__ == "__main__":
    main()
