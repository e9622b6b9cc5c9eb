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

The embedded folder is one process's alone while open (a lock file beside it, `kb.lock`). A
process that cannot open it (another holds it, or the folder is read-only) searches a private
copy instead (`open_index_copy`): copying and loading 100k points takes ~0.1-0.5 s, where
waiting for the holder could take the whole of `kb serve`'s life (benchmarks/index_readers.py).
Files that cannot be read (garbage, truncated, a piece missing) raise IndexDamaged; the index
is derived from SQL, so `open_index(..., rebuild=True)` (what `kb reindex` does) starts afresh.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from kb.errors import IndexDamaged, KBError, ReadOnlyStore
from kb.index_files import (busy, copy_shard, damaged, meta_path, native_stderr_to_log, read_meta, remove,
                            take_lock, writes_settled)
from kb.settings import secret

log = logging.getLogger(__name__)

ID_FIELD = "point_id"
HASH_FIELD = "card_hash"
INDEXED_FIELDS = ("kind", "project", "status", "ref_id")      # what retrieval filters on (kb.indexer.payload)
ID_NAMESPACE = uuid.UUID("5b0f3c1e-8a7d-4c52-9a51-6e0b1f2d7c43")   # fixed forever: ids must not move
SCROLL_PAGE = 2048
BATCH = 512
RETRIES = 5                 # attempts at a call a busy or restarting Qdrant server refused
RETRY_BASE_S = 0.5          # doubled after each refusal: 0.5, 1, 2, 4 s
TRANSIENT_STATUS = {429, 502, 503, 504}
COPY_TRIES = 3          # copies of a folder being written before searching the last one anyway


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


def open_index(settings, dim: int, *, rebuild: bool = False) -> VectorIndex:
    """The server when `qdrant_url` is set, else the embedded shard; creates the collection if missing.
    `rebuild` starts empty whatever was there (damaged files included)."""
    if settings.qdrant_url:
        index = _client_index(settings, dim)
        if rebuild:
            index.delete(list(index.fingerprints()))
        return index
    return EdgeIndex.open(settings.qdrant_path / settings.collection, dim,
                          model=settings.embedding_model, threads=settings.threads, rebuild=rebuild)


def open_index_copy(settings, dim: int) -> VectorIndex:
    """An index to search when `open_index` cannot be had: the embedded folder is held by another
    process or read-only. A server needs no copy."""
    if settings.qdrant_url:
        return _client_index(settings, dim)
    return EdgeIndex.open_copy(settings.qdrant_path / settings.collection, dim, model=settings.embedding_model)


def writable(settings) -> bool:
    """Whether this process may write the embedded index (a server decides for itself)."""
    if settings.qdrant_url:
        return True
    path = settings.qdrant_path
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)


def _client_index(settings, dim: int) -> "ClientIndex":
    from qdrant_client import QdrantClient
    client = QdrantClient(url=settings.qdrant_url, api_key=secret(settings.qdrant_api_key) or None)
    return ClientIndex(client, settings.collection, dim, model=settings.embedding_model)


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
    """One qdrant-edge shard in a folder, held by this process (or a private copy of one)."""

    def __init__(self, shard, path: Path, *, lock=None, scratch: Path | None = None):
        self.shard, self.path = shard, path
        self._lock = lock            # the open lock file: the folder is ours while it is held
        self._scratch = scratch      # a copy's own temp folder, removed on close

    @classmethod
    def open(cls, path: Path, dim: int, *, model: str = "", threads: int = 1,
             rebuild: bool = False) -> "EdgeIndex":
        import qdrant_edge as qe

        path = Path(path)
        want = {"model": model, "dim": dim}
        config = qe.EdgeConfig(vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine),
                               max_search_threads=threads)
        lock = take_lock(path)
        try:
            if rebuild:
                # whatever is there (damaged, stale, another model's) goes: SQL refills it
                remove(path)
            elif (path / "edge_config.json").exists():
                have = read_meta(path, default=want)
                if have == want:
                    shard = _edge_call(lambda: qe.EdgeShard.load(str(path), config), path, opening=True)
                    return cls(shard, path, lock=lock)._ready(want)
                # vectors from another model are meaningless; the index is derived, so rebuild it
                # (the indexer's reconcile sees an empty index and re-queues everything from SQL)
                log.warning("vector index at %s was built with %s; rebuilding for %s", path, have, want)
                remove(path)
            # a folder left without its config (a piece deleted) makes create fail: IndexDamaged
            shard = _edge_call(lambda: qe.EdgeShard.create(str(path), config), path, opening=True)
            return cls(shard, path, lock=lock)._ready(want)
        except BaseException:
            lock.close()
            raise

    @classmethod
    def open_copy(cls, path: Path, dim: int, *, model: str = "") -> "EdgeIndex":
        """A private copy to search, for a process that cannot hold the folder. It holds what the
        holder had flushed when it was taken (the holder flushes after every write); a folder that
        changed during the copy is copied again, up to COPY_TRIES times."""
        import qdrant_edge as qe

        path = Path(path)
        if not (path / "edge_config.json").exists():
            raise IndexDamaged(f"no vector index at {path} to search; `kb reindex` (where the knowledge "
                               "base is writable) builds it from SQL")
        have, want = read_meta(path, default={"model": model, "dim": dim}), {"model": model, "dim": dim}
        if have != want:
            raise IndexDamaged(f"vector index at {path} holds {have['model']} vectors, not {model}; "
                               "`kb reindex` (where the knowledge base is writable) rebuilds it")
        for attempt in range(1, COPY_TRIES + 1):
            scratch = Path(tempfile.mkdtemp(prefix="kb-index-"))
            try:
                with writes_settled(path, writer=False):
                    unchanged = copy_shard(path, scratch / path.name)
                shard = _edge_call(lambda: qe.EdgeShard.load(str(scratch / path.name)), path, opening=True)
            except BaseException as exc:
                shutil.rmtree(scratch, ignore_errors=True)
                if attempt < COPY_TRIES and isinstance(exc, (IndexDamaged, OSError)):
                    continue             # a torn copy of a folder being written: take another
                raise
            if unchanged or attempt == COPY_TRIES:
                return cls(shard, path, scratch=scratch)
            shard.close()
            shutil.rmtree(scratch, ignore_errors=True)
        raise AssertionError("unreachable")

    def _ready(self, want: dict) -> "EdgeIndex":
        try:
            self._ensure_payload_indexes()
            meta_path(self.path).write_text(json.dumps(want))
        except BaseException:
            self.shard.close()        # the caller releases the lock
            raise
        return self

    def _ensure_payload_indexes(self) -> None:
        import qdrant_edge as qe
        have = set(_edge_call(lambda: self.shard.info().payload_schema, self.path))
        for name in INDEXED_FIELDS:
            if name not in have:
                _edge_call(lambda: self.shard.update(
                    qe.UpdateOperation.create_field_index(name, qe.PayloadSchemaType.Keyword)), self.path)

    def upsert(self, points: list[VectorPoint]) -> None:
        import qdrant_edge as qe
        self._check_writable()
        with writes_settled(self.path, writer=True):
            for chunk in _batches(points):
                _edge_call(lambda: self.shard.update(qe.UpdateOperation.upsert_points(
                    [qe.Point(qdrant_id(p.id), _as_list(p.vector), _payload(p)) for p in chunk])), self.path)
            # the WAL already makes this durable; flushing keeps the replay after a crash short, and
            # lets a reader's copy (open_copy, which leaves the WAL out) see the new points
            _edge_call(self.shard.flush, self.path)

    def delete(self, ids: list[str]) -> None:
        import qdrant_edge as qe
        self._check_writable()
        with writes_settled(self.path, writer=True):
            for chunk in _batches(list(ids)):
                _edge_call(lambda: self.shard.update(
                    qe.UpdateOperation.delete_points([qdrant_id(i) for i in chunk])), self.path)
            _edge_call(self.shard.flush, self.path)

    def _check_writable(self) -> None:
        if self._scratch is not None:
            raise ReadOnlyStore(f"this is a read-only copy of the vector index at {self.path}")

    def search(self, vector, limit: int = 10, where: dict | None = None) -> list[Hit]:
        import qdrant_edge as qe
        request = qe.QueryRequest(limit=limit, query=qe.Query.Nearest(_as_list(vector)),
                                  filter=_edge_filter(where), with_payload=True,
                                  params=qe.SearchParams(exact=True))   # exact: recall 1.0, still fast here
        return [_hit(None, p.score, p.payload) for p in _edge_call(lambda: self.shard.query(request), self.path)]

    def fingerprints(self) -> dict[str, str]:
        import qdrant_edge as qe
        fields = qe.PayloadSelector.Include([ID_FIELD, HASH_FIELD])
        return _fingerprints(lambda offset: _edge_call(lambda: self.shard.scroll(
            qe.ScrollRequest(offset=offset, limit=SCROLL_PAGE, with_payload=fields)), self.path))

    def count(self) -> int:
        import qdrant_edge as qe
        return _edge_call(lambda: self.shard.count(qe.CountRequest(exact=True)), self.path)

    def close(self) -> None:
        try:
            if self.shard is not None:
                self.shard.close()
                self.shard = None
        finally:
            if self._lock is not None:
                self._lock.close()          # closing the file releases its flock
                self._lock = None
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None


def _edge_call(fn, path: Path, *, opening: bool = False):
    """Run one qdrant-edge call, its failures as domain errors: the binding raises a bare Exception
    (a held WAL lock says "WouldBlock"), and on some damaged files a Rust panic, which pyo3 raises
    as a BaseException after printing it (and a backtrace) straight to fd 2. Loading is where
    damaged files panic, so only opening pays for keeping fd 2 clean."""
    try:
        if not opening:
            return fn()
        with native_stderr_to_log():
            return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:     # noqa: BLE001 - a PanicException is no Exception
        text = str(exc).strip()
        if "WouldBlock" in text:
            raise busy(path) from exc
        raise damaged(path, text.splitlines()[0] if text else type(exc).__name__) from exc


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
    """A collection reached through qdrant-client: a server, or its local / in-memory mode.

    On a server: a keyword payload index for every field retrieval filters on, upserts and deletes
    in batches of BATCH waited for, and calls that a busy or restarting server refuses (429, 5xx,
    a dropped connection) retried with backoff; two replicas creating the collection at once both
    go on with the one that won."""

    def __init__(self, client, collection: str, dim: int, *, model: str = ""):
        from qdrant_client import models

        self.client, self.collection = client, collection
        if not self._call(client.collection_exists, collection):
            try:
                self._call(client.create_collection, collection, vectors_config=models.VectorParams(
                    size=dim, distance=models.Distance.COSINE), metadata={"embedding_model": model, "dim": dim})
            except Exception as exc:        # noqa: BLE001 - another replica may have created it first
                if not self._call(client.collection_exists, collection):
                    raise KBError(f"cannot create Qdrant collection {collection!r}: {exc}") from None
        info = self._call(client.get_collection, collection)
        have_dim = info.config.params.vectors.size
        have_model = (info.config.metadata or {}).get("embedding_model", model)
        if have_dim != dim or have_model != model:
            # a shared server collection is not ours to drop: say what to do instead
            raise KBError(f"Qdrant collection {collection!r} holds {have_model} vectors (dim {have_dim}); "
                          f"this process embeds with {model} (dim {dim}). Set KB_COLLECTION to a new "
                          f"name, or drop the collection and run `kb reindex`.")
        self._index_payload(models, set(info.payload_schema or {}))

    def _index_payload(self, models, have: set[str]) -> None:
        """Keyword indexes on the filtered fields the collection lacks (`have`: those it has)."""
        with warnings.catch_warnings():
            # local mode warns that payload indexes do nothing there; on a server they do
            warnings.simplefilter("ignore", UserWarning)
            for name in INDEXED_FIELDS:
                if name not in have:
                    self._call(self.client.create_payload_index, self.collection, name,
                               models.PayloadSchemaType.KEYWORD)

    @staticmethod
    def _call(fn, *args, **kwargs):
        """fn(*args, **kwargs), retried while the server says it is busy or cannot be reached."""
        from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse
        for attempt in range(RETRIES):
            try:
                return fn(*args, **kwargs)
            except (UnexpectedResponse, ResponseHandlingException) as exc:
                status = getattr(exc, "status_code", None)
                transient = isinstance(exc, ResponseHandlingException) or status in TRANSIENT_STATUS
                if not transient or attempt == RETRIES - 1:
                    raise
                wait = RETRY_BASE_S * 2 ** attempt
                log.warning("Qdrant refused %s (%s); retrying in %.1f s", getattr(fn, "__name__", "a call"),
                            status or type(exc).__name__, wait)
                time.sleep(wait)

    def upsert(self, points: list[VectorPoint]) -> None:
        from qdrant_client import models
        for chunk in _batches(points):
            self._call(self.client.upsert, self.collection, [models.PointStruct(
                id=qdrant_id(p.id), vector=_as_list(p.vector), payload=_payload(p)) for p in chunk], wait=True)

    def delete(self, ids: list[str]) -> None:
        from qdrant_client import models
        for chunk in _batches(list(ids)):
            self._call(self.client.delete, self.collection,
                       models.PointIdsList(points=[qdrant_id(i) for i in chunk]), wait=True)

    def search(self, vector, limit: int = 10, where: dict | None = None) -> list[Hit]:
        res = self._call(self.client.query_points, self.collection, query=_as_list(vector),
                         query_filter=_client_filter(where), limit=limit, with_payload=True)
        return [_hit(str(p.id), p.score, p.payload) for p in res.points]

    def fingerprints(self) -> dict[str, str]:
        return _fingerprints(lambda offset: self._call(
            self.client.scroll, self.collection, limit=SCROLL_PAGE, offset=offset, with_payload=[ID_FIELD, HASH_FIELD]))

    def count(self) -> int:
        return self._call(self.client.count, self.collection, exact=True).count

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
