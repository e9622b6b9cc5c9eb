"""The refresh at a bulk load's end on Postgres: the mostly-new projects rebuilt one after
another, against two at a time (kb.ablation_bulk), on the same store, taking turns.

    python benchmarks/bulk_end.py --postgres postgresql://postgres@127.0.0.1/test
    python benchmarks/bulk_end.py --runs-per-project 100,1000 --repeats 3 --json

For each size, a scratch schema gets 12 projects of that many runs (benchmarks/scale_runs.py,
200 curve points a run) in one KnowledgeBase.bulk() block. Then, --repeats times, each way in
turn: every run queued again, as a bulk load's writes leave them, and the time of
kb.ablation_bulk.refresh_bulk, which rebuilds every project (the serial way with
SIDE_BY_SIDE_MIN out of reach). Each project already has its ablations there, which the
rebuild replaces, as a bulk load into a store that holds the projects does. The figure of a way
is its best turn; the ratio is the serial one's over the side-by-side one's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["KB_LLM_BACKEND"] = "none"

from ingest_scale import knowledge_base  # noqa: E402
from scale_runs import PROJECTS, make_run  # noqa: E402

WAYS = {"one at a time": 10**12, "side by side": None}     # SIDE_BY_SIDE_MIN for each (None: as shipped)


def measure(postgres: str, per_project: int, repeats: int) -> dict:
    from sqlalchemy import select

    import kb.ablation_bulk as bulk
    from kb.ablation_store import queue_runs
    from kb.models import Run
    shipped = bulk.SIDE_BY_SIDE_MIN
    runs = per_project * len(PROJECTS)
    best: dict[str, float] = {}
    with knowledge_base(Path(tempfile.mkdtemp()), "kb", postgres) as k:
        with k.bulk():
            for start in range(0, runs, 1000):
                k.ingest_records([make_run(i) for i in range(start, min(runs, start + 1000))], index=False)
        with k.engine.connect() as conn:
            ids = list(conn.execute(select(Run.id)).scalars())
        for _ in range(repeats):
            for way, least in WAYS.items():
                with k.engine.begin() as conn:
                    queue_runs(conn, ids)
                bulk.SIDE_BY_SIDE_MIN = shipped if least is None else least
                try:
                    t = time.perf_counter()
                    bulk.refresh_bulk(k.engine)
                    spent = time.perf_counter() - t
                finally:
                    bulk.SIDE_BY_SIDE_MIN = shipped
                best[way] = min(spent, best.get(way, spent))
    out = {"runs_per_project": per_project, "projects": len(PROJECTS)} | {w: round(s, 3) for w, s in best.items()}
    return out | {"ratio": round(best["one at a time"] / best["side by side"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postgres", metavar="URL", default=os.environ.get("KB_BENCH_POSTGRES_URL"))
    ap.add_argument("--runs-per-project", default="100,1000", help="sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="turns each way takes per size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.postgres:
        sys.exit("bulk_end.py: --postgres URL (or KB_BENCH_POSTGRES_URL) is required: SQLite rebuilds one at a time")
    rows = []
    for size in (int(s) for s in args.runs_per_project.split(",")):
        row = measure(args.postgres, size, args.repeats)
        rows.append(row)
        print(f"{row['projects']} projects of {size:,} runs: one at a time {row['one at a time']} s, "
              f"side by side {row['side by side']} s: {row['ratio']}x", flush=True)
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "repeats": args.repeats, "sizes": rows}))


if __name__ == "__main__":
    main()
