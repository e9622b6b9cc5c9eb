"""Vector index speed and recall: the embedded engine (qdrant-edge) at 100k points, with
qdrant-client's local mode at a small N beside it for the ratio.

    python benchmarks/vector_index.py                  # N=100,000, 3,000 real embeddings
    python benchmarks/vector_index.py --n 20000 --real 500 --local-n 1000   # a quick look

Embedding 100k cards with MiniLM on this CPU would take ~40 minutes, so: `--real` distinct
generated run cards (kb.cards.run_card, the exact text the indexer embeds) are embedded for
real and cached under benchmarks/.cache/; recall is measured with held-out real cards as
queries; latency and reopen are timed at N points made of the real vectors plus random unit
vectors for the remainder. The output says so too.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kb.cards import card_hash, run_card  # noqa: E402
from kb.vectors import ClientIndex, EdgeIndex, VectorPoint  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
PROJECTS = ["gpt-small", "gpt-medium", "gpt-350m", "moe-1b", "long-ctx", "tokenizer-ablation",
            "data-mix", "optim-sweep", "scaling-2025", "distill"]
STATUSES = ["completed", "completed", "completed", "failed", "diverged", "killed", "running"]
FAILURES = {"diverged": ("diverged", "loss is NaN"), "failed": ("oom", "CUDA out of memory"),
            "killed": ("killed", "preempted by scheduler")}
N_QUERIES = 200
K = 10


def make_cards(n: int, seed: int = 0) -> tuple[list[str], list[dict]]:
    """n distinct run cards with the payloads the indexer would store for them."""
    rng = random.Random(seed)
    cards, payloads, seen = [], [], set()
    while len(cards) < n:
        i = len(cards)
        lr = rng.choice((1e-4, 2e-4, 3e-4, 6e-4, 1e-3, 2e-3, 3e-3, 6e-3))
        layers, width = rng.choice((4, 6, 8, 12, 24)), rng.choice((256, 512, 768, 1024, 2048))
        status, project = rng.choice(STATUSES), rng.choice(PROJECTS)
        params = 12 * layers * width ** 2 + 50304 * width
        name = f"{rng.choice(['lr-sweep', 'ablate-norm', 'warmup', 'baseline', 'wd'])}-{lr:g}-{rng.randrange(1000)}"
        config = {"model": {"n_layer": layers, "d_model": width, "norm": rng.choice(["layernorm", "rmsnorm"])},
                  "optim": {"lr": lr, "warmup": rng.choice((100, 500, 2000)), "beta2": rng.choice((0.95, 0.99))},
                  "data": {"batch_size": rng.choice((128, 256, 512, 1024)), "mix": rng.choice(["web", "web+code"])}}
        run = {"id": f"r{i:06d}", "name": name, "project": project, "status": status, "config": config,
               "scale": {"params": params, "tokens": rng.choice((1e9, 2.5e9, 1e10, 3e10)), "flops": None},
               "summary": {"val/loss": round(2.6 + rng.random() * 1.5, 3)},
               "tags": rng.sample(["baseline", "ablation:norm", "ablation:lr", "sweep", "long"], rng.randrange(3)),
               "notes": ""}
        failures = []
        if status in FAILURES:
            kind, msg = FAILURES[status]
            failures.append({"kind": kind, "step": rng.randrange(100, 20000), "message": msg})
        anomalies = [{"kind": "loss_spike", "key": "train/loss", "step": rng.randrange(100, 20000)}] \
            if rng.random() < 0.2 else []
        card = run_card(run, failures, anomalies)
        if card in seen:
            continue
        seen.add(card)
        cards.append(card)
        payloads.append({"kind": "run", "project": project, "status": status, "card_hash": card_hash(card)})
    return cards, payloads


def embed_cached(cards: list[str], model: str) -> np.ndarray:
    key = hashlib.sha1((model + "\0" + "\0".join(cards)).encode()).hexdigest()[:16]
    path = CACHE / f"cards-{len(cards)}-{key}.npy"
    if path.exists():
        print(f"  embeddings: {len(cards)} real MiniLM vectors from cache {path.relative_to(CACHE.parent.parent)}")
        return np.load(path)
    from kb.embed import load_embedder
    e = load_embedder(model, threads=1)
    t = time.perf_counter()
    vectors = e.encode(cards, batch_size=64)
    dt = time.perf_counter() - t
    print(f"  embeddings: {len(cards)} real MiniLM vectors in {dt:.0f} s ({len(cards) / dt:.0f} cards/s), cached")
    CACHE.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors


def random_payload(rng: random.Random, i: int) -> dict:
    return {"kind": "run" if i % 4 else "note", "project": rng.choice(PROJECTS),
            "status": rng.choice(STATUSES), "card_hash": f"x{i}"}


def build_corpus(real: np.ndarray, real_payloads: list[dict], n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    fill = max(0, n - len(real))
    noise = rng.standard_normal((fill, real.shape[1])).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    vectors = np.vstack([real[:n], noise])
    prng = random.Random(seed)
    payloads = real_payloads[:n] + [random_payload(prng, i) for i in range(len(real), len(real) + fill)]
    ids = [f"run:{i}" for i in range(len(vectors))]
    return ids, vectors, payloads


def exact_top(vectors: np.ndarray, mask: np.ndarray | None, q: np.ndarray, k: int = K) -> list[int]:
    scores = vectors @ q
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    top = np.argpartition(-scores, k)[:k]
    return [int(i) for i in top if np.isfinite(scores[i])]


def mask_for(payloads: list[dict], where: dict) -> np.ndarray:
    def ok(p):
        return all(p.get(k) in (v if isinstance(v, list) else [v]) for k, v in where.items())
    return np.array([ok(p) for p in payloads])


def measure(index, ids, vectors, payloads, queries, wheres) -> dict:
    """p50/p95 latency and recall@10 against numpy exact search, per filter."""
    pos = {pid: i for i, pid in enumerate(ids)}
    out = {}
    for label, where in wheres.items():
        mask = mask_for(payloads, where) if where else None
        times, recalls = [], []
        for q in queries:
            t = time.perf_counter()
            hits = index.search(q, limit=K, where=where)
            times.append((time.perf_counter() - t) * 1000)
            want = set(exact_top(vectors, mask, q))
            got = {pos[h.id] for h in hits}
            recalls.append(len(want & got) / max(1, len(want)))
        times.sort()
        out[label] = (statistics.median(times), times[int(0.95 * (len(times) - 1))], float(np.mean(recalls)))
    return out


def fill(index, ids, vectors, payloads) -> float:
    t = time.perf_counter()
    step = 1000      # the indexer writes in batches too; each call flushes once
    for i in range(0, len(ids), step):
        index.upsert([VectorPoint(ids[j], vectors[j], payloads[j]) for j in range(i, min(len(ids), i + step))])
    return time.perf_counter() - t


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def report(name: str, n: int, upsert_s: float, reopen_s: float, res: dict, extra: str = "") -> None:
    print(f"\n{name} at {n:,} points{extra}")
    print(f"  upsert            {upsert_s:8.2f} s   ({n / upsert_s:,.0f} points/s)")
    print(f"  reopen            {reopen_s:8.3f} s")
    for label, (p50, p95, rec) in res.items():
        print(f"  search {label:<28} p50 {p50:7.2f} ms  p95 {p95:7.2f} ms  recall@10 {rec:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="points in the embedded index")
    ap.add_argument("--real", type=int, default=3000, help="real run cards to embed (recall is measured on these)")
    ap.add_argument("--local-n", type=int, default=5000, help="points for qdrant-client local mode")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    print(f"vector index benchmark: {args.real:,} real MiniLM embeddings of generated run cards "
          f"({N_QUERIES} held out as queries); latency/reopen at N use those real vectors plus "
          f"random unit vectors for the remainder; recall@{K} is against exact numpy search over "
          "the same N points, with real held-out cards as queries")
    cards, card_payloads = make_cards(args.real + N_QUERIES)
    emb = embed_cached(cards, args.model)
    queries, real, real_payloads = emb[:N_QUERIES], emb[N_QUERIES:], card_payloads[N_QUERIES:]
    wheres = {"unfiltered": None,
              "kind=run,project=gpt-small": {"kind": "run", "project": "gpt-small"},
              "status in (diverged,failed)": {"status": ["diverged", "failed"]}}
    tmp = Path(tempfile.mkdtemp(prefix="kb-vec-bench-"))
    try:
        # ---- qdrant-edge, exact search: the embedded default ----
        ids, vectors, payloads = build_corpus(real, real_payloads, args.n)
        path = tmp / "edge" / "kb"
        index = EdgeIndex.open(path, vectors.shape[1], model=args.model)
        upsert_s = fill(index, ids, vectors, payloads)
        index.close()
        t = time.perf_counter()
        index = EdgeIndex.open(path, vectors.shape[1], model=args.model)
        reopen_s = time.perf_counter() - t
        assert index.count() == len(ids), "points lost across close/reopen"
        t = time.perf_counter()
        index.fingerprints()
        fp_s = time.perf_counter() - t
        res = measure(index, ids, vectors, payloads, queries, wheres)
        index.close()
        report("qdrant-edge 0.9 (exact search, payload indexes on kind/project/status)", len(ids),
               upsert_s, reopen_s, res, f", {min(len(real), args.n):,} real + {max(0, args.n - len(real)):,} random")
        print(f"  fingerprints()    {fp_s:8.3f} s   (reconcile with SQL reads every id + card_hash)")
        print(f"  on disk           {dir_mb(path.parent):8.0f} MB")

        # ---- numpy brute force over the same matrix, for scale ----
        times = []
        for q in queries[:50]:
            t = time.perf_counter()
            exact_top(vectors, None, q)
            times.append((time.perf_counter() - t) * 1000)
        print(f"  (numpy exact top-{K} over the same matrix: p50 {statistics.median(times):.2f} ms)")

        # ---- HNSW inside qdrant-edge, on the real vectors only: what exact search saves us from ----
        hnsw_recall(tmp, real, real_payloads, queries, args.model)

        # ---- qdrant-client local mode at a small N ----
        from qdrant_client import QdrantClient
        ids, vectors, payloads = build_corpus(real, real_payloads, args.local_n)
        lpath = tmp / "local"
        index = ClientIndex(QdrantClient(path=str(lpath)), "kb", vectors.shape[1], model=args.model)
        upsert_s = fill(index, ids, vectors, payloads)
        index.close()
        t = time.perf_counter()
        index = ClientIndex(QdrantClient(path=str(lpath)), "kb", vectors.shape[1], model=args.model)
        reopen_s = time.perf_counter() - t
        assert index.count() == len(ids)
        res = measure(index, ids, vectors, payloads, queries[:50], wheres)
        index.close()
        report("qdrant-client 1.20 local mode (disk path), for the ratio", len(ids), upsert_s, reopen_s, res,
               f", {min(len(real), args.local_n):,} real + {max(0, args.local_n - len(real)):,} random")
        print(f"  on disk           {dir_mb(lpath):8.0f} MB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hnsw_recall(tmp: Path, real: np.ndarray, payloads: list[dict], queries: np.ndarray, model: str) -> None:
    """Build an HNSW graph (Qdrant defaults m=16, ef_construct=100) over the real vectors and
    measure its recall: the number that decides whether exact search is worth its cost."""
    import qdrant_edge as qe

    ids = [f"run:{i}" for i in range(len(real))]
    path = tmp / "hnsw" / "kb"
    index = EdgeIndex.open(path, real.shape[1], model=model)
    fill(index, ids, real, payloads)
    index.close()
    config = qe.EdgeConfig(vectors=qe.EdgeVectorParams(size=real.shape[1], distance=qe.Distance.Cosine),
                           hnsw_config=qe.HnswIndexConfig(m=16, ef_construct=100, full_scan_threshold=1,
                                                          max_indexing_threads=1),
                           optimizers=qe.EdgeOptimizersConfig(indexing_threshold=1), max_search_threads=1)
    shard = qe.EdgeShard.load(str(path), config)
    t = time.perf_counter()
    shard.optimize()
    opt_s = time.perf_counter() - t
    indexed = shard.info().indexed_vectors_count
    recalls, times = [], []
    for q in queries:
        t = time.perf_counter()
        hits = shard.query(qe.QueryRequest(limit=K, query=qe.Query.Nearest(q.tolist()), with_payload=True,
                                           params=qe.SearchParams(hnsw_ef=64)))
        times.append((time.perf_counter() - t) * 1000)
        want = {ids[i] for i in exact_top(real, None, q)}
        recalls.append(len(want & {h.payload["point_id"] for h in hits}) / K)
    shard.close()
    print(f"\nqdrant-edge HNSW (m=16, ef_construct=100, hnsw_ef=64) on the {len(real):,} real vectors only: "
          f"optimize {opt_s:.1f} s, {indexed:,} vectors indexed, search p50 {statistics.median(times):.2f} ms, "
          f"recall@{K} {np.mean(recalls):.3f}")


if __name__ == "__main__":
    main()
