"""Embedding backends side by side: torch (sentence-transformers) vs onnx, onnx-int8, openvino and
openvino-bf16, same model.

    nice -n 19 .venv/bin/python benchmarks/embed_speed.py --cards 2000 --queries 300 [--json]

Run cards (kb.cards.run_card over generated runs, the exact text the indexer embeds) are embedded
by each backend in chunks, the backends interleaved chunk by chunk (and their order rotated) so
that load from other work on the machine falls on all of them alike: read the ratios to torch,
not the absolute cards/s. Batch 64 (Settings.embedding_batch) covers the whole corpus; batch 32
is timed on the first chunks again. Then, per backend:
  - cosine between its card vectors and torch's (min, 1st percentile, mean);
  - recall@10 of its top-10 against torch's top-10 for `--queries` generated questions, both
    with its own card vectors (an index built by it) and against torch's card vectors (an index
    built by torch, queried through it: the mixed case an existing index meets), and the share of
    its own-index top-10 whose torch score is within 0.01 of torch's 10th (near ties).
One thread everywhere (Settings.threads default). The ONNX exports come from the user cache dir
(or --cache-dir); the first run pays the export once, reported as load seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vector_index import PROJECTS, make_cards  # noqa: E402

BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-bf16")
K = 10


def make_queries(n: int, seed: int = 1) -> list[str]:
    """Questions of the shapes people ask of run cards: by project, status, lr, norm, failure."""
    rng = random.Random(seed)
    lrs = ("1e-4", "3e-4", "6e-4", "1e-3", "3e-3", "6e-3")
    shapes = [
        lambda: f"runs in {rng.choice(PROJECTS)} that diverged",
        lambda: f"which {rng.choice(PROJECTS)} runs ran out of memory",
        lambda: f"lr {rng.choice(lrs)} with {rng.choice(['rmsnorm', 'layernorm'])}",
        lambda: f"best val loss in {rng.choice(PROJECTS)} at learning rate {rng.choice(lrs)}",
        lambda: f"{rng.choice(['lr-sweep', 'ablate-norm', 'warmup', 'baseline', 'wd'])} runs with "
                f"{rng.choice((4, 6, 8, 12, 24))} layers and d_model {rng.choice((256, 512, 768, 1024, 2048))}",
        lambda: f"loss spike in train/loss for {rng.choice(PROJECTS)}",
        lambda: f"preempted runs tagged {rng.choice(['baseline', 'ablation:norm', 'sweep', 'long'])}",
        lambda: f"warmup {rng.choice((100, 500, 2000))} beta2 {rng.choice((0.95, 0.99))} batch size "
                f"{rng.choice((128, 256, 512, 1024))}",
        lambda: f"{rng.choice(['completed', 'killed', 'running', 'failed'])} runs trained on "
                f"{rng.choice(['web', 'web+code'])} data",
    ]
    return [rng.choice(shapes)() for _ in range(n)]


def top_k(cards: np.ndarray, queries: np.ndarray) -> np.ndarray:
    scores = queries @ cards.T
    return np.argsort(-scores, axis=1, kind="stable")[:, :K]


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(set(g) & set(w)) / K for g, w in zip(got, want)]))


def near_recall(cards: np.ndarray, got: np.ndarray, want: np.ndarray, queries: np.ndarray, tol: float) -> float:
    """Like recall, but a returned card counts when its torch score is within `tol` of torch's
    10th: the misses a reader could not tell from the cards torch ranked (near ties)."""
    hits = []
    for q, g, w in zip(queries, got, want):
        scores = cards @ q
        hits.append(np.mean(scores[g] >= scores[w].min() - tol))
    return float(np.mean(hits))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cards", type=int, default=2000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=128, help="cards per interleaved timing chunk")
    ap.add_argument("--batch32-chunks", type=int, default=3, help="chunks timed again at batch 32")
    ap.add_argument("--cache-dir", default=None, help="ONNX exports; default the user cache dir")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(1)
    from kb.embed import load_embedder

    cards = make_cards(args.cards)[0]
    queries = make_queries(args.queries)
    loads, embedders = {}, {}
    for b in BACKENDS:
        t = time.perf_counter()
        embedders[b] = load_embedder("all-MiniLM-L6-v2", threads=1, backend=b, cache_dir=args.cache_dir)
        loads[b] = time.perf_counter() - t
        assert embedders[b].backend == b, f"{b} fell back to {embedders[b].backend}"
    tokens = embedders["onnx"].tokenizer.encode_batch(cards[:500])
    mean_tokens = float(np.mean([sum(e.attention_mask) for e in tokens]))

    for e in embedders.values():      # warm up: first calls allocate
        e.encode(cards[:8], batch_size=8)
    vectors = {b: np.zeros((len(cards), embedders[b].dim), np.float32) for b in BACKENDS}
    spent = {(b, bs): 0.0 for b in BACKENDS for bs in (32, 64)}
    done = {bs: 0 for bs in (32, 64)}
    chunks = [range(i, min(i + args.chunk, len(cards))) for i in range(0, len(cards), args.chunk)]
    for n, rows in enumerate(chunks):
        texts = [cards[i] for i in rows]
        order = BACKENDS[n % len(BACKENDS):] + BACKENDS[:n % len(BACKENDS)]
        for bs in ((64, 32) if n < args.batch32_chunks else (64,)):
            for b in order:
                t = time.perf_counter()
                v = embedders[b].encode(texts, batch_size=bs)
                spent[b, bs] += time.perf_counter() - t
                if bs == 64:
                    vectors[b][rows.start:rows.stop] = v
            done[bs] += len(texts)
        print(f"  {rows.stop}/{len(cards)} cards", file=sys.stderr, flush=True)

    speed = {}
    for bs in (32, 64):
        for b in BACKENDS:
            speed.setdefault(b, {})[f"batch{bs}"] = {
                "cards_per_s": round(done[bs] / spent[b, bs], 2),
                "ratio_vs_torch": round(spent["torch", bs] / spent[b, bs], 3)}

    q_vectors = {b: embedders[b].encode(queries, batch_size=64) for b in BACKENDS}
    want = top_k(vectors["torch"], q_vectors["torch"])
    agreement = {}
    for b in BACKENDS:
        cos = np.sum(vectors[b] * vectors["torch"], axis=1)
        q_cos = np.sum(q_vectors[b] * q_vectors["torch"], axis=1)
        agreement[b] = {
            "card_cos_min": round(float(cos.min()), 6), "card_cos_p01": round(float(np.percentile(cos, 1)), 6),
            "card_cos_mean": round(float(cos.mean()), 6), "query_cos_min": round(float(q_cos.min()), 6),
            "recall_at_10_own_index": round(recall(top_k(vectors[b], q_vectors[b]), want), 4),
            "recall_at_10_torch_index": round(recall(top_k(vectors["torch"], q_vectors[b]), want), 4),
            "recall_at_10_own_index_within_0.01": round(near_recall(
                vectors["torch"], top_k(vectors[b], q_vectors[b]), want, q_vectors["torch"], 0.01), 4)}

    result = {"cards": len(cards), "queries": len(queries), "mean_tokens_per_card": round(mean_tokens, 1),
              "threads": 1, "load_s": {b: round(s, 2) for b, s in loads.items()},
              "speed": speed, "agreement": agreement}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{len(cards)} cards (~{mean_tokens:.0f} tokens), {len(queries)} queries, 1 thread")
        print(f"{'backend':<13} {'load s':>7} {'b32 c/s':>8} {'x torch':>7} {'b64 c/s':>8} {'x torch':>7} "
              f"{'cos min':>8} {'cos mean':>8} {'R@10 own':>8} {'R@10 torch-idx':>14} {'own~0.01':>8}")
        for b in BACKENDS:
            s32, s64, a = speed[b]["batch32"], speed[b]["batch64"], agreement[b]
            print(f"{b:<13} {loads[b]:>7.2f} {s32['cards_per_s']:>8.1f} {s32['ratio_vs_torch']:>7.2f} "
                  f"{s64['cards_per_s']:>8.1f} {s64['ratio_vs_torch']:>7.2f} {a['card_cos_min']:>8.4f} "
                  f"{a['card_cos_mean']:>8.4f} {a['recall_at_10_own_index']:>8.3f} {a['recall_at_10_torch_index']:>14.3f} "
                  f"{a['recall_at_10_own_index_within_0.01']:>8.3f}")
    return result


if __name__ == "__main__":
    main()
