"""Hybrid retrieval over the citable chunks: dense (the Qdrant index), keyword (BM25), structured
(the question's constraints as a run query) and links (runs named in the question), fused by
reciprocal rank.

    r = Retriever(kb)
    hits = r.retrieve("why did the 350M run at lr 3e-3 diverge?")    # -> list[Retrieved]
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from sqlalchemy import or_, select
from sqlmodel import Session

from agents.corpus import Chunk, chunks_by_key
from agents.sparse import SparseIndex, signature
from kb.models import Failure, Run

RRF_K = 60.0          # the constant of Cormack et al.; ranks past ~60 barely count
# a run named in the question is what the question is about: its list weighs more than a
# similarity ranking, so it leads unless both other lists disagree
WEIGHTS = {"link": 3.0, "structured": 1.0, "dense": 1.0, "sparse": 1.0}
# identifiers people paste: letters/digits joined by - _ . (run ids, names), at least one digit
# or joiner, so plain words never trigger a lookup
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*[A-Za-z0-9]")


@dataclass
class Retrieved:
    chunk: Chunk
    score: float
    via: dict[str, int] = field(default_factory=dict)      # list name -> rank (0 = first)

    @property
    def key(self) -> str:
        return self.chunk.key


class Retriever:
    def __init__(self, kb, *, sparse: SparseIndex | None = None):
        self.kb = kb
        self._sparse = sparse

    @property
    def sparse(self) -> SparseIndex:
        if self._sparse is None:
            self._sparse = SparseIndex.open(self.kb.engine, self.kb.settings.home / "bm25")
        return self._sparse

    def refresh_if_changed(self) -> None:
        """Reopen the keyword index if SQL changed since it was loaded (a few ms: once per
        question, never per retrieval)."""
        if self._sparse is not None and self._sparse.signature != signature(self.kb.engine):
            self._sparse = None

    def vocabulary(self) -> set[str] | dict:
        """Every token some record holds (the keyword index's vocabulary)."""
        return self.sparse.vocab

    def retrieve(self, question: str, k: int = 8, *, where: str | None = None, project: str | None = None,
                 kinds: set[str] | None = None, depth: int = 30) -> list[Retrieved]:
        """The k best chunks for `question`. `where` (a run query) narrows runs and their failures
        to those that match, and ranks the matching runs as a list of its own."""
        lists: dict[str, list[str]] = {}
        allowed_runs = self._matching_runs(where) if where else None
        linked = self._linked_runs(question)
        if linked:
            lists["link"] = [f"run:{r}" for r in linked]
        dense = self._dense(question, depth, project, kinds, allowed_runs)
        lists["dense"] = dense
        keys = None
        if allowed_runs is not None:
            keys = {f"run:{r}" for r in allowed_runs} | self._failure_keys(allowed_runs)
            # the structured list: matching runs in the dense order, then the rest of them
            ordered = [key for key in dense if key.startswith("run:") and key in keys]
            lists["structured"] = ordered + sorted(k_ for k_ in keys if k_.startswith("run:")
                                                   and k_ not in set(ordered))[:depth]
        lists["sparse"] = [key for key, _ in self.sparse.search(question, depth, kinds=kinds, project=project,
                                                                  keys=keys)]
        fused = fuse(lists)
        chunks = chunks_by_key(self.kb.engine, [key for key, _ in fused[: k * 2]])
        out = []
        for key, score in fused:
            if key in chunks:
                out.append(Retrieved(chunks[key], score,
                                     {name: ranks.index(key) for name, ranks in lists.items() if key in ranks}))
            if len(out) == k:
                break
        return out

    def _dense(self, question: str, depth: int, project: str | None, kinds: set[str] | None,
               allowed_runs: list[str] | None) -> list[str]:
        where: dict = {}
        if project:
            where["project"] = project
        if kinds:
            where["kind"] = sorted(kinds)
        if allowed_runs is not None:
            if not allowed_runs:
                return []
            where["kind"] = "run"
            where["ref_id"] = allowed_runs
        vector = self.kb.embedder.encode([question])[0]
        # search_index: a private copy when another process holds the index or the home is read-only
        return [h.id for h in self.kb.search_index.search(vector, limit=depth, where=where or None)]

    def _matching_runs(self, where: str) -> list[str]:
        from kb.query_sql import compile_where
        with Session(self.kb.engine) as s:
            return list(s.execute(select(Run.id).where(compile_where(where)).limit(10_000)).scalars())

    def _failure_keys(self, run_ids: list[str]) -> set[str]:
        if not run_ids:
            return set()
        with Session(self.kb.engine) as s:
            ids = s.execute(select(Failure.id).where(Failure.run_id.in_(run_ids[:5000]))).scalars()
            return {f"failure:{i}" for i in ids}

    def _linked_runs(self, question: str) -> list[str]:
        """Runs whose id or name appears in the question, in the order they appear."""
        words = [w for w in _IDENT.findall(question)
                 if any(c.isdigit() for c in w) or any(c in "-_.:/" for c in w)]
        if not words:
            return []
        with Session(self.kb.engine) as s:
            rows = s.execute(select(Run.id, Run.name).where(or_(Run.id.in_(words), Run.name.in_(words)))).all()
        order = {w: i for i, w in reversed(list(enumerate(words)))}
        rows = sorted(rows, key=lambda r: min(order.get(r.id, 1 << 30), order.get(r.name, 1 << 30)))
        return [r.id for r in rows]


def fuse(lists: dict[str, list[str]], weights: dict[str, float] = WEIGHTS) -> list[tuple[str, float]]:
    """Weighted reciprocal rank fusion. Written here rather than taken from llama-index's
    QueryFusionRetriever: that one weighs every list alike, dedupes by node text hash rather
    than by record, and resolves Settings.llm at construction (an OpenAI import) even when it
    generates no queries."""
    scores: dict[str, float] = {}
    for name, ranked in lists.items():
        w = weights.get(name, 1.0)
        for rank, key in enumerate(ranked):
            scores[key] = scores.get(key, 0.0) + w / (RRF_K + rank + 1)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def as_llama_index(retriever: Retriever, k: int = 8):
    """The hybrid retrieval as a llama-index BaseRetriever, so its response synthesizers and
    query engines run over it; each node's metadata names the record it cites."""
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class HybridRetriever(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(id_=h.key, text=h.chunk.text,
                                                metadata={"kind": h.chunk.kind, "id": h.chunk.id,
                                                          "project": h.chunk.project}),
                                  score=h.score)
                    for h in retriever.retrieve(query_bundle.query_str, k)]

    return HybridRetriever()
