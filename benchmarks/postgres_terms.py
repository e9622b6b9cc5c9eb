"""Postgres's run terms (kb.field_terms): what they save a filtered query and cost an ingest.

    python benchmarks/postgres_terms.py --postgres postgresql://postgres@127.0.0.1/test
    python benchmarks/postgres_terms.py --postgres URL --runs 100000 --schema terms100k --json
                        # a named schema is kept (and reused by the next run: only what is missing is loaded)

Loads --runs sweep runs (benchmarks/scale_runs.py, --points-per-run curve points) into a scratch
schema (dropped after) in one `KnowledgeBase.bulk()` block, 1,000 a call (scale.py's `ingest`), then:

- ingest: --extra more runs, 1,000 a `bulk()` block (its end, the ablation refresh, timed too,
  and apart: the calls alone),
  the blocks alternating between the term triggers on and off (`ALTER TABLE runfield DISABLE
  TRIGGER`), so the machine's drift weighs on both alike; the runs written without them get
  their terms afterwards (`kb_runterm_redo`);
- queries: for each filter of scale_runs.FILTERS (~0.1%, 1%, 10%, 50% of the runs, best 20 by
  val/loss), --repeats different questions of that selectivity, each on a fresh connection,
  interleaved: the ids from RunField alone (`top_ids`, the plan before the terms), from the
  terms (`top_ids(..., terms=True)`, which the two filters of several equalities take), the
  sort-order walk, and `KnowledgeBase.runs` as a caller gets it (its choice of walk or plan,
  the fetch of the rows). The two plans' ids are compared on every question.

The medians are printed with their ratios, and the JSON as the last line with --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest_scale import knowledge_base  # noqa: E402
from scale import ingest, percentiles  # noqa: E402
from scale_runs import FILTERS, LIMIT, SORT, make_run  # noqa: E402

TRIGGERS = ("kb_runterm_on_insert", "kb_runterm_on_delete", "kb_runterm_on_update", "kb_runterm_on_truncate")


def stored_runs(k) -> int:
    return k.count()["runs"]


def set_triggers(k, on: bool) -> None:
    from sqlalchemy import text
    with k.engine.begin() as conn:
        for name in TRIGGERS:
            conn.execute(text(f"ALTER TABLE runfield {'ENABLE' if on else 'DISABLE'} TRIGGER {name}"))


def ingest_pairs(k, first: int, extra: int, points: int) -> dict:
    """--extra runs, 1,000 a bulk block, alternating triggers on and off; seconds per mode."""
    from sqlalchemy import text
    spent = {"on": [], "off": []}
    calls = {"on": [], "off": []}
    untermed: list[str] = []
    for j, a in enumerate(range(first, first + extra, 1000)):
        mode = "on" if j % 2 == 0 else "off"
        records = [make_run(i, points) for i in range(a, min(first + extra, a + 1000))]
        set_triggers(k, mode == "on")
        try:
            t = time.perf_counter()
            with k.bulk():
                report = k.ingest_records(records, index=False)
                called = time.perf_counter()
            spent[mode].append((time.perf_counter() - t) / len(records))
            calls[mode].append((called - t) / len(records))
        finally:
            set_triggers(k, True)
        assert report.added == len(records) and not report.failed, report.as_dict()
        if mode == "off":
            untermed += [r["id"] for r in records]
    with k.engine.begin() as conn:
        conn.execute(text("SELECT kb_runterm_redo(:ids)"), {"ids": untermed})
    with k.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE runterm"))      # as a bulk block's end leaves it
    per_run = {m: statistics.median(v) for m, v in spent.items() if v}
    in_calls = {m: statistics.median(v) for m, v in calls.items() if v}
    out = {m: {"ms_per_run": round(1000 * s, 3), "points_per_s": round(points / s), "blocks": len(spent[m]),
               "calls_ms_per_run": round(1000 * in_calls[m], 3)} for m, s in per_run.items()}
    if len(per_run) == 2:
        out["cost_of_terms"] = round(per_run["on"] / per_run["off"] - 1, 3)
        out["cost_of_terms_in_calls"] = round(in_calls["on"] / in_calls["off"] - 1, 3)
    return out


def queries(k, repeats: int) -> dict:
    from kb.query_sql import top_ids, walk_ids
    out = {}
    for label, f in FILTERS.items():
        times: dict[str, list[float]] = {"fields": [], "terms": [], "walk": [], "runs": []}     # seconds
        k.runs(where=f.kb_where(0), sort=SORT, limit=LIMIT)                  # warm: pages, caches
        termed = top_ids(f.kb_where(0), SORT, LIMIT, terms=True)
        uses_terms = termed is not None and "FROM runterm" in str(termed).replace("\n", " ")
        for r in range(1, repeats + 1):
            where = f.kb_where(r)
            ids = {}
            for name, terms in (("fields", False), ("terms", True)):
                with k.engine.connect() as conn:
                    stmt = top_ids(where, SORT, LIMIT, terms=terms)
                    t = time.perf_counter()
                    ids[name] = list(conn.execute(stmt).scalars())
                    times[name].append(time.perf_counter() - t)
            assert ids["fields"] == ids["terms"], (where, ids)
            with k.engine.connect() as conn:
                t = time.perf_counter()
                walk_ids(conn, where, SORT, LIMIT)
                times["walk"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rows = k.runs(where=where, sort=SORT, limit=LIMIT)
            times["runs"].append(time.perf_counter() - t)
            assert [r.id for r in rows] == ids["fields"], where
        p = {n: percentiles(v) for n, v in times.items()}
        out[label] = {"where": f.kb_where(1), "terms_plan": uses_terms,
                      **{f"{n}_p50_ms": q["p50_ms"] for n, q in p.items()}, "runs_p95_ms": p["runs"]["p95_ms"],
                      "fields_over_terms": round(p["fields"]["p50_ms"] / p["terms"]["p50_ms"], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--postgres", required=True, help="a Postgres URL (a schema is made in its database)")
    ap.add_argument("--schema", help="keep the runs in this schema (reused by the next run) instead of a scratch one")
    ap.add_argument("--runs", type=int, default=20_000)
    ap.add_argument("--points-per-run", type=int, default=200)
    ap.add_argument("--extra", type=int, default=10_000, help="runs ingested in the paired triggers on/off blocks")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="print the results as JSON, the last line of stdout")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp, knowledge_base(Path(tmp), "home", args.postgres, args.schema) as k:
        have = stored_runs(k)
        if have < args.runs:
            print(f"loading runs {have:,} to {args.runs:,} ...", flush=True)
            ingest(k, have, args.runs, args.points_per_run, 1000)
        have = stored_runs(k)
        print(f"ingesting {args.extra:,} more, 1,000 a block, term triggers on and off in turn ...", flush=True)
        paired = ingest_pairs(k, 10_000_000 + have, args.extra, args.points_per_run) if args.extra else {}
        result = {"setup": {"runs": stored_runs(k), "points_per_run": args.points_per_run, "repeats": args.repeats,
                            "limit": LIMIT, "sort": SORT},
                  "ingest": paired, "queries": queries(k, args.repeats)}
    print(f"\n{result['setup']['runs']:,} runs on Postgres")
    for mode, r in paired.items():
        if isinstance(r, dict):
            print(f"  ingest, term triggers {mode}: {r['ms_per_run']} ms a run, {r['points_per_s']:,} points/s "
                  f"(median of {r['blocks']} blocks of 1,000)")
    if "cost_of_terms" in paired:
        print(f"  the terms cost an ingest {100 * paired['cost_of_terms']:+.1f}% (the calls alone, without the "
              f"block's end: {paired['on']['calls_ms_per_run']} against {paired['off']['calls_ms_per_run']} ms a run, "
              f"{100 * paired['cost_of_terms_in_calls']:+.1f}%)")
    print(f"  {'filter':<6} {'plan':<7} {'RunField ids':>13} {'term ids':>9} {'walk':>7} {'k.runs p50/p95':>16}  ratio")
    for label, q in result["queries"].items():
        print(f"  {label:<6} {'terms' if q['terms_plan'] else 'fields':<7} {q['fields_p50_ms']:>10.2f} ms "
              f"{q['terms_p50_ms']:>6.2f} ms {q['walk_p50_ms']:>4.2f} ms {q['runs_p50_ms']:>6.2f} / {q['runs_p95_ms']:.2f} ms"
              f"  {q['fields_over_terms']}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
