"""A reader beside a holder: what `kb search` pays when another process holds the embedded index.

    python benchmarks/index_readers.py                 # 3,000 / 10,000 / 100,000 points
    python benchmarks/index_readers.py --sizes 3000    # a quick look

An embedded qdrant-edge folder is one process's alone, so a second process cannot open it. The
ways a reader could still answer, measured here on the same folder:
- copy: copy the shard's files (not its WAL) to a temp folder and load the copy (what kb does;
  kb.vectors.EdgeIndex.open_copy), timed cold-ish (first) and warm (median of the rest), and
  with another process upserting into the folder the whole time (each copy taken mid-write);
- wait: wait for the holder to let go, which for `kb serve` is never, and for an indexing
  `kb ingest` is its embedding time (printed here per 1,000 cards at MiniLM's measured rate);
- SQL: no vectors live in SQL, so a SQL-side search would embed every card first (the same
  per-card cost as waiting, times the whole history).
The direct open a holder pays is printed beside them. Vectors are random unit vectors (the
timings depend on the number of points, not on what they mean). The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kb.vectors import EdgeIndex, VectorPoint  # noqa: E402

DIM = 384
WRITER = """
import select, sys
import numpy as np
sys.path.insert(0, {root!r})
from kb.vectors import EdgeIndex, VectorPoint
idx = EdgeIndex.open({path!r}, {dim}, model="bench")
print("held", flush=True)
rng, i = np.random.default_rng(1), 0
while not select.select([sys.stdin], [], [], 0)[0]:
    idx.upsert([VectorPoint(f"run:w{{i + j}}", rng.standard_normal({dim}), {{"kind": "run", "project": "w"}})
                for j in range(64)])
    i += 64
idx.close()
"""


def build(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    idx = EdgeIndex.open(path, DIM, model="bench")
    for start in range(0, n, 10_000):
        idx.upsert([VectorPoint(f"run:{i}", rng.standard_normal(DIM), {"kind": "run", "project": f"p{i % 10}"})
                    for i in range(start, min(n, start + 10_000))])
    idx.close()


def timed_copy(path: Path, query) -> tuple[float, float]:
    t0 = time.perf_counter()
    copy = EdgeIndex.open_copy(path, DIM, model="bench")
    opened = time.perf_counter() - t0
    t1 = time.perf_counter()
    hits = copy.search(query, limit=10)
    searched = time.perf_counter() - t1
    copy.close()
    assert hits, "the copy found nothing"
    return opened, searched


def embed_rate(cards: int = 200) -> float:
    from kb.embed import load_embedder
    model = load_embedder("all-MiniLM-L6-v2", threads=1)
    texts = [f"run {i} of project p{i % 10}: lr {1e-4 * (i % 7 + 1):.1e}, val/loss {3 + i % 5 / 10}, "
             f"status completed; notes: a stable curve with a small spike near step {i * 10}" for i in range(cards)]
    model.encode(texts[:8])
    t0 = time.perf_counter()
    model.encode(texts)
    return cards / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3000,10000,100000")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    query = np.random.default_rng(9).standard_normal(DIM)
    results = {}
    for n in (int(s) for s in args.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="kb-readers-"))
        path = root / "qdrant" / "kb"
        build(path, n)
        t0 = time.perf_counter()
        EdgeIndex.open(path, DIM, model="bench").close()
        direct = time.perf_counter() - t0
        quiet = [timed_copy(path, query) for _ in range(args.repeats)]
        writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(Path(__file__).resolve().parents[1]),
                                                                        path=str(path), dim=DIM)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "held"
        busy = [timed_copy(path, query) for _ in range(args.repeats)]
        writer.communicate("\n", timeout=120)
        shutil.rmtree(root)
        results[n] = {"direct_open_s": direct, "copy_first_s": quiet[0][0],
                      "copy_p50_s": statistics.median(q[0] for q in quiet[1:] or quiet),
                      "copy_while_writing_p50_s": statistics.median(b[0] for b in busy),
                      "search_on_copy_p50_s": statistics.median(q[1] for q in quiet)}
        r = results[n]
        print(f"{n:>7} points: direct open {r['direct_open_s']:.3f} s | copy+load first {r['copy_first_s']:.3f} s, "
              f"p50 {r['copy_p50_s']:.3f} s, while another process writes {r['copy_while_writing_p50_s']:.3f} s | "
              f"search on the copy {r['search_on_copy_p50_s'] * 1000:.1f} ms")
    rate = embed_rate()
    print(f"waiting for an indexing holder, or a SQL-side search that embeds the cards: "
          f"{1000 / rate:.1f} s per 1,000 cards ({rate:.1f} cards/s, MiniLM on this CPU); for kb serve: forever")
    print(json.dumps({"sizes": results, "embed_cards_per_s": rate}))


if __name__ == "__main__":
    main()
