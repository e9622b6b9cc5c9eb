"""Scale: 1k -> 10k -> 100k runs (20M curve points at 200 a run) on SQLite and Postgres, with
MLflow beside it while it stays under a time cap (issue 12).

    python benchmarks/scale.py --quick --json                 # 500 and 2,000 runs: a smoke run of minutes
    python benchmarks/scale.py --postgres postgresql://postgres@127.0.0.1/test --plot scale.png --json
    python benchmarks/scale.py --sizes 1000,10000 --points-per-run 200 --no-sqlite --postgres URL
    python benchmarks/scale.py --combine sqlite.json postgres.json --plot scale.png   # earlier runs' --json, one table

Each size adds runs to the same store (benchmarks/scale_runs.py: sweeps over 6 model sizes, lr,
batch, warmup, norm and seeds, ~5% diverged, curves of --points-per-run points), then measures:

- ingest: KnowledgeBase.ingest_records(batch, index=False), --batch runs a call, the product's own
  path (runs read and prepared by the ingest workers, written 64 at a time; on Postgres through
  COPY), the calls of each size inside one `KnowledgeBase.bulk()` block, as a bulk load is meant
  to be written: its ablation refresh and upkeep run once, at the block's end, and are timed
  (--no-bulk: each call runs its own);
- `kb runs --where`: k.runs(where, sort='summary.val/loss', limit=20) in process, p50/p95 over
  --repeats queries for filters that select ~0.1%, 1%, 10% and 50% of the runs, and one that
  selects a sweep's 10 runs at every size (each repeat asks for other values; the match count is
  measured, not assumed); on Postgres again after an ANALYZE
  of the schema's tables (an ingest analyzes only after writing a tenth of the store or more:
  a bulk block at its end, a lone call of 1,000 runs only while the store is under 10,000);
- hybrid retrieval: agents.retrieve.Retriever.retrieve(k=8), p50/p95. Embedding 100k run cards
  with MiniLM takes ~40 min here, so the index is filled through the product's own sync
  (kb.indexer.sync: real cards, payloads and card hashes) with an embedder that embeds the first
  --real-cards cards for real and gives every later card one of those real vectors (picked by
  the card's hash) plus small noise. Questions are embedded for real; BM25 indexes every card;
- `kb ask`: k.ask(question) for 5 quantitative questions, with no LLM (KB_LLM_BACKEND=none: the
  planner's SQL path; a question it could not plan is counted and still timed);
- peak memory (this process's ru_maxrss so far), SQL disk per run (SQLite file + WAL + SHM;
  Postgres: pg_total_relation_size over the scratch schema), the vector index folder apart.

Then each figure fitted over the measured sizes as y = a + b*ln(runs) (and as a power law, for
its exponent), extrapolated to 1,000,000 runs and labelled a projection, the targets checked, a table printed and, with --json, one JSON object as
the last line of stdout; --plot writes the growth curves (query p50 vs runs, log-log, with a
log(n) reference). Postgres: --postgres URL or KB_BENCH_POSTGRES_URL, a scratch schema dropped after.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ["KB_LLM_BACKEND"] = "none"      # an unknown backend: no LLM loads, `ask` stays on SQL

from ingest_scale import knowledge_base  # noqa: E402
from scale_runs import FILTERS, LIMIT, MLFLOW_ORDER, QUESTIONS, SORT, make_run  # noqa: E402

PROJECT_TO = 1_000_000
RETRIEVAL_QUESTIONS = ("why did the 1.3B runs at lr 3e-3 diverge?", "runs with rmsnorm and a long warmup",
                       "out of memory failures at batch size 1024", "lowest val loss at 350M",
                       "killed runs in the data-mix project", "does a 3000 step warmup help the 760M models?",
                       "loss went to NaN after warmup", "best learning rate for 125M with layernorm",
                       "tokens per second of the 50M runs", "baseline runs of the scaling-2025 project")
TARGETS = {"runs_p50_ms": 20.0, "retrieval_p50_ms": 50.0, "postgres_points_per_s": 100_000}


# ---- measuring one store -------------------------------------------------------------------


class SampledEmbedder:
    """The first `real` texts embedded by the real model; each later text gets a real vector
    chosen by its hash plus N(0, noise) per dimension, renormalized (cosine ~0.93 to its source)."""

    def __init__(self, kb, real: int, noise: float = 0.02, seed: int = 0):
        self.kb, self.real, self.noise = kb, real, noise
        self.sample: list[np.ndarray] = []
        self.rng = np.random.default_rng(seed)
        self.copied = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        room = max(0, self.real - len(self.sample))
        out = list(self.kb.embedder.encode(list(texts[:room]))) if room else []
        self.sample += out
        rest = texts[len(out):]
        if rest:
            base = np.stack([self.sample[zlib.crc32(t.encode()) % len(self.sample)] for t in rest])
            noisy = base + self.rng.standard_normal(base.shape).astype(np.float32) * self.noise
            out += list(noisy / np.linalg.norm(noisy, axis=1, keepdims=True))
            self.copied += len(rest)
        return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)


def ingest(k, start: int, stop: int, points: int, batch: int, bulk: bool = True) -> dict:
    """Runs start..stop through ingest_records, `batch` a call, the calls of one size in one
    `k.bulk()` block unless not `bulk`: timed are the calls and the block's end (the ablation
    refresh and upkeep it ran once; also apart, as end_seconds), not the generation of the records."""
    spent = 0.0
    with k.bulk() if bulk else contextlib.nullcontext():
        for a in range(start, stop, batch):
            records = [make_run(i, points) for i in range(a, min(stop, a + batch))]
            t = time.perf_counter()
            report = k.ingest_records(records, index=False)
            spent += time.perf_counter() - t
            assert report.added == len(records) and not report.failed, report.as_dict()
        t = time.perf_counter()
    end = time.perf_counter() - t
    spent += end
    n = stop - start
    return {"runs": n, "seconds": round(spent, 2), "end_seconds": round(end, 2), "runs_per_s": round(n / spent, 1),
            "points_per_s": round(n * points / spent)}


def percentiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 3), "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 3)}


def match_count(k, where: str) -> int:
    from sqlalchemy import func, select
    from kb.models import Run
    from kb.query_sql import compile_where
    with k.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(Run).where(compile_where(where))).scalar_one()


def measure_queries(k, runs: int, repeats: int) -> dict:
    out = {}
    for label, f in FILTERS.items():
        k.runs(where=f.kb_where(0), sort=SORT, limit=LIMIT)          # warm: statement cache, pages
        times, found = [], 0
        for r in range(repeats):
            t = time.perf_counter()
            rows = k.runs(where=f.kb_where(r), sort=SORT, limit=LIMIT)
            times.append(time.perf_counter() - t)
            found += len(rows)
        matches = match_count(k, f.kb_where(0))
        out[label] = {"where": f.kb_where(0), "matches": matches, "fraction": round(matches / runs, 4),
                      "mean_rows": round(found / repeats, 1)} | percentiles(times)
    return out


def analyze_schema(k) -> None:
    from sqlalchemy import text
    with k.engine.connect() as conn:
        tables = conn.execute(text("select tablename from pg_tables where schemaname = current_schema()")).scalars()
        for table in list(tables):
            conn.execute(text(f'ANALYZE "{table}"'))
        conn.commit()


def measure_retrieval(k, embedder: SampledEmbedder, repeats: int) -> dict:
    from agents.retrieve import Retriever
    from kb import indexer
    t = time.perf_counter()
    synced = indexer.sync(k.engine, k._open_index(), embedder)
    sync_s = time.perf_counter() - t
    retriever = Retriever(k)
    t = time.perf_counter()
    retriever.sparse                       # the keyword index, built over every chunk
    sparse_s = time.perf_counter() - t
    retriever.retrieve(RETRIEVAL_QUESTIONS[0], k=8)                 # warm: the model, caches
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        retriever.retrieve(RETRIEVAL_QUESTIONS[r % len(RETRIEVAL_QUESTIONS)], k=8)
        times.append(time.perf_counter() - t)
    return {"chunks": k.index.count(), "real_embeddings": len(embedder.sample), "noisy_copies": embedder.copied,
            "sync_s": round(sync_s, 1), "synced": synced.indexed, "keyword_index_s": round(sparse_s, 1)} \
        | percentiles(times)


def measure_ask(k, repeats: int) -> dict:
    k.ask(QUESTIONS[0])                    # warm: the agent's imports, the read-only connection
    times, planned = [], set()
    for _ in range(repeats):
        for q in QUESTIONS:
            t = time.perf_counter()
            answer = k.ask(q)
            times.append(time.perf_counter() - t)
            if answer.sql:
                planned.add(q)
    return {"questions": len(QUESTIONS), "planned": len(planned),
            "unplanned": [q for q in QUESTIONS if q not in planned]} | percentiles(times)


def sql_disk_bytes(k) -> int:
    from sqlalchemy import make_url, text
    if k.engine.dialect.name == "sqlite":
        db = Path(make_url(k.settings.sql_url).database)      # the file, its WAL and SHM as they are
        return sum(p.stat().st_size for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists())
    with k.engine.connect() as conn:
        return int(conn.execute(text(
            "select coalesce(sum(pg_total_relation_size(c.oid)), 0) from pg_class c "
            "join pg_namespace n on n.oid = c.relnamespace where n.nspname = current_schema() and c.relkind = 'r'"
        )).scalar_one())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)     # KiB on Linux


def bench_store(k, sizes: list[int], args, label: str) -> list[dict]:
    embedder = SampledEmbedder(k, args.real_cards)
    steps, have = [], 0
    for size in sizes:
        # each figure printed as it is measured: a step that fails later still leaves them
        step = {"runs": size, "points": size * args.points_per_run,
                "ingest": ingest(k, have, size, args.points_per_run, args.batch, args.bulk)}
        _partial(label, size, "ingest", step["ingest"])
        have = size
        step["query"] = measure_queries(k, size, args.repeats)
        _partial(label, size, "query", {f: q["p50_ms"] for f, q in step["query"].items()})
        if k.engine.dialect.name == "postgresql":
            # an ingest runs ANALYZE only after writing a tenth of the store (kb.db), so calls of
            # 1,000 runs outside a bulk block leave the statistics to autovacuum: measured both ways
            analyze_schema(k)
            step["query_after_analyze"] = measure_queries(k, size, args.repeats)
            _partial(label, size, "query after ANALYZE",
                     {f: q["p50_ms"] for f, q in step["query_after_analyze"].items()})
        if not args.skip_retrieval:
            step["retrieval"] = measure_retrieval(k, embedder, args.repeats)
            _partial(label, size, "retrieval", step["retrieval"])
        step["ask"] = measure_ask(k, args.ask_repeats)
        disk = sql_disk_bytes(k)
        step |= {"peak_rss_mb": peak_rss_mb(), "sql_bytes": disk, "sql_bytes_per_run": round(disk / size),
                 "vector_index_bytes": folder_bytes(k.settings.home / "qdrant")}
        steps.append(step)
        print(f"  {label} {size:,} runs: ingest {step['ingest']['points_per_s']:,} points/s, "
              f"runs p50 {max(q['p50_ms'] for q in step['query'].values()):.1f} ms (worst filter), "
              f"retrieval p50 {step['retrieval']['p50_ms'] if 'retrieval' in step else '-'} ms, "
              f"ask p50 {step['ask']['p50_ms']:.1f} ms", flush=True)
    return steps


def _partial(label: str, size: int, what: str, figures: dict) -> None:
    print(f"    {label} {size:,} runs, {what}: {json.dumps(figures)}", flush=True)


# ---- MLflow on the same runs -----------------------------------------------------------------

MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "diverged": "FAILED", "killed": "KILLED"}


def log_to_mlflow(client, exp: str, run: dict) -> None:
    from mlflow.entities import Metric, Param, RunTag
    from synth import flat_params
    created = client.create_run(exp, run_name=run["name"])
    rid = created.info.run_id
    metrics = [Metric(key, value, int(ts * 1000), step) for key, pts in run["metrics"].items()
               for step, value, ts in pts]
    params = [Param(k, v) for k, v in flat_params(run["config"]).items()]
    for i in range(0, max(1, len(metrics)), 900):          # log_batch takes 1,000 entities a call
        client.log_batch(rid, metrics=metrics[i:i + 900], params=params if i == 0 else [],
                         tags=[RunTag(t, "true") for t in run["tags"]] if i == 0 else [])
    client.set_terminated(rid, status=MLFLOW_STATUS[run["status"]])


def bench_mlflow(tmp: Path, sizes: list[int], args) -> dict:
    """log_batch ingest and search_runs on the same runs, while the time spent stays under the cap."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("scale")
    began = time.perf_counter()
    over = lambda: time.perf_counter() - began > args.mlflow_cap_s    # noqa: E731
    steps, have = [], 0
    for size in sizes:
        t = time.perf_counter()
        for i in range(have, size):
            if over():
                return {"steps": steps, "stopped": f"time cap of {args.mlflow_cap_s:.0f} s reached while logging "
                                                   f"run {i:,} of the {size:,}-run step; larger sizes not measured"}
            log_to_mlflow(client, exp, make_run(i, args.points_per_run))
        spent = time.perf_counter() - t
        step = {"runs": size, "ingest": {"runs": size - have, "seconds": round(spent, 1),
                                         "runs_per_s": round((size - have) / spent, 2),
                                         "points_per_s": round((size - have) * args.points_per_run / spent)}}
        have = size
        step["query"] = {}
        for label, f in FILTERS.items():
            client.search_runs([exp], f.mlflow_filter(0), order_by=[MLFLOW_ORDER], max_results=LIMIT)
            times = []
            for r in range(min(args.repeats, 10)):
                t = time.perf_counter()
                client.search_runs([exp], f.mlflow_filter(r), order_by=[MLFLOW_ORDER], max_results=LIMIT)
                times.append(time.perf_counter() - t)
            step["query"][label] = percentiles(times)
        step["sqlite_bytes_per_run"] = round((tmp / "mlflow.db").stat().st_size / size)
        steps.append(step)
        print(f"  MLflow {size:,} runs: log_batch {step['ingest']['points_per_s']:,} points/s, search_runs p50 "
              f"{max(q['p50_ms'] for q in step['query'].values()):.1f} ms (worst filter)", flush=True)
        if over():
            later = [s for s in sizes if s > size]
            return {"steps": steps, "stopped": f"time cap of {args.mlflow_cap_s:.0f} s reached after {size:,} runs"
                                               + (f"; {', '.join(f'{s:,}' for s in later)} not measured" if later else "")}
    return {"steps": steps, "stopped": None}


# ---- growth, projection, targets ------------------------------------------------------------


def figures_of(step: dict) -> dict[str, float]:
    """The figures of one step that the growth fit and the projection follow."""
    out = {"ingest_points_per_s": step["ingest"]["points_per_s"]}
    out |= {f"runs_p50_ms[{label}]": q["p50_ms"] for label, q in step["query"].items()}
    for part in ("retrieval", "ask"):
        if part in step:
            out[f"{part}_p50_ms"] = step[part]["p50_ms"]
    for key in ("peak_rss_mb", "sql_bytes_per_run"):
        if key in step:
            out[key] = step[key]
    return out


def growth(steps: list[dict]) -> dict:
    """Per figure, fitted over the measured sizes by least squares: y = a + b*ln(n) (log-linear,
    the projection) and y = c*n^k (its exponent k, and its value at 1M: the bound to read when
    a figure grows faster than log n), both at 1,000,000 runs: projections, not measurements. For
    latencies, also whether the growth from the first size to the last stayed within log(n)'s."""
    if len(steps) < 2:
        return {}
    ns = np.array([s["runs"] for s in steps], dtype=float)
    table = [figures_of(s) for s in steps]
    out = {}
    for key in table[0]:
        ys = np.array([t.get(key, math.nan) for t in table], dtype=float)
        if not np.all(ys > 0):
            continue
        b, a = np.polyfit(np.log(ns), ys, 1)
        k, c = np.polyfit(np.log(ns), np.log(ys), 1)
        item = {"projection_at_1m": _round(max(0.0, a + b * math.log(PROJECT_TO))),
                "power_exponent": round(float(k), 3), "power_law_at_1m": _round(math.exp(c) * PROJECT_TO ** k)}
        if "_ms" in key:
            ratio, log_ratio = ys[-1] / ys[0], math.log(ns[-1]) / math.log(ns[0])
            item |= {"growth": round(float(ratio), 3), "log_n_growth": round(log_ratio, 3),
                     "within_log_n": bool(ratio <= log_ratio)}
        out[key] = item
    return out


def _round(x: float) -> float:
    return round(float(x)) if abs(x) >= 100 else round(float(x), 3)


def check_targets(result: dict) -> dict:
    """The issue's targets against the largest size measured (they are stated for 100,000 runs)."""
    out = {}
    for db, data in result["stores"].items():
        last = data["steps"][-1]
        worst = max(q["p50_ms"] for q in last["query"].values())
        out[f"{db}: kb runs --where p50 <= 20 ms (worst filter)"] = {
            "runs": last["runs"], "measured": worst, "met": worst <= TARGETS["runs_p50_ms"]}
        if "retrieval" in last:
            p50 = last["retrieval"]["p50_ms"]
            out[f"{db}: retrieval p50 <= 50 ms"] = {"runs": last["runs"], "measured": p50,
                                                    "met": p50 <= TARGETS["retrieval_p50_ms"]}
        if db == "postgres":
            pps = last["ingest"]["points_per_s"]
            out["postgres: ingest >= 100,000 points/s"] = {"runs": last["runs"], "measured": pps,
                                                           "met": pps >= TARGETS["postgres_points_per_s"]}
        for label in ("10 runs", "0.1%", "1%"):
            g = data["growth"].get(f"runs_p50_ms[{label}]")
            if g:
                out[f"{db}: {label} filter p50 grows no faster than log(n)"] = {
                    "runs": last["runs"], "measured": g["growth"], "log_n_growth": g["log_n_growth"],
                    "met": g["within_log_n"]}
    return out


# ---- output ------------------------------------------------------------------------------------


def print_table(result: dict) -> None:
    labels = list(FILTERS)
    head = (f"{'store':9s} {'runs':>9s} {'runs/s':>8s} {'points/s':>10s} "
            + " ".join(f"{'q' + lb + ' p50/p95':>17s}" for lb in labels)
            + f" {'retr p50':>9s} {'ask p50':>8s} {'peak MB':>8s} {'KB/run':>7s}")
    print("\n" + head)
    print("-" * len(head))

    def row(store, runs, ingest, query, retrieval, ask, rss, per_run):
        cells = " ".join(f"{query[lb]['p50_ms']:8.2f}/{query[lb]['p95_ms']:<8.2f}" if lb in query else f"{'-':>17s}"
                         for lb in labels)
        print(f"{store:9s} {runs:>9s} {ingest.get('runs_per_s', '-'):>8} {ingest.get('points_per_s', '-'):>10} "
              f"{cells} {retrieval:>9} {ask:>8} {rss:>8} {per_run:>7}")

    for db, data in result["stores"].items():
        for s in data["steps"]:
            row(db, f"{s['runs']:,}", s["ingest"], s["query"], f"{s['retrieval']['p50_ms']:.1f}" if "retrieval" in s
                else "-", f"{s['ask']['p50_ms']:.1f}", s["peak_rss_mb"], round(s["sql_bytes_per_run"] / 1024, 1))
            if "query_after_analyze" in s:
                row(" +ANALYZE", f"{s['runs']:,}", {}, s["query_after_analyze"], "-", "-", "-", "-")
        g = data["growth"]
        if g:
            proj = lambda key: g.get(key, {}).get("projection_at_1m", "-")    # noqa: E731
            query = {lb: {"p50_ms": proj(f"runs_p50_ms[{lb}]"), "p95_ms": math.nan} for lb in labels
                     if f"runs_p50_ms[{lb}]" in g}
            row(db, "1M proj.", {"points_per_s": proj("ingest_points_per_s")}, query, proj("retrieval_p50_ms"),
                proj("ask_p50_ms"), proj("peak_rss_mb"),
                round(proj("sql_bytes_per_run") / 1024, 1) if "sql_bytes_per_run" in g else "-")
    ml = result.get("mlflow")
    if ml:
        for s in ml["steps"]:
            row("mlflow", f"{s['runs']:,}", s["ingest"], s["query"], "-", "-", "-",
                round(s["sqlite_bytes_per_run"] / 1024, 1))
        if ml["stopped"]:
            print(f"mlflow    {ml['stopped']}")
    print("\n(1M proj. = projection: y = a + b*ln(runs) fitted over the measured sizes, extrapolated, not "
          "measured; power-law exponents and bounds in the JSON's growth. No p95 is projected.)")
    for name, t in result["targets"].items():
        extra = f" (log(n) grew {t['log_n_growth']}x)" if "log_n_growth" in t else ""
        print(f"target {'MET ' if t['met'] else 'MISSED'} {name}: {t['measured']}{extra} at {t['runs']:,} runs")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5.5))
    styles = {"sqlite": "-", "postgres": "--", "mlflow": ":"}
    firsts = []
    series = [(db, d["steps"], d["growth"]) for db, d in result["stores"].items()]
    if result.get("mlflow") and result["mlflow"]["steps"]:
        series.append(("mlflow", result["mlflow"]["steps"], {}))
    for db, steps, g in series:
        ns = [s["runs"] for s in steps]
        for j, label in enumerate(FILTERS):      # a colour per selectivity, a line style per store
            if any(label not in s["query"] for s in steps):      # an older run's JSON, without it
                continue
            ys = [s["query"][label]["p50_ms"] for s in steps]
            (line,) = ax.plot(ns, ys, styles[db], color=f"C{j}", marker="o", label=f"{db} {label}")
            firsts.append(ys[0])
            proj = g.get(f"runs_p50_ms[{label}]")
            if proj and proj["projection_at_1m"] > 0:        # a fit falling to 0 is not drawn
                ax.plot([ns[-1], PROJECT_TO], [ys[-1], proj["projection_at_1m"]], ":", color=line.get_color(),
                        alpha=0.5)
    all_n = sorted({s["runs"] for _, steps, _ in series for s in steps} | {PROJECT_TO})
    anchor = statistics.median(firsts)
    ax.plot(all_n, [anchor * math.log(n) / math.log(all_n[0]) for n in all_n], "k-", lw=2, alpha=0.3,
            label="c·log(n) reference")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("runs in the store")
    ax.set_ylabel("query p50 (ms), limit 20 sorted by val/loss")
    ax.set_title("kb runs --where: growth by filter selectivity (dotted: projection to 1M)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))     # beside: the lines fill the axes
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the run -------------------------------------------------------------------------------


def run_benchmark(args, tmp: Path) -> dict:
    sizes = sorted(args.sizes)
    result = {"setup": {"sizes": sizes, "points_per_run": args.points_per_run, "batch": args.batch, "bulk": args.bulk,
                        "repeats": args.repeats, "real_cards": args.real_cards, "cpus": os.cpu_count(),
                        "load_average_at_start": round(os.getloadavg()[0], 2)},
              "measured": (f"ingest through KnowledgeBase.ingest_records(index=False), {args.batch} runs a call"
                           + (", each size's calls in one KnowledgeBase.bulk() block, its end timed too"
                              if args.bulk else "")
                           + "; runs: k.runs(where, "
                           "sort='summary.val/loss', limit=20) in process; retrieval: Retriever.retrieve(k=8) over "
                           f"an index of every run card, failure and ablation, the first {args.real_cards} embedded "
                           "by MiniLM and the rest given one of those vectors plus noise; ask: k.ask() with no LLM; "
                           "peak_rss_mb: this process so far (both stores share it); projections: log-linear fits, "
                           "not measurements"),
              "stores": {}}
    stores = ([("sqlite", None)] if args.sqlite else []) + ([("postgres", args.postgres)] if args.postgres else [])
    for db, url in stores:
        print(f"-- {db}", flush=True)
        with knowledge_base(tmp, f"kb-{db}", url) as k:
            steps = bench_store(k, sizes, args, db)
        result["stores"][db] = {"steps": steps, "growth": growth(steps)}
    if args.mlflow_cap_s > 0:
        print("-- MLflow (SQLite, log_batch)", flush=True)
        result["mlflow"] = bench_mlflow(tmp, sizes, args)
    result["targets"] = check_targets(result)
    return result


def combine(paths: list[Path]) -> dict:
    """Earlier runs' --json output (the last line of each file) as one result: their stores side
    by side, a store two files hold taken from the later, the targets checked again. Measures
    nothing: a store re-measured after a change replaces its old figures beside the other's."""
    result: dict = {"setup": {"combined": []}, "stores": {}}
    for path in paths:
        lines = path.read_text().strip().splitlines()
        if not lines:
            raise SystemExit(f"{path}: empty, not the output of scale.py --json")
        try:
            run = json.loads(lines[-1])
            stores, setup, measured = run["stores"], run["setup"], run["measured"]
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}: last line is not the JSON of scale.py --json ({e})")
        result["setup"]["combined"].append({"file": str(path), "stores": list(stores), "setup": setup})
        result["stores"].update(stores)
        result["measured"] = measured
        if run.get("mlflow"):
            result["mlflow"] = run["mlflow"]
    result["targets"] = check_targets(result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="growth steps, runs (default 1000,10000,100000; --quick: 500,2000)")
    ap.add_argument("--points-per-run", type=int, default=200)
    ap.add_argument("--postgres", metavar="URL", default=os.environ.get("KB_BENCH_POSTGRES_URL"),
                    help="also measure on this Postgres, in a scratch schema (default: $KB_BENCH_POSTGRES_URL)")
    ap.add_argument("--sqlite", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mlflow-cap-s", type=float, default=None,
                    help="seconds MLflow may take in all; 0 skips it (default 600; --quick: 120)")
    ap.add_argument("--batch", type=int, default=1000, help="runs per ingest_records call")
    ap.add_argument("--bulk", action=argparse.BooleanOptionalAction, default=True,
                    help="each size's calls in one KnowledgeBase.bulk() block (--no-bulk: each call refreshes "
                         "ablations and looks after the tables itself)")
    ap.add_argument("--repeats", type=int, default=30, help="queries timed per filter and size")
    ap.add_argument("--ask-repeats", type=int, default=3, help="times each question is asked per size")
    ap.add_argument("--real-cards", type=int, default=None, help="cards embedded for real (default 1000; --quick 200)")
    ap.add_argument("--skip-retrieval", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON, the last line of stdout")
    ap.add_argument("--plot", type=Path, metavar="FILE.png")
    ap.add_argument("--quick", action="store_true", help="sizes 500,2000: a smoke run")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="RUN.json",
                    help="measure nothing: print (and --plot) the stores of earlier runs' --json output, "
                         "a store named twice taken from the later file")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [500, 2000] if args.quick else [1000, 10000, 100000]
    if args.mlflow_cap_s is None:
        args.mlflow_cap_s = 120.0 if args.quick else 600.0
    if args.real_cards is None:
        args.real_cards = 200 if args.quick else 1000
    if not args.sqlite and not args.postgres and not args.combine:
        ap.error("nothing to measure: --no-sqlite and no --postgres")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.combine:
        result = combine(args.combine)
    else:
        import torch
        torch.set_num_threads(1)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kb-scale-") as d:
            result = run_benchmark(args, Path(d))
        result["setup"]["wall_s"] = round(time.perf_counter() - t, 1)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
