"""The baseline the agent is measured against: plain dense RAG as llama-index builds it.

A `VectorStoreIndex` over the same citable chunks (agents.corpus.all_chunks) as TextNodes whose
metadata names the record (kind, id), embedded by the same MiniLM model, answered by the same
LLM (agents.llm.get_llm) through llama-index's `CitationQueryEngine` with as many sources as the
agent reads (4). Its citations are the `[n]` markers of its answer, mapped to the sources' records.
"""
from __future__ import annotations

import re
from typing import Any

from llama_index.core import VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.query_engine import CitationQueryEngine
from llama_index.core.schema import TextNode

from agents.corpus import all_chunks

SOURCES = 4           # the agent's CONTEXT_CHUNKS: both read the same amount


class MiniLMEmbedding(BaseEmbedding):
    """kb.embed's model as a llama-index embedding (no llama-index-embeddings-huggingface needed:
    the model is already loaded, and this keeps its exact normalisation)."""
    _embedder: Any = PrivateAttr()

    def __init__(self, embedder, **kw):
        super().__init__(model_name=embedder.name, embed_batch_size=64, **kw)
        self._embedder = embedder

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.encode([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.encode([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.encode(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


class Baseline:
    def __init__(self, kb, llm=None):
        chunks = list(all_chunks(kb.engine))
        # metadata stays out of the embedded text, so each vector is the one the agent's index holds
        nodes = [TextNode(id_=c.key, text=c.text, metadata={"kind": c.kind, "id": c.id},
                          excluded_embed_metadata_keys=["kind", "id"], excluded_llm_metadata_keys=["kind", "id"])
                 for c in chunks]
        self.index = VectorStoreIndex(nodes, embed_model=MiniLMEmbedding(kb.embedder))
        self.retriever = self.index.as_retriever(similarity_top_k=10)
        self.engine = CitationQueryEngine.from_args(self.index, llm=llm, similarity_top_k=SOURCES) if llm else None
        self.size = len(nodes)

    def retrieve(self, question: str) -> list[str]:
        return [n.node.metadata["kind"] + ":" + n.node.metadata["id"] for n in self.retriever.retrieve(question)]

    def ask(self, question: str) -> tuple[str, list[tuple[str, str, str]]]:
        """(answer text, [(kind, id, quote)] for each source its [n] markers name); a marker past the
        last source cites nothing that exists, and is kept as such (kind "missing")."""
        response = self.engine.query(question)
        text = str(response).strip()
        sources = response.source_nodes
        cited = []
        for n in dict.fromkeys(int(x) for x in re.findall(r"\[(\d+)\]", text)):
            if 1 <= n <= len(sources):
                node = sources[n - 1].node
                quote = re.sub(r"^Source \d+:\n", "", node.get_content()).strip()
                cited.append((node.metadata["kind"], node.metadata["id"], quote))
            else:
                cited.append(("missing", str(n), ""))
        return text, cited
