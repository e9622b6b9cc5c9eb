"""Ingest and query speed, pretrain-kb against MLflow on the same generated runs, in one process.

    python benchmarks/ingest_query.py            # full size: 2,000-run ingest, 10,000-run query
    python benchmarks/ingest_query.py --quick    # a smaller smoke run
    python benchmarks/ingest_query.py --json     # the figures as one JSON object, last line of stdout
    python benchmarks/ingest_query.py --ingest-repeats 4   # the ingest 4 more times each way (one
                                                 # process, workers), interleaved: its spread
    python benchmarks/ingest_query.py --postgres postgresql://user@host/db   # the query on Postgres too
                                                 # (or KB_BENCH_POSTGRES_URL; a scratch schema, dropped after)

Prints (1) SQL ingest of runs x 3 curves x 200 points, native path vs MLflow's log_batch on
SQLite and vs the floor: a plain executemany of the same points into one indexed SQLite
table (a row per point, clustered on run, key and position) in this process; (2) a filtered,
sorted query (best run at one learning rate under a loss bound) vs MlflowClient.search_runs
at 10,000 runs, checking both return the same run, and the same query on Postgres when one is
given; (3) run cards embedded and indexed per second beside the embedding model's own throughput. Every ratio is computed
here, from this run's measurements.
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


def kb_open(home: Path, **settings):
    from kb.api import KnowledgeBase
    from kb.settings import Settings
    return KnowledgeBase.open(Settings(home=home, **settings))


def write_jsonl(path: Path, runs: list[dict]) -> Path:
    with open(path, "w") as fh:
        for r in runs:
            fh.write(json.dumps(r) + "\n")
    return path


def sqlite_floor(path: Path, runs: list[dict]) -> float:
    """Points/s of the cheapest way SQLite stores these points: one executemany of prepared rows
    into one table of a row per point (clustered on run, key, position: the layout the store had
    before curves were packed, kb.series), with the pragmas the store uses (WAL,
    synchronous=NORMAL), one commit. No parsing, analysis or other table."""
    import sqlite3
    rows = [(r["id"], key, i, step, value, ts)
            for r in runs for key, pts in r["metrics"].items() for i, (step, value, ts) in enumerate(pts)]
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE point (run_id TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, "
                 "step INTEGER NOT NULL, value REAL, wall_time REAL, PRIMARY KEY (run_id, key, seq)) WITHOUT ROWID")
    t = time.perf_counter()
    conn.executemany("INSERT INTO point VALUES (?, ?, ?, ?, ?, ?)", rows)
    conn.commit()
    elapsed = time.perf_counter() - t
    conn.close()
    return len(rows) / elapsed


def time_ingest(tmp: Path, runs: list[dict], path: Path, label: str, **settings) -> tuple[float, float]:
    """(seconds of our ingest of `path` into a fresh store, the floor's points/s). The floor is
    measured before and after ours, the faster one kept: a burst of load elsewhere during one
    floor measurement must not flatter the fraction."""
    floor = sqlite_floor(tmp / f"floor-{label}-1.sqlite", runs)
    k = kb_open(tmp / f"kb-{label}", **settings)
    t = time.perf_counter()
    report = k.ingest(str(path), index=False)
    kb_s = time.perf_counter() - t
    assert report.added == len(runs) and not report.failed, report.as_dict()
    k.close()
    return kb_s, max(floor, sqlite_floor(tmp / f"floor-{label}-2.sqlite", runs))


def bench_ingest_spread(tmp: Path, n_runs: int, repeats: int) -> dict:
    """The ingest's fraction of the floor `repeats` times each way, in one process and with the
    ingest workers, interleaved so that the machine's drift weighs on both alike."""
    runs = make_runs(n_runs)
    points = sum(len(p) for r in runs for p in r["metrics"].values())
    path = write_jsonl(tmp / "spread.jsonl", runs)
    fractions: dict[str, list[float]] = {"one_process": [], "workers": []}
    for i in range(repeats):
        for way, workers in (("one_process", 0), ("workers", None)):
            kb_s, floor = time_ingest(tmp, runs, path, f"spread-{i}-{way}", ingest_workers=workers)
            fractions[way].append(round(points / kb_s / floor, 3))
    out = {}
    for way, got in fractions.items():
        out[way] = {"fractions": got, "min": min(got), "median": statistics.median(got), "max": max(got)}
        print(f"ingest  {way.replace('_', ' ')}, {repeats} runs: {min(got):.0%} to {max(got):.0%} of the floor "
              f"(median {statistics.median(got):.0%}): {', '.join(f'{f:.0%}' for f in got)}")
    return out


def bench_ingest(tmp: Path, n_runs: int, n_mlflow: int) -> dict:
    runs = make_runs(n_runs)
    points = sum(len(p) for r in runs for p in r["metrics"].values())
    path = write_jsonl(tmp / "runs.jsonl", runs)
    kb_s, floor = time_ingest(tmp, runs, path, "ingest")

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
    print(f"ingest  SQLite floor (executemany of the same points into one indexed table): {floor:,.0f} points/s")
    ours, theirs = points / kb_s, ml_points / ml_s
    print(f"ingest  ratio: {kb_rps / ml_rps:.1f}x runs/s, {ours / theirs:.1f}x points/s vs MLflow; "
          f"{100 * ours / floor:.0f}% of the floor")
    return {"ours_points_per_s": round(ours), "mlflow_points_per_s": round(theirs),
            "sqlite_floor_points_per_s": round(floor), "ratio_vs_mlflow": round(ours / theirs, 2),
            "fraction_of_floor": round(ours / floor, 3),
            "ours_runs_per_s": round(kb_rps, 1), "mlflow_runs_per_s": round(ml_rps, 2)}


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


def best_run_query(k, lr: float, bound: float):
    return k.runs(where=f"config.optim.lr = {lr!r} and summary.val_loss < {bound}",
                  sort="summary.val_loss", limit=1)


def time_queries(k, bound: float, repeats: int) -> tuple[list[float], list[str | None]]:
    """Seconds per query and the best run's name, cycling through the lrs (each lr's runs sit
    somewhere else in the loss order: the far-off lrs' best runs are thousands of runs down)."""
    times, names = [], []
    for i in range(repeats):
        lr = LRS[i % len(LRS)]
        t = time.perf_counter()
        best = best_run_query(k, lr, bound)
        times.append(time.perf_counter() - t)
        names.append(best[0].name if best else None)
    return times, names


def bench_query(tmp: Path, n_runs: int, repeats: int, postgres: str | None) -> dict:
    runs = make_runs(n_runs, curves=3, points=20, seed=1)
    path = write_jsonl(tmp / "query.jsonl", runs)
    k = kb_open(tmp / "kb-query")
    k.ingest(str(path), index=False)
    uri, exp, client = mlflow_bulk_store(tmp / "mlflow-query.db", runs)
    # a bound that about half the runs meet, so every query has a best run to find
    finals = sorted(r["metrics"]["val_loss"][-1][1] for r in runs)
    bound = round(finals[len(finals) // 2], 3)
    for lr in LRS:                                   # warm both sides' caches alike
        best_run_query(k, lr, bound)
        client.search_runs([exp], f"params.`optim.lr` = '{lr}' and metrics.val_loss < {bound}",
                           order_by=["metrics.val_loss ASC"], max_results=1)
    ours, names = time_queries(k, bound, repeats)
    theirs, their_names = [], []
    for i in range(repeats):
        lr = LRS[i % len(LRS)]
        t = time.perf_counter()
        found = client.search_runs([exp], f"params.`optim.lr` = '{lr}' and metrics.val_loss < {bound}",
                                   order_by=["metrics.val_loss ASC"], max_results=1)
        theirs.append(time.perf_counter() - t)
        their_names.append(found[0].info.run_name if found else None)
    k.close()
    same = all(n is not None for n in names) and names == their_names
    (o50, o95), (t50, t95) = percentiles(ours), percentiles(theirs)
    print(f"query   'config.optim.lr = X and summary.val_loss < {bound}', best first, limit 1")
    print(f"query   pretrain-kb at {n_runs} runs (SQLite): p50 {o50:.2f} ms, p95 {o95:.2f} ms")
    print(f"query   MLflow search_runs at {n_runs} runs: p50 {t50:.1f} ms, p95 {t95:.1f} ms")
    agree = sum(a == b and a is not None for a, b in zip(names, their_names))
    print(f"query   ratio: MLflow p50 / pretrain-kb p50 = {t50 / o50:.0f}x "
          f"(same best run in {agree} of {repeats} queries)")
    result = {"ours_p50_ms": round(o50, 3), "mlflow_p50_ms": round(t50, 1), "ratio_vs_mlflow": round(t50 / o50, 1),
              "same_answer": same, "ours_p95_ms": round(o95, 3), "mlflow_p95_ms": round(t95, 1)}
    if postgres:
        result.update(bench_query_postgres(tmp, postgres, path, n_runs, bound, repeats, names))
    return result


def bench_query_postgres(tmp: Path, url: str, path: Path, n_runs: int, bound: float, repeats: int,
                         sqlite_names: list[str | None]) -> dict:
    """The same runs and queries on Postgres, in a scratch schema dropped afterwards."""
    from sqlalchemy import create_engine, text
    from kb.api import KnowledgeBase
    from kb.settings import Settings

    admin_url = url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url
    admin = create_engine(admin_url)
    schema = "bench_" + uuid.uuid4().hex[:12]
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        sep = "&" if "?" in url else "?"
        k = KnowledgeBase.open(Settings(home=tmp / "kb-pg", database_url=f"{url}{sep}options=-csearch_path%3D{schema}"))
        t = time.perf_counter()
        k.ingest(str(path), index=False)
        ingest_s = time.perf_counter() - t
        for lr in LRS:
            best_run_query(k, lr, bound)
        times, names = time_queries(k, bound, repeats)
        k.close()
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    p50, p95 = percentiles(times)
    same = names == sqlite_names
    print(f"query   pretrain-kb at {n_runs} runs (Postgres): p50 {p50:.2f} ms, "
          f"p95 {p95:.2f} ms ({'same' if same else 'NOT the same'} best runs as SQLite; "
          f"its ingest took {ingest_s:.0f} s)")
    return {"postgres_p50_ms": round(p50, 3), "postgres_p95_ms": round(p95, 3), "postgres_same_answer": same}


def bench_vectors(tmp: Path, n_cards: int) -> dict:
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
    # the sync also indexes each run's failures and ablations as points of their own (shorter
    # texts than a card): the rate compared is texts embedded and indexed per second
    assert report.indexed >= n_cards, report
    model_rate, ours = n_cards / enc_s, report.indexed / idx_s
    print(f"vectors embedding model alone: {model_rate:.1f} cards/s "
          f"(avg {sum(map(len, cards)) / len(cards):.0f} chars per card)")
    print(f"vectors embed + index (kb sync): {report.indexed} points ({n_cards} run cards, the rest their "
          f"failures and ablations) at {ours:.1f} points/s = {100 * ours / model_rate:.0f}% of the model's "
          f"own rate on cards")
    k.close()
    return {"ours_points_per_s": round(ours, 1), "points": report.indexed, "model_cards_per_s": round(model_rate, 1),
            "fraction_of_model": round(ours / model_rate, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON, the last line of stdout")
    ap.add_argument("--postgres", metavar="URL", default=os.environ.get("KB_BENCH_POSTGRES_URL"),
                    help="also time the query on this Postgres (default: $KB_BENCH_POSTGRES_URL)")
    ap.add_argument("--skip-vectors", action="store_true", help="leave out the embedding benchmark")
    ap.add_argument("--ingest-repeats", type=int, default=0, metavar="N",
                    help="also measure the ingest N more times in one process and with workers, interleaved")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    sizes = dict(ingest=200, mlflow=20, query=1000, repeats=14, cards=64) if args.quick else \
        dict(ingest=2000, mlflow=2000, query=10000, repeats=42, cards=400)
    figures = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        figures["ingest"] = bench_ingest(tmp, sizes["ingest"], sizes["mlflow"])
        if args.ingest_repeats:
            figures["ingest_spread"] = bench_ingest_spread(tmp, sizes["ingest"], args.ingest_repeats)
        figures["query"] = bench_query(tmp, sizes["query"], sizes["repeats"], args.postgres)
        if not args.skip_vectors:
            figures["vectors"] = bench_vectors(tmp, sizes["cards"])
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
