"""Hybrid retrieval's own pieces on a real store (real SQL on both databases, the real embedded
Qdrant and MiniLM): a run the question names leads by its id or its name, and the keyword
tokens treat numbers and compounds as people write them."""
from __future__ import annotations

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
