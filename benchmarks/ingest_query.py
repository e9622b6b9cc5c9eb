"""Ingest and query speed, pretrain-kb against MLflow on the same generated runs, in one process.

    python benchmarks/ingest_query.py            # full size: 2,000-run ingest, 10,000-run query
    python benchmarks/ingest_query.py --quick    # a smaller smoke run

Prints (1) SQL ingest of runs x 3 curves x 200 points, native path vs MLflow's log_batch on
SQLite; (2) a filtered, sorted query (best run at one learning rate under a loss bound)
vs MlflowClient.search_runs at 10,000 runs, checking both return the same run; (3) run cards
embedded and indexed per second beside the embedding model's own throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

from synth import LRS, flat_params, make_runs  # noqa: E402


def kb_open(home: Path):
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    return KnowledgeBase.open(Settings(home=home))


def write_jsonl(path: Path, runs: list[dict]) -> Path:
    with open(path, "w") as fh:
        for r in runs:
            fh.write(json.dumps(r) + "\n")
    return path


def bench_ingest(tmp: Path, n_runs: int, n_mlflow: int) -> None:
    runs = make_runs(n_runs)
    points = sum(len(p) for r in runs for p in r["metrics"].values())
    path = write_jsonl(tmp / "runs.jsonl", runs)
    k = kb_open(tmp / "kb-ingest")
    t = time.perf_counter()
    report = k.ingest(str(path), index=False)
    kb_s = time.perf_counter() - t
    assert report.added == n_runs and not report.failed, report.as_dict()
    k.close()

    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow-ingest.db'}")
    exp = client.create_experiment("bench")
    sample = runs[:n_mlflow]
    t = time.perf_counter()
    for r in sample:
        run = client.create_run(exp, run_name=r["name"])
        metrics = [Metric(key, value, int(ts * 1000), step)
                   for key, pts in r["metrics"].items() for step, value, ts in pts]
        params = [Param(k, v) for k, v in flat_params(r["config"]).items()]
        client.log_batch(run.info.run_id, metrics=metrics, params=params)
        client.set_terminated(run.info.run_id)
    ml_s = time.perf_counter() - t
    ml_points = sum(len(p) for r in sample for p in r["metrics"].values())
    kb_rps, ml_rps = n_runs / kb_s, n_mlflow / ml_s
    print(f"ingest  pretrain-kb native: {n_runs} runs, {points} points in {kb_s:.1f} s = "
          f"{kb_rps:.0f} runs/s, {points / kb_s:,.0f} points/s")
    print(f"ingest  MLflow log_batch (SQLite): {n_mlflow} runs, {ml_points} points in {ml_s:.1f} s = "
          f"{ml_rps:.1f} runs/s, {ml_points / ml_s:,.0f} points/s")
    print(f"ingest  ratio: {kb_rps / ml_rps:.1f}x runs/s, {(points / kb_s) / (ml_points / ml_s):.1f}x points/s")


def mlflow_bulk_store(path: Path, runs: list[dict]) -> str:
    """A 10,000-run MLflow store, written through MLflow's own ORM models in bulk (log_batch
    at ~5 runs/s would take half an hour); search_runs reads exactly what log_batch writes."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlParam, SqlRun
    from mlflow.tracking import MlflowClient
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    uri = f"sqlite:///{path}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("bench")
    engine = create_engine(uri)
    with Session(engine) as s:
        for r in runs:
            rid = uuid.uuid4().hex
            s.add(SqlRun(run_uuid=rid, name=r["name"], source_type="LOCAL", source_name="", entry_point_name="",
                         user_id="bench", status="FINISHED", start_time=0, end_time=1, source_version="",
                         lifecycle_stage="active", artifact_uri="", experiment_id=int(exp)))
            s.add_all(SqlParam(key=k, value=v, run_uuid=rid) for k, v in flat_params(r["config"]).items())
            for key, pts in r["metrics"].items():
                step, value, ts = pts[-1]
                s.add(SqlLatestMetric(key=key, value=value, timestamp=int(ts * 1000), step=step, is_nan=False,
                                      run_uuid=rid))
        s.commit()
    return uri, exp, client


def percentiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=20)
    return statistics.median(samples) * 1000, q[18] * 1000


def bench_query(tmp: Path, n_runs: int, repeats: int) -> None:
    runs = make_runs(n_runs, curves=3, points=20, seed=1)
    k = kb_open(tmp / "kb-query")
    k.ingest(str(write_jsonl(tmp / "query.jsonl", runs)), index=False)
    uri, exp, client = mlflow_bulk_store(tmp / "mlflow-query.db", runs)
    # a bound that about half the runs meet, so every query has a best run to find
    finals = sorted(r["metrics"]["val_loss"][-1][1] for r in runs)
    bound = round(finals[len(finals) // 2], 3)
    ours, theirs = [], []
    for i in range(repeats):
        lr = LRS[i % len(LRS)]
        t = time.perf_counter()
        best = k.runs(where=f"config.optim.lr = {lr!r} and summary.val_loss < {bound}",
                      sort="summary.val_loss", limit=1)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        found = client.search_runs([exp], f"params.`optim.lr` = '{lr}' and metrics.val_loss < {bound}",
                                   order_by=["metrics.val_loss ASC"], max_results=1)
        theirs.append(time.perf_counter() - t)
        assert best and found, (lr, bound)
        assert best[0].name == found[0].info.run_name, (lr, best[0].name, found[0].info.run_name)
    (o50, o95), (t50, t95) = percentiles(ours), percentiles(theirs)
    print(f"query   'config.optim.lr = X and summary.val_loss < {bound}', best first, limit 1")
    print(f"query   pretrain-kb at {n_runs} runs: p50 {o50:.1f} ms, p95 {o95:.1f} ms")
    print(f"query   MLflow search_runs at {n_runs} runs: p50 {t50:.1f} ms, p95 {t95:.1f} ms")
    print(f"query   ratio: MLflow p50 / pretrain-kb p50 = {t50 / o50:.0f}x (same best run in all {repeats})")
    k.close()


def bench_vectors(tmp: Path, n_cards: int) -> None:
    runs = make_runs(n_cards, curves=2, points=20, seed=2)
    k = kb_open(tmp / "kb-vectors")
    k.ingest(str(write_jsonl(tmp / "cards.jsonl", runs)), index=False)
    from sqlmodel import Session, select
    from kb.models import Run
    with Session(k.engine) as s:
        cards = [c for (c,) in s.execute(select(Run.card))]
    embedder = k.embedder
    embedder.encode(cards[:16])                      # warm up
    t = time.perf_counter()
    embedder.encode(cards)
    enc_s = time.perf_counter() - t
    t = time.perf_counter()
    report = k.sync_index()
    idx_s = time.perf_counter() - t
    assert report.indexed == n_cards, report
    print(f"vectors embedding model alone: {n_cards / enc_s:.1f} cards/s "
          f"(avg {sum(map(len, cards)) / len(cards):.0f} chars per card)")
    print(f"vectors embed + index (kb sync): {n_cards / idx_s:.1f} cards/s = "
          f"{100 * enc_s / idx_s:.0f}% of the model's own throughput")
    k.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    sizes = dict(ingest=200, mlflow=20, query=1000, repeats=14, cards=64) if args.quick else \
        dict(ingest=2000, mlflow=2000, query=10000, repeats=42, cards=400)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        bench_ingest(tmp, sizes["ingest"], sizes["mlflow"])
        bench_query(tmp, sizes["query"], sizes["repeats"])
        bench_vectors(tmp, sizes["cards"])


if __name__ == "__main__":
    main()
