"""Hybrid retrieval's own pieces on a real store (real SQL on both databases, the real embedded
Qdrant and MiniLM): a run the question names leads by its id or its name, and the keyword
tokens treat numbers and compounds as people write them."""
from __future__ import annotations

from pathlib import Path

import pytest

from agents.sparse import EMPTY, tokens

HISTORY = Path(__file__).resolve().parents[1] / "kb" / "demo_history"


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
    report = kb.ingest(str(HISTORY / "runs.jsonl"), index=False)
    assert report.added >= 20 and kb.ingest(str(HISTORY / "notes"), index=False).added
    chunks = list(all_chunks(kb.engine)) + [RecordText("note", "stop-words-only", "The and of", "p")]
    ours = SparseIndex.build(chunks, signature(kb.engine))
    reference = bm25s.BM25()
    reference.index([tokens(c.text) or [EMPTY] for c in chunks], show_progress=False)
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


@pytest.mark.slow
def test_a_rebuild_tokenizes_only_new_and_changed_chunks_and_equals_a_fresh_build(kb, tmp_path):
    """After an ingest the keyword index is rebuilt from the saved one's token rows: a chunk whose
    text is unchanged keeps its tokens; the result is the index a build from scratch gives, its
    vocabulary without the tokens only a changed or deleted record held."""
    from agents.corpus import all_chunks
    from agents.sparse import SparseIndex
    kb.ingest(str(HISTORY / "runs.jsonl"), index=False)
    folder = tmp_path / "bm25"
    first = SparseIndex.open(kb.engine, folder)
    assert first.tokenized == len(first.keys) > 20
    run = kb.runs(limit=1)[0]
    report = kb.ingest_records([{"id": "zz-new", "project": "p", "config": {"norm": "quuxnorm"},
                       "metrics": {"val/loss": [[10, 3.1]]}},
                       {"id": run.id, "project": run.project, "name": "plughflavour", "config": run.config,
                        "metrics": {"val/loss": [[10, 2.9]]}}], index=False)
    assert (report.added, report.updated) == (1, 1), report.as_dict()
    second = SparseIndex.open(kb.engine, folder)
    assert 2 <= second.tokenized <= second.read < 6      # the new run, the changed one, what cites them
    fresh = SparseIndex.build(list(all_chunks(kb.engine)))
    assert sorted(second.keys) == sorted(fresh.keys) and set(second.vocab) == set(fresh.vocab)
    assert "quuxnorm" in second.vocab and "plughflavour" in second.vocab
    for q in ("quuxnorm", "plughflavour val loss", "diverged warmup", "d1 lr0.001"):
        assert second.search(q, 10) == fresh.search(q, 10), q
    # the changed run's old words go with it when nothing else holds them
    kb.ingest_records([{"id": run.id, "project": run.project, "name": "xyzzyword", "config": run.config,
                        "metrics": {"val/loss": [[10, 2.8]]}}], index=False)
    third = SparseIndex.open(kb.engine, folder)
    assert "plughflavour" not in third.vocab and "xyzzyword" in third.vocab and third.tokenized < 6
    assert set(third.vocab) == set(SparseIndex.build(list(all_chunks(kb.engine))).vocab)


def _score_by_key(index, question: str) -> dict[str, float]:
    return {k: round(s, 5) for k, s in index.search(question, 10_000)}


@pytest.mark.slow
def test_a_rebuild_reads_only_the_records_written_since_and_equals_a_fresh_build(kb, tmp_path, monkeypatch):
    """After the first build the keyword index reads from SQL only the chunks whose record was
    written since (their stamps), plus the ablations that name a renamed run; what it keeps and
    what it reads scores as a build from scratch of everything does."""
    from sqlalchemy import select
    from sqlmodel import Session

    import numpy as np

    import agents.sparse as sparse
    from agents.corpus import all_chunks
    from kb.models import AblationRun
    kb.ingest(str(HISTORY / "runs.jsonl"), index=False)
    sweep = [{"id": f"sweep-{i}", "project": "p", "name": f"sweep-{i}", "config": {"lr": lr, "norm": "rmsnorm"},
              "metrics": {"val/loss": [[100, 3.0 + i / 10]]}} for i, lr in enumerate((1e-3, 3e-3, 1e-2))]
    assert kb.ingest_records(sweep, index=False).added == 3       # an ablation of lr
    doc = tmp_path / "notes" / "review.md"
    doc.parent.mkdir()
    doc.write_text("# Review\n\n## Warmup\n\nThe gorgonzola warmup was too short.\n\n"
                   "## Clipping\n\nClipping at 1.0 kept the quokka runs stable.\n")
    assert kb.ingest(str(doc.parent), index=False).added == 2
    folder = tmp_path / "bm25"
    first = sparse.SparseIndex.open(kb.engine, folder)
    assert first.read == first.tokenized == len(first.keys) > 25
    with Session(kb.engine) as s:
        in_ablation = s.execute(select(AblationRun.run_id, AblationRun.ablation_id)
                                .where(AblationRun.run_id.like("sweep-%"))).first()
    assert in_ablation, "the sweep forms an ablation"
    run = kb.run(in_ablation[0])
    renamed = next(r for r in sweep if r["id"] == run.id) | {"name": "renamedwombat"}    # the ablation is unchanged
    report = kb.ingest_records([
        renamed,
        {"id": "zz-new", "project": run.project, "status": "diverged", "config": {"norm": "quuxnorm"},
         "metrics": {"train/loss": [[10, 3.1], [20, float("nan")]]},
         "failure": {"kind": "diverged", "step": 20, "message": "loss went to NaN at the blorptastic step"}}],
        index=False)
    assert (report.added, report.updated) == (1, 1), report.as_dict()
    doc.write_text("# Review\n\n## Warmup\n\nThe gorgonzola warmup was fine after all.\n")   # one chunk changed, one gone
    kb.ingest(str(doc.parent), index=False)
    second = sparse.SparseIndex.open(kb.engine, folder)
    # the renamed run, its ablations, the new run and its failure, the changed note: no more
    assert 5 <= second.read < 15 and second.tokenized <= second.read, (second.read, second.tokenized)
    fresh = sparse.SparseIndex.build(list(all_chunks(kb.engine)))
    assert sorted(second.keys) == sorted(fresh.keys) and set(second.vocab) == set(fresh.vocab)
    assert "quokka" not in second.vocab and "blorptastic" in second.vocab
    assert f"ablation:{in_ablation[1]}" in dict(second.search("renamedwombat", 50))    # its text names the run
    for q in ("renamedwombat", "blorptastic NaN", "gorgonzola warmup", "quuxnorm diverged", "lr 0.001 warmup"):
        assert _score_by_key(second, q) == _score_by_key(fresh, q), q
        assert second.search(q, 5) == fresh.search(q, 5), q
    # reopened from disk with nothing changed: nothing read
    assert sparse.SparseIndex.open(kb.engine, folder).read == 0
    # saved rows are trusted within one release: another release reads and tokenizes every chunk
    # once, and a folder saved without stamps reads every chunk and tokenizes the changed ones
    kb.ingest_records([{"id": "zz-newer", "project": run.project, "metrics": {"val/loss": [[10, 3.0]]}}], index=False)
    monkeypatch.setattr(sparse, "FORMAT", "another release")
    third = sparse.SparseIndex.open(kb.engine, folder)
    assert third.read == third.tokenized == len(third.keys)
    monkeypatch.undo()
    third.save(folder)
    with np.load(folder / "tokens.npz") as t:
        np.savez(folder / "tokens.npz", **{name: t[name] for name in t.files if name != "stamps"})
    kb.ingest_records([{"id": "zz-newest", "project": run.project, "metrics": {"val/loss": [[10, 3.0]]}}],
                      index=False)
    fourth = sparse.SparseIndex.open(kb.engine, folder)
    assert fourth.read == len(fourth.keys) and fourth.tokenized <= 3
    kb.ingest_records([{"id": "zz-last", "project": "q", "metrics": {"val/loss": [[10, 3.0]]}}], index=False)
    assert sparse.SparseIndex.open(kb.engine, folder).read == 1        # the stamps are saved again


@pytest.mark.slow
def test_saves_racing_into_one_folder_leave_a_whole_index_and_a_torn_read_is_rebuilt(kb, tmp_path):
    """Replicas of `kb serve` sharing a home save the keyword index at the same time: each writes
    under a name of its own and swaps it in whole (a shared temporary name let one's files land in
    the other's folder); a reader whose two reads straddle a swap rebuilds instead of pairing one
    index's keys with another's weights."""
    import json
    import threading

    import numpy as np
    import scipy.sparse as sp

    from agents.corpus import all_chunks
    from agents.sparse import SparseIndex, signature
    kb.ingest(str(HISTORY / "runs.jsonl"), index=False)
    chunks = list(all_chunks(kb.engine))
    sig = signature(kb.engine)
    big, small = SparseIndex.build(chunks, sig), SparseIndex.build(chunks[: len(chunks) // 2], sig)
    folder = tmp_path / "race" / "bm25"
    errors: list[BaseException] = []

    def saver(index):
        for _ in range(15):
            try:
                index.save(folder)
            except OSError:          # lost the swap to the other: its index stays
                pass
            except BaseException as e:    # noqa: BLE001 - any other escape fails the test
                errors.append(e)

    threads = [threading.Thread(target=saver, args=(i,)) for i in (big, small)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [p.name for p in folder.parent.iterdir()] == ["bm25"]            # nothing left beside it
    saved = json.loads((folder / "chunks.json").read_text())
    weights = sp.load_npz(folder / "weights.npz")
    with np.load(folder / "tokens.npz") as t:
        assert weights.shape[0] == len(saved["keys"]) == len(t["lengths"]) and weights.shape[1] == len(saved["vocab"])
    # a torn read: the other index's weights under these keys
    big.save(folder)
    sp.save_npz(folder / "weights.npz", small.weights, compressed=False)
    index = SparseIndex.open(kb.engine, folder)
    assert index.weights.shape == (len(index.keys), len(index.vocab)) and len(index.keys) == len(chunks)
