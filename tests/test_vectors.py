"""The embedding model and the vector index, on real components.

The real MiniLM model (loaded once for this module) embeds real sentences; the embedded
index is a real qdrant-edge shard under tmp_path; "another process" is a real subprocess.
No Qdrant server exists here, so the server path (`ClientIndex`) is tested through the same
class on qdrant-client's in-memory mode, `QdrantClient(":memory:")`: the same client calls a
server would receive, answered by qdrant-client's local engine instead.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest

from kb.errors import IndexBusy, KBError
from kb.settings import Settings
from kb.vectors import ClientIndex, EdgeIndex, VectorPoint, open_index, qdrant_id

ROOT = Path(__file__).resolve().parents[1]

DOCS = {
    "run:oom": ("run batch-2048 (gpt-350m) status failed; failure oom at step 40: CUDA out of memory "
                "while allocating activations", {"kind": "run", "project": "gpt-350m", "status": "failed"}),
    "run:nan": ("run lr-sweep-3e-3 (gpt-small) status diverged; the loss became NaN at step 1200 after "
                "a gradient spike", {"kind": "run", "project": "gpt-small", "status": "diverged"}),
    "run:ok": ("run baseline (gpt-small) status completed; final val/loss 3.28 after 2.5B tokens",
               {"kind": "run", "project": "gpt-small", "status": "completed"}),
    "run:moe": ("run router-z-loss (moe-1b) status completed; expert load balanced, final val/loss 2.91",
                {"kind": "run", "project": "moe-1b", "status": "completed"}),
    "note:tok": ("postmortem: the new tokenizer split numbers into single digits, which hurt arithmetic evals",
                 {"kind": "note", "project": "gpt-small"}),
    "note:nccl": ("incident: NCCL timeout on node 17, the all-reduce hung and the watchdog killed the job",
                  {"kind": "note", "project": "moe-1b"}),
}


@pytest.fixture(scope="module")
def embedder():
    from kb.embed import load_embedder
    return load_embedder("all-MiniLM-L6-v2", threads=1)


@pytest.fixture(scope="module")
def doc_vectors(embedder):
    return dict(zip(DOCS, embedder.encode([text for text, _ in DOCS.values()])))


def points(doc_vectors, version: str = "v1") -> list[VectorPoint]:
    return [VectorPoint(pid, doc_vectors[pid], {**payload, "card_hash": f"{pid}-{version}"})
            for pid, (_, payload) in DOCS.items()]


def settings_for(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home")


@pytest.fixture(params=["edge", "client"])
def index(request, tmp_path, embedder):
    """Both engines through the same protocol: the embedded default, and the server class on :memory:."""
    if request.param == "edge":
        ix = open_index(settings_for(tmp_path), embedder.dim)
        assert isinstance(ix, EdgeIndex)
    else:
        from qdrant_client import QdrantClient
        ix = ClientIndex(QdrantClient(":memory:"), "kb", embedder.dim, model=embedder.name)
    yield ix
    ix.close()


# ---- the embedding model -------------------------------------------------------------------

def test_embedder_vectors_are_normalised_deterministic_and_cached(embedder):
    from kb.embed import load_embedder
    texts = ["loss is NaN at step 1200", "a completely different sentence about tokenizers"]
    a, b = embedder.encode(texts), embedder.encode(list(reversed(texts)))[::-1]
    assert a.dtype == np.float32 and a.shape == (2, embedder.dim) == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(a[0], a[1], atol=1e-2)
    assert embedder.encode([]).shape == (0, 384)
    assert load_embedder("all-MiniLM-L6-v2", threads=1) is embedder


def test_embedder_puts_paraphrases_closer_than_unrelated_text(embedder):
    v = embedder.encode(["the run ran out of GPU memory", "CUDA out of memory error during training",
                         "the learning rate warmup lasted 2000 steps"])
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2


# ---- search, filters, delete, fingerprints (both engines) ----------------------------------

@pytest.mark.parametrize("question, expected", [
    ("which run ran out of GPU memory?", "run:oom"),
    ("training blew up and produced NaN loss", "run:nan"),
    ("collective communication hang between nodes", "note:nccl"),
    ("how did the tokenizer handle digits?", "note:tok"),
])
def test_search_returns_the_semantically_nearest_record(index, embedder, doc_vectors, question, expected):
    index.upsert(points(doc_vectors))
    hits = index.search(embedder.encode([question])[0], limit=3)
    assert hits[0].id == expected
    assert hits[0].score > hits[1].score
    assert hits[0].payload["card_hash"] == f"{expected}-v1"
    assert "point_id" not in hits[0].payload


def test_search_filters_on_payload_values_and_lists(index, embedder, doc_vectors):
    index.upsert(points(doc_vectors))
    q = embedder.encode(["training blew up and produced NaN loss"])[0]
    notes = index.search(q, limit=10, where={"kind": "note"})
    assert {h.id for h in notes} == {"note:tok", "note:nccl"}
    runs = index.search(q, limit=10, where={"kind": "run", "project": "gpt-small"})
    assert [h.id for h in runs] == ["run:nan", "run:ok"]
    bad = index.search(q, limit=10, where={"status": ["failed", "diverged"]})
    assert {h.id for h in bad} == {"run:oom", "run:nan"}
    assert index.search(q, limit=10, where={"project": "nope"}) == []


def test_delete_and_fingerprints_track_what_is_stored(index, doc_vectors):
    index.upsert(points(doc_vectors))
    assert index.count() == len(DOCS)
    assert index.fingerprints() == {pid: f"{pid}-v1" for pid in DOCS}

    index.upsert(points(doc_vectors, "v2")[:2])          # same ids: replaced, not added
    assert index.count() == len(DOCS)
    assert index.fingerprints()["run:oom"] == "run:oom-v2"

    index.delete(["run:oom", "note:tok", "run:never-existed"])
    assert index.count() == len(DOCS) - 2
    assert set(index.fingerprints()) == set(DOCS) - {"run:oom", "note:tok"}
    assert "run:oom" not in {h.id for h in index.search(doc_vectors["run:oom"], limit=10)}


def test_upsert_in_many_batches(index):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((1300, 384)).astype(np.float32)   # > 2 internal batches of 512
    index.upsert([VectorPoint(f"run:{i}", vecs[i], {"kind": "run", "card_hash": str(i)}) for i in range(1300)])
    assert index.count() == 1300
    assert len(index.fingerprints()) == 1300
    assert index.search(vecs[777], limit=1)[0].id == "run:777"


def test_point_ids_are_stable_uuid5_of_the_string_id():
    assert qdrant_id("run:abc") == qdrant_id("run:abc") != qdrant_id("run:abd")
    assert len(qdrant_id("run:abc")) == 36


# ---- the embedded shard: persistence, one process only, model changes ----------------------

def run_python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, **kw)


def test_index_survives_close_reopen_and_a_process_restart(tmp_path, embedder, doc_vectors):
    s = settings_for(tmp_path)
    ix = open_index(s, embedder.dim)
    ix.upsert(points(doc_vectors))
    ix.delete(["run:ok"])
    ix.close()

    ix = open_index(s, embedder.dim)
    assert ix.count() == len(DOCS) - 1
    assert ix.search(doc_vectors["run:nan"], limit=1)[0].id == "run:nan"
    ix.close()

    q = doc_vectors["note:nccl"].tolist()
    out = run_python(f"""
        from kb.settings import Settings
        from kb.vectors import open_index
        ix = open_index(Settings(home={str(s.home)!r}), {embedder.dim})
        print(ix.count(), ix.search({q!r}, limit=1, where={{"kind": "note"}})[0].id)
        ix.close()
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(DOCS) - 1), "note:nccl"]


def test_index_held_by_another_process_raises_index_busy(tmp_path, embedder, doc_vectors):
    s = settings_for(tmp_path)
    ix = open_index(s, embedder.dim)
    ix.upsert(points(doc_vectors))
    ix.close()

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from kb.settings import Settings
        from kb.vectors import open_index
        ix = open_index(Settings(home={str(s.home)!r}), {embedder.dim})
        print("holding", ix.count(), flush=True)
        sys.stdin.readline()
        ix.close()
    """)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split() == ["holding", str(len(DOCS))], holder.stderr.read()
        with pytest.raises(IndexBusy, match="another process"):
            open_index(s, embedder.dim)
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0

    ix = open_index(s, embedder.dim)           # released: opens again, data intact
    assert ix.count() == len(DOCS)
    ix.close()


def test_changing_the_embedding_model_rebuilds_the_embedded_index(tmp_path):
    path = tmp_path / "qdrant" / "kb"
    rng = np.random.default_rng(1)
    ix = EdgeIndex.open(path, 8, model="model-a")
    ix.upsert([VectorPoint(f"run:{i}", rng.standard_normal(8), {"card_hash": "h"}) for i in range(5)])
    ix.close()

    ix = EdgeIndex.open(path, 8, model="model-a")
    assert ix.count() == 5
    ix.close()

    # vectors of another model are meaningless: the derived index starts empty, so reconcile refills it
    ix = EdgeIndex.open(path, 16, model="model-b")
    assert ix.count() == 0
    ix.upsert([VectorPoint("run:x", rng.standard_normal(16), {"card_hash": "h"})])
    ix.close()
    ix = EdgeIndex.open(path, 16, model="model-b")
    assert ix.count() == 1
    ix.close()


def test_server_collection_of_another_model_is_refused_not_dropped():
    from qdrant_client import QdrantClient
    client = QdrantClient(":memory:")
    ix = ClientIndex(client, "kb", 8, model="model-a")
    ix.upsert([VectorPoint("run:1", np.ones(8), {"card_hash": "h"})])
    assert ClientIndex(client, "kb", 8, model="model-a").count() == 1
    with pytest.raises(KBError, match="KB_COLLECTION"):
        ClientIndex(client, "kb", 16, model="model-b")
    assert ix.count() == 1
    ix.close()


class BusyServer:
    """A Qdrant server that refuses the first `refusals` calls of each kind with `status`, then
    serves them from qdrant-client's in-memory mode: no server can run here, so its busy answers
    are simulated (and said to be), while every call that succeeds is the real client's."""

    def __init__(self, refusals: int, status: int = 503):
        from qdrant_client import QdrantClient
        self.real, self.refusals, self.status = QdrantClient(":memory:"), refusals, status
        self.refused: dict[str, int] = {}
        self.payload_indexes: list[str] = []

    def __getattr__(self, name):
        from qdrant_client.http.exceptions import UnexpectedResponse
        method = getattr(self.real, name)

        def call(*args, **kwargs):
            if self.refused.get(name, 0) < self.refusals:
                self.refused[name] = self.refused.get(name, 0) + 1
                raise UnexpectedResponse(self.status, "busy", b"{}", httpx.Headers())
            if name == "create_payload_index":
                self.payload_indexes.append(args[1])
            return method(*args, **kwargs)
        return call


def test_a_busy_server_is_retried_and_a_bad_request_is_not(monkeypatch):
    from qdrant_client.http.exceptions import UnexpectedResponse

    import kb.vectors as vectors
    monkeypatch.setattr(vectors, "RETRY_BASE_S", 0.001)
    busy = BusyServer(refusals=2)
    ix = ClientIndex(busy, "kb", 8, model="m")
    ix.upsert([VectorPoint(f"run:{i}", np.eye(8)[i], {"kind": "run", "project": "p", "ref_id": str(i)})
               for i in range(3)])
    assert ix.count() == 3 and busy.refused["upsert"] == 2
    assert sorted(busy.payload_indexes) == sorted(vectors.INDEXED_FIELDS)       # every filtered field
    assert [h.payload["ref_id"] for h in ix.search(np.eye(8)[1], limit=1, where={"project": "p"})] == ["1"]
    with pytest.raises(UnexpectedResponse):
        ClientIndex(BusyServer(refusals=1, status=400), "kb", 8, model="m")
    with pytest.raises(UnexpectedResponse):          # still busy after every retry: the error stands
        ClientIndex(BusyServer(refusals=vectors.RETRIES, status=503), "kb", 8, model="m")
