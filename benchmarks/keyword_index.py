"""The keyword index's rebuild, the cost of the first question after an ingest: ours against bm25s.

    python benchmarks/keyword_index.py                        # 20,000 runs into a fresh SQLite store
    python benchmarks/keyword_index.py --runs 100000 --json   # the figures as JSON, last line of stdout
    python benchmarks/keyword_index.py --runs 100000 --postgres postgresql://postgres@127.0.0.1/test
                                                              # a scratch schema, dropped after

Loads --runs sweep runs (benchmarks/scale_runs.py, --points-per-run curve points; their ablations
and failures come with them) in one `KnowledgeBase.bulk()` block, then times, --repeats times
each, interleaved so the machine's drift weighs on both alike:

- reading the chunks from SQL (`agents.corpus.all_chunks`: run cards, ablations, failures, notes),
- our build (`agents.sparse.SparseIndex.build`: tokens, ids, one sparse matrix of BM25 weights),
- bm25s's (the same `tokens` per chunk, then `bm25s.BM25().index`: what agents/sparse.py did
  before), the incumbent.

The medians are printed with their ratio, and the two indexes' scores compared on a few questions
(equal within float32 rounding, or the run fails). Then the index is opened as a question would
(`SparseIndex.open`: built and saved), --more runs are loaded, and it is opened again: the rebuild
after an ingest, which reads and tokenizes only the chunks of records written since (their stamps,
`agents.corpus.chunk_stamps`), timed against a read and build from scratch of the same chunks
(their scores compared too). Last, the check every question makes first (has SQL changed since
the build: `agents.sparse.signature`), timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["KB_LLM_BACKEND"] = "none"

from ingest_scale import knowledge_base  # noqa: E402
from scale_runs import make_run  # noqa: E402

QUESTIONS = ("why did the 1.3B runs at lr 3e-3 diverge?", "runs with rmsnorm and a long warmup",
             "out of memory failures at batch size 1024", "batch_size ablation at 350M")


def load(k, runs: int, points: int, batch: int = 1000, first: int = 0) -> float:
    t = time.perf_counter()
    with k.bulk():
        for a in range(first, first + runs, batch):
            stop = min(first + runs, a + batch)
            report = k.ingest_records([make_run(i, points) for i in range(a, stop)], index=False)
            assert report.added == stop - a and not report.failed, report.as_dict()
    return time.perf_counter() - t


def bm25s_build(chunks):
    import bm25s
    from agents.sparse import EMPTY, tokens
    model = bm25s.BM25()
    model.index([tokens(c.text) or [EMPTY] for c in chunks], show_progress=False)
    return model


def measure(k, repeats: int) -> dict:
    from agents.corpus import all_chunks
    from agents.sparse import SparseIndex, _forms, tokens
    read, ours, theirs = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        chunks = list(all_chunks(k.engine))
        read.append(time.perf_counter() - t)
        _forms.cache_clear()            # each build from cold, as in a new process
        t = time.perf_counter()
        index = SparseIndex.build(chunks)
        ours.append(time.perf_counter() - t)
        _forms.cache_clear()
        t = time.perf_counter()
        model = bm25s_build(chunks)
        theirs.append(time.perf_counter() - t)
    worst = 0.0
    for q in QUESTIONS:
        a, b = index.scores(tokens(q)), model.get_scores(tokens(q))
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6))))
    assert worst < 1e-5, f"the two indexes score differently (relative difference {worst})"
    med = {name: statistics.median(v) for name, v in (("read", read), ("ours", ours), ("bm25s", theirs))}
    return {"chunks": len(chunks), "vocabulary": len(index.vocab), "repeats": repeats,
            "read_s": round(med["read"], 2), "ours_build_s": round(med["ours"], 2),
            "bm25s_build_s": round(med["bm25s"], 2), "build_ratio": round(med["bm25s"] / med["ours"], 2),
            "rebuild_ours_s": round(med["read"] + med["ours"], 2),
            "rebuild_bm25s_s": round(med["read"] + med["bm25s"], 2),
            "max_relative_score_difference": worst,
            "all_builds": {"read": [round(x, 2) for x in read], "ours": [round(x, 2) for x in ours],
                           "bm25s": [round(x, 2) for x in theirs]}}


def measure_after_ingest(k, folder: Path, start: int, more: int, points: int) -> dict:
    from agents.corpus import all_chunks
    from agents.sparse import SparseIndex, _forms, tokens
    SparseIndex.open(k.engine, folder)                 # built and saved, as the last question left it
    load(k, more, points, first=start)
    _forms.cache_clear()
    t = time.perf_counter()
    index = SparseIndex.open(k.engine, folder)
    incremental = time.perf_counter() - t
    _forms.cache_clear()
    t = time.perf_counter()
    fresh = SparseIndex.build(list(all_chunks(k.engine)))        # read and built, as before
    scratch = time.perf_counter() - t
    order = [index._position[k] for k in fresh.keys]          # a rebuild keeps rows and appends the new
    for q in QUESTIONS:
        assert np.allclose(index.scores(tokens(q))[order], fresh.scores(tokens(q)), rtol=1e-5, atol=1e-6), q
    return {"more_runs": more, "chunks_after": len(index.keys), "read": index.read, "tokenized": index.tokenized,
            "rebuild_reusing_s": round(incremental, 2), "rebuild_from_scratch_s": round(scratch, 2),
            "ratio": round(scratch / incremental, 2)}


def check_cost(k, repeats: int = 7) -> float:
    """The check every question makes before it retrieves: has SQL changed since the index was
    built (`agents.sparse.signature`)? Median seconds."""
    from agents.sparse import signature
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        signature(k.engine)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20_000)
    ap.add_argument("--points-per-run", type=int, default=20, help="curve points a run (the cards hardly depend on it)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--more", type=int, default=None, help="runs loaded before the rebuild after an ingest "
                    "(default: 1%% of --runs)")
    ap.add_argument("--postgres", default=os.environ.get("KB_BENCH_POSTGRES_URL"),
                    help="a Postgres URL: the store goes in a scratch schema there (dropped after)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object, last line of stdout")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, knowledge_base(Path(tmp), "kb", args.postgres) as k:
        load_s = load(k, args.runs, args.points_per_run)
        out = {"store": "postgres" if args.postgres else "sqlite", "runs": args.runs, "load_s": round(load_s, 1)}
        out |= measure(k, args.repeats)
        more = args.more if args.more is not None else max(1, args.runs // 100)
        out["after_ingest"] = measure_after_ingest(k, Path(tmp) / "bm25", args.runs, more, args.points_per_run)
        out["check_ms"] = round(check_cost(k) * 1000, 1)
    print(f"{out['store']}, {out['runs']:,} runs: {out['chunks']:,} chunks, {out['vocabulary']:,} distinct tokens")
    print(f"  read the chunks from SQL       {out['read_s']:6.2f} s")
    print(f"  build, ours                    {out['ours_build_s']:6.2f} s")
    print(f"  build, bm25s (the incumbent)   {out['bm25s_build_s']:6.2f} s   ({out['build_ratio']:.2f}x ours)")
    print(f"  rebuild (read + build): ours {out['rebuild_ours_s']:.2f} s, with bm25s {out['rebuild_bm25s_s']:.2f} s; "
          f"scores equal within {out['max_relative_score_difference']:.1e} (relative)")
    a = out["after_ingest"]
    print(f"  after {a['more_runs']:,} more runs ({a['chunks_after']:,} chunks): the rebuild reusing the saved "
          f"rows {a['rebuild_reusing_s']:.2f} s ({a['read']:,} chunks read, {a['tokenized']:,} tokenized), "
          f"from scratch {a['rebuild_from_scratch_s']:.2f} s ({a['ratio']:.2f}x)")
    print(f"  the check before every question (has SQL changed since the build?) {out['check_ms']:.1f} ms")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
