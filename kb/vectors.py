"""The vector index: one Qdrant collection of run cards and notes, derived from SQL.

    index = open_index(settings, dim=384)     # embedded under KB_HOME/qdrant, or KB_QDRANT_URL
    index.upsert([VectorPoint("run:abc", vec, {"kind": "run", "project": "gpt-small", "card_hash": h})])
    index.search(vec, limit=5, where={"kind": "run", "status": ["diverged", "failed"]})

Two engines behind one small protocol:
- `EdgeIndex` (the embedded default): qdrant-edge, Qdrant's own engine in-process. Searches
  are exact (brute force over the segment, pre-filtered by payload indexes), so recall is 1.0
  by construction; at 100k points that is ~10 ms unfiltered and ~1 ms filtered, reopen ~0.2 s
  (benchmarks/vector_index.py). qdrant-client's local mode took 345 s to upsert 100k and ~2 s
  per filtered search, and HNSW in qdrant-edge needs a 2-minute optimize, so neither is used.
- `ClientIndex`: qdrant-client against a Qdrant server (also works on `QdrantClient(":memory:")`
  or a local path, which is how the tests and the benchmark drive it).

Point ids in Qdrant are uuid5 of the string id ("run:abc"); the string id travels in the
payload under `point_id`, so a hit names its record without a lookup table.
"""
from __future__ import annotations

import json
import logging
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from kb.errors import IndexBusy, KBError

log = logging.getLogger(__name__)

ID_FIELD = "point_id"
HASH_FIELD = "card_hash"
INDEXED_FIELDS = ("kind", "project", "status", "ref_id")      # what retrieval filters on (kb.indexer.payload)
ID_NAMESPACE = uuid.UUID("5b0f3c1e-8a7d-4c52-9a51-6e0b1f2d7c43")   # fixed forever: ids must not move
SCROLL_PAGE = 2048
BATCH = 512


@dataclass
class VectorPoint:
    id: str                                   # "run:abc", "note:xyz"
    vector: Sequence[float] | np.ndarray
    payload: dict = field(default_factory=dict)


@dataclass
class Hit:
    id: str
    score: float                              # cosine similarity, higher is closer
    payload: dict


class VectorIndex(Protocol):
    def upsert(self, points: list[VectorPoint]) -> None: ...
    def delete(self, ids: list[str]) -> None: ...
    def search(self, vector, limit: int = 10, where: dict | None = None) -> list[Hit]: ...
    def fingerprints(self) -> dict[str, str]: ...
    def count(self) -> int: ...
    def close(self) -> None: ...


def qdrant_id(point_id: str) -> str:
    return str(uuid.uuid5(ID_NAMESPACE, point_id))


def open_index(settings, dim: int) -> VectorIndex:
    """The server when `qdrant_url` is set, else the embedded shard; creates the collection if missing."""
    if settings.qdrant_url:
        from qdrant_client import QdrantClient
        client = QdrantClient(url=settings.qdrant_url, api_key=settings.qdrant_api_key)
        return ClientIndex(client, settings.collection, dim, model=settings.embedding_model)
    return EdgeIndex.open(settings.qdrant_path / settings.collection, dim,
                          model=settings.embedding_model, threads=settings.threads)


def _fingerprints(scroll) -> dict[str, str]:
    """id -> card hash of every point, paging with `scroll(offset) -> (records, next_offset)`."""
    out, offset = {}, None
    while True:
        records, offset = scroll(offset)
        for r in records:
            payload = r.payload or {}
            out[payload.get(ID_FIELD, str(r.id))] = payload.get(HASH_FIELD, "")
        if offset is None:
            return out


def _batches(items: Sequence, size: int = BATCH) -> Iterable[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _as_list(vector) -> list[float]:
    return np.asarray(vector, dtype=np.float32).ravel().tolist()


def _payload(point: VectorPoint) -> dict:
    return {**point.payload, ID_FIELD: point.id}


def _hit(point_id: str | None, score: float, payload: dict | None) -> Hit:
    payload = dict(payload or {})
    return Hit(id=payload.pop(ID_FIELD, point_id), score=float(score), payload=payload)


# ---- embedded: qdrant-edge ----------------------------------------------------------------

class EdgeIndex:
    """One qdrant-edge shard in a folder. The shard's WAL lock makes it one process's alone."""

    def __init__(self, shard, path: Path):
        self.shard, self.path = shard, path

    @classmethod
    def open(cls, path: Path, dim: int, *, model: str = "", threads: int = 1) -> "EdgeIndex":
        import qdrant_edge as qe

        path = Path(path)
        meta_path = path.with_name(path.name + ".json")
        want = {"model": model, "dim": dim}
        vectors = qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine)
        if (path / "edge_config.json").exists():
            have = json.loads(meta_path.read_text()) if meta_path.exists() else want
            # same vectors: load with our config (thread count may have changed); else load bare,
            # which still takes the lock, so a busy index is reported before anything is touched
            config = qe.EdgeConfig(vectors=vectors, max_search_threads=threads) if have == want else None
            shard = _edge_call(lambda: qe.EdgeShard.load(str(path), config), path)
            if have == want:
                index = cls(shard, path)
                index._ensure_payload_indexes()
                meta_path.write_text(json.dumps(want))
                return index
            # vectors from another model are meaningless; the index is derived, so rebuild it
            # (the indexer's reconcile sees an empty index and re-queues everything from SQL)
            log.warning("vector index at %s was built with %s; rebuilding for %s", path, have, want)
            shard.close()
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        shard = _edge_call(lambda: qe.EdgeShard.create(
            str(path), qe.EdgeConfig(vectors=vectors, max_search_threads=threads)), path)
        index = cls(shard, path)
        index._ensure_payload_indexes()
        meta_path.write_text(json.dumps(want))
        return index

    def _ensure_payload_indexes(self) -> None:
        import qdrant_edge as qe
        have = set(self.shard.info().payload_schema)
        for name in INDEXED_FIELDS:
            if name not in have:
                self.shard.update(qe.UpdateOperation.create_field_index(name, qe.PayloadSchemaType.Keyword))

    def upsert(self, points: list[VectorPoint]) -> None:
        import qdrant_edge as qe
        for chunk in _batches(points):
            self.shard.update(qe.UpdateOperation.upsert_points(
                [qe.Point(qdrant_id(p.id), _as_list(p.vector), _payload(p)) for p in chunk]))
        # the WAL already makes this durable; flushing keeps the replay after a crash short
        self.shard.flush()

    def delete(self, ids: list[str]) -> None:
        import qdrant_edge as qe
        for chunk in _batches(list(ids)):
            self.shard.update(qe.UpdateOperation.delete_points([qdrant_id(i) for i in chunk]))
        self.shard.flush()

    def search(self, vector, limit: int = 10, where: dict | None = None) -> list[Hit]:
        import qdrant_edge as qe
        request = qe.QueryRequest(limit=limit, query=qe.Query.Nearest(_as_list(vector)),
                                  filter=_edge_filter(where), with_payload=True,
                                  params=qe.SearchParams(exact=True))   # exact: recall 1.0, still fast here
        return [_hit(None, p.score, p.payload) for p in self.shard.query(request)]

    def fingerprints(self) -> dict[str, str]:
        import qdrant_edge as qe
        fields = qe.PayloadSelector.Include([ID_FIELD, HASH_FIELD])
        return _fingerprints(lambda offset: self.shard.scroll(
            qe.ScrollRequest(offset=offset, limit=SCROLL_PAGE, with_payload=fields)))

    def count(self) -> int:
        import qdrant_edge as qe
        return self.shard.count(qe.CountRequest(exact=True))

    def close(self) -> None:
        if self.shard is not None:
            self.shard.close()
            self.shard = None


def _edge_call(fn, path: Path):
    """qdrant-edge raises a bare Exception; a held WAL lock ("WouldBlock") means another process."""
    try:
        return fn()
    except Exception as e:   # noqa: BLE001 - the binding has no error classes; re-raised unless it is the lock
        if "WouldBlock" in str(e):
            raise IndexBusy(f"vector index {path} is open in another process (kb serve?); "
                            "what was written waits in SQL and is indexed by that process") from e
        raise


def _edge_filter(where: dict | None):
    if not where:
        return None
    import qdrant_edge as qe
    conds = [qe.FieldCondition(key, match=qe.MatchAny(list(v)) if isinstance(v, (list, tuple, set))
                               else qe.MatchValue(v))
             for key, v in where.items()]
    return qe.Filter(must=conds)


# ---- server: qdrant-client ----------------------------------------------------------------

class ClientIndex:
    """A collection reached through qdrant-client: a server, or its local / in-memory mode."""

    def __init__(self, client, collection: str, dim: int, *, model: str = ""):
        from qdrant_client import models

        self.client, self.collection = client, collection
        if not client.collection_exists(collection):
            client.create_collection(collection, vectors_config=models.VectorParams(
                size=dim, distance=models.Distance.COSINE), metadata={"embedding_model": model, "dim": dim})
            with warnings.catch_warnings():
                # local mode warns that payload indexes do nothing there; on a server they do
                warnings.simplefilter("ignore", UserWarning)
                for name in INDEXED_FIELDS:
                    client.create_payload_index(collection, name, models.PayloadSchemaType.KEYWORD)
            return
        config = client.get_collection(collection).config
        have_dim = config.params.vectors.size
        have_model = (config.metadata or {}).get("embedding_model", model)
        if have_dim != dim or have_model != model:
            # a shared server collection is not ours to drop: say what to do instead
            raise KBError(f"Qdrant collection {collection!r} holds {have_model} vectors (dim {have_dim}); "
                          f"this process embeds with {model} (dim {dim}). Set KB_COLLECTION to a new "
                          f"name, or drop the collection and run `kb reindex`.")

    def upsert(self, points: list[VectorPoint]) -> None:
        from qdrant_client import models
        for chunk in _batches(points):
            self.client.upsert(self.collection, [models.PointStruct(
                id=qdrant_id(p.id), vector=_as_list(p.vector), payload=_payload(p)) for p in chunk], wait=True)

    def delete(self, ids: list[str]) -> None:
        from qdrant_client import models
        for chunk in _batches(list(ids)):
            self.client.delete(self.collection, models.PointIdsList(points=[qdrant_id(i) for i in chunk]),
                               wait=True)

    def search(self, vector, limit: int = 10, where: dict | None = None) -> list[Hit]:
        res = self.client.query_points(self.collection, query=_as_list(vector), query_filter=_client_filter(where),
                                       limit=limit, with_payload=True)
        return [_hit(str(p.id), p.score, p.payload) for p in res.points]

    def fingerprints(self) -> dict[str, str]:
        return _fingerprints(lambda offset: self.client.scroll(
            self.collection, limit=SCROLL_PAGE, offset=offset, with_payload=[ID_FIELD, HASH_FIELD]))

    def count(self) -> int:
        return self.client.count(self.collection, exact=True).count

    def close(self) -> None:
        self.client.close()


def _client_filter(where: dict | None):
    if not where:
        return None
    from qdrant_client import models
    conds: list[Any] = [models.FieldCondition(key=key, match=models.MatchAny(any=list(v))
                                              if isinstance(v, (list, tuple, set)) else models.MatchValue(value=v))
                        for key, v in where.items()]
    return models.Filter(must=conds)
