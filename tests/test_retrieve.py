"""Hybrid retrieval's own pieces on a real store (real SQL on both databases, the real embedded
Qdrant and MiniLM): a run the question names leads by its id or its name, and the keyword
tokens treat numbers and compounds as people write them."""
from __future__ import annotations

from pathlib import Path

import pytest

from agents.sparse import tokens


def test_numbers_have_one_spelling_and_compounds_yield_their_parts():
    assert tokens("lr 3e-4") == tokens("lr 0.0003") == ["lr", "0.0003"]
    assert tokens("val/loss diverged") == ["val/loss", "val", "loss", "diverg"]
    assert tokens("the runs that diverged") == ["diverg"]            # stop words dropped, stem kept
    # the same answer the second time: the per-token cache returns what it computed
    assert tokens("base-lr0.001 warmup") == tokens("base-lr0.001 warmup") == \
        ["base-lr0.001", "base", "lr0", "warmup"]


@pytest.mark.slow
def test_a_run_named_in_the_question_leads_by_id_or_by_name(kb):
    from agents.retrieve import Retriever
    runs = [{"id": f"r{i:03d}", "project": "p", "name": f"350M-lr{lr:g}-rmsnorm-{i}", "status": "completed",
             "config": {"optim": {"lr": lr}}, "metrics": {"val/loss": [[100, 3.0 - i / 100]]}}
            for i, lr in enumerate((1e-3, 2e-3, 3e-3, 6e-4))]
    assert kb.ingest_records(runs).added == 4
    kb.sync_index()
    retriever = Retriever(kb)
    by_name = retriever.retrieve("why was 350M-lr0.003-rmsnorm-2 slower than the others?", k=4)
    assert by_name[0].key == "run:r002" and by_name[0].via.get("link") == 0
    by_id = retriever.retrieve("compare r003 with r001", k=4)
    assert [h.key for h in by_id[:2]] == ["run:r003", "run:r001"]
    assert all(h.via.get("link") is None for h in retriever.retrieve("which lr was best?", k=4))


QUESTIONS = ["why did the 1.3B runs at lr 3e-3 diverge?", "rmsnorm warmup warmup", "lr 0.0003 val/loss",
             "nccl_timeout on node 7", "zzzz unknown words only", "the and of"]


@pytest.mark.slow
def test_the_keyword_index_scores_as_bm25s_does_and_reads_back_the_same(kb, tmp_path):
    """The index is built here, not by bm25s (agents/sparse.py says why), to bm25s's scores: on
    the demo history's chunks, a chunk with no token, and questions with a repeated token, a
    number, an unknown word; then saved and opened from disk."""
    import bm25s
    import numpy as np
    from agents.corpus import all_chunks
    from agents.sparse import SparseIndex, signature
    from kb.record_texts import RecordText
    history = Path(__file__).resolve().parents[1] / "kb" / "demo_history"
    report = kb.ingest(str(history / "runs.jsonl"), index=False)
    assert report.added >= 20 and kb.ingest(str(history / "notes"), index=False).added
    chunks = list(all_chunks(kb.engine)) + [RecordText("note", "stop-words-only", "The and of", "p")]
    ours = SparseIndex.build(chunks, signature(kb.engine))
    reference = bm25s.BM25()
    reference.index([tokens(c.text) or ["<empty>"] for c in chunks], show_progress=False)
    assert set(ours.vocab) == set(reference.vocab_dict) - {""}      # bm25s adds an empty token
    for q in QUESTIONS:
        if tokens(q):           # bm25s refuses a query of no token; ours scores it zero everywhere
            np.testing.assert_allclose(ours.scores(tokens(q)), reference.get_scores(tokens(q)), rtol=1e-5, atol=1e-6)
        else:
            assert not ours.scores(tokens(q)).any() and ours.search(q, 3) == []
    assert ours.search("diverged", 3) and not ours.search("zzzz", 3)
    folder = tmp_path / "bm25"
    ours.save(folder)
    back = SparseIndex.open(kb.engine, folder)          # same signature: read from disk, not rebuilt
    assert back.keys == ours.keys and back.vocab == ours.vocab
    for q in QUESTIONS:
        assert back.search(q, 10) == ours.search(q, 10)
