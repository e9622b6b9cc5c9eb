"""The ONNX embedding backends against the torch one: the real MiniLM from the wheel, real exports
(into a temporary cache), real onnxruntime and OpenVINO. Only a missing runtime is simulated."""
from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from kb.cards import run_card
from kb.embed import load_embedder
from kb.onnx_embed import FP32_FILE, INT8_FILE, export_folder, load_onnx_embedder
from kb.settings import Settings

MODEL = "all-MiniLM-L6-v2"
QUERIES = ["runs that diverged with a NaN loss", "out of memory on the moe model",
           "rmsnorm at learning rate 3e-4", "baseline runs with 12 layers", "loss spike in train/loss",
           "preempted by the scheduler", "web+code data mixture", "lowest validation loss"]


def real_cards() -> list[str]:
    """Run cards as the indexer writes them, of varied lengths, plus a text past the 256-token cut."""
    cards = []
    for i in range(40):
        lr = (1e-4, 3e-4, 1e-3, 3e-3)[i % 4]
        status = ("completed", "diverged", "failed", "killed")[i % 4]
        run = {"id": f"r{i:03d}", "name": f"{('lr-sweep', 'ablate-norm', 'baseline')[i % 3]}-{i}",
               "project": ("gpt-small", "moe-1b", "long-ctx")[i % 3], "status": status,
               "config": {"model": {"n_layer": 4 + i % 9, "d_model": 256 * (1 + i % 4),
                                    "norm": ("layernorm", "rmsnorm")[i % 2]},
                          "optim": {"lr": lr, "warmup": 100 * (1 + i % 5)},
                          "data": {"mix": ("web", "web+code")[i % 2], "batch_size": 128 << (i % 3)}},
               "scale": {"params": 1e8 * (1 + i), "tokens": 1e9 * (1 + i % 7), "flops": None},
               "summary": {"val/loss": 2.6 + (i * 0.037) % 1.5, "train/loss": 2.5 + (i * 0.041) % 1.5},
               "tags": ["baseline"] if i % 5 == 0 else [], "notes": "short note " * (i % 4)}
        failures = {"diverged": [{"kind": "diverged", "step": 100 * i, "message": "loss is NaN"}],
                    "failed": [{"kind": "oom", "step": 50 * i, "message": "CUDA out of memory"}]}.get(status, [])
        cards.append(run_card(run, failures, []))
    return cards + ["x", "lr " * 400]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One export for the module: (cache dir, how many times the exporter loaded the model)."""
    root = tmp_path_factory.mktemp("xdg") / "pretrain-kb" / "onnx"
    exports = []

    def load_st():
        exports.append(1)
        return load_embedder(MODEL, threads=1).model     # the torch backend's model, already loaded

    from kb.embed import model_location
    load_onnx_embedder(MODEL, model_location(MODEL), quantized=True, cache_dir=root, load_st=load_st)
    return root, exports


@pytest.fixture(scope="module")
def torch_vectors():
    e = load_embedder(MODEL, threads=1, backend="torch")
    return e.encode(real_cards()), e.encode(QUERIES)


def overlap_at(k: int, cards_a, queries_a, cards_b, queries_b) -> float:
    top = lambda c, q: np.argsort(-(q @ c.T), axis=1)[:, :k]  # noqa: E731
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top(cards_a, queries_a), top(cards_b, queries_b))]))


@pytest.mark.slow
def test_onnx_gives_the_torch_vectors_on_real_cards(cache, torch_vectors):
    cards, queries = torch_vectors
    e = load_embedder(MODEL, threads=1, backend="onnx", cache_dir=str(cache[0]))
    assert e.backend == "onnx" and e.dim == 384
    got = e.encode(real_cards(), batch_size=16)
    assert got.dtype == np.float32 and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert np.min(np.sum(got * cards, axis=1)) >= 0.999
    # one text at a time (no padding) and a long one cut at 256 tokens agree too
    alone = np.stack([e.encode([t], batch_size=1)[0] for t in real_cards()[-3:]])
    assert np.min(np.sum(alone * cards[-3:], axis=1)) >= 0.999
    assert overlap_at(5, got, e.encode(QUERIES), cards, queries) == 1.0
    assert e.encode([]).shape == (0, 384)


@pytest.mark.slow
def test_int8_stays_close_to_torch_and_finds_the_same_cards(cache, torch_vectors):
    cards, queries = torch_vectors
    e = load_embedder(MODEL, threads=1, backend="onnx-int8", cache_dir=str(cache[0]))
    assert e.backend == "onnx-int8"
    got, got_q = e.encode(real_cards()), e.encode(QUERIES)
    cos = np.sum(got * cards, axis=1)
    # int8 GEMM kernels differ by CPU (VNNI or AVX2's u8s8 path): the worst card measured 0.979 on
    # the CI machine and 0.985 here; the ranking checks below are what retrieval depends on
    assert cos.min() >= 0.97 and cos.mean() >= 0.985
    assert overlap_at(5, got, got_q, cards, queries) >= 0.7            # an index built by int8
    assert overlap_at(5, cards, got_q, cards, queries) >= 0.8          # a torch-built index, int8 queries


@pytest.mark.slow
def test_openvino_gives_the_torch_vectors_from_the_same_export(cache, torch_vectors):
    cards, queries = torch_vectors
    e = load_embedder(MODEL, threads=1, backend="openvino", cache_dir=str(cache[0]))
    assert e.backend == "openvino" and e.dim == 384
    got = e.encode(real_cards(), batch_size=16)
    assert got.dtype == np.float32 and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert np.min(np.sum(got * cards, axis=1)) >= 0.999
    alone = np.stack([e.encode([t], batch_size=1)[0] for t in real_cards()[-3:]])
    assert np.min(np.sum(alone * cards[-3:], axis=1)) >= 0.999
    assert overlap_at(5, got, e.encode(QUERIES), cards, queries) == 1.0
    assert e.encode([]).shape == (0, 384)
    assert cache[1] == [1]                        # compiled from the module's export, not a new one


@pytest.mark.slow
def test_openvino_bf16_stays_within_rounding_of_torch(cache, torch_vectors):
    cards, queries = torch_vectors
    e = load_embedder(MODEL, threads=1, backend="openvino-bf16", cache_dir=str(cache[0]))
    assert e.backend == "openvino-bf16"
    got, got_q = e.encode(real_cards()), e.encode(QUERIES)
    # bfloat16 keeps 8 bits of mantissa; the sums stay in f32 (a CPU without bf16 computes in f32)
    assert np.min(np.sum(got * cards, axis=1)) >= 0.999
    assert overlap_at(5, got, got_q, cards, queries) >= 0.9


def test_missing_openvino_falls_back_to_torch_with_a_warning(monkeypatch, caplog, tmp_path):
    # simulated: openvino is installed here; None in sys.modules makes its import fail
    monkeypatch.setitem(sys.modules, "openvino", None)
    with caplog.at_level(logging.WARNING, logger="kb.embed"):
        e = load_embedder(MODEL, threads=1, backend="openvino", cache_dir=str(tmp_path))
    assert e.backend == "torch"
    assert any("openvino" in r.getMessage() and "torch" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_export_is_made_once_and_reused(cache):
    root, exports = cache
    assert exports == [1]
    from kb.embed import model_location
    folder = export_folder(MODEL, model_location(MODEL), root)
    stamps = {f: (folder / f).stat().st_mtime_ns for f in (FP32_FILE, INT8_FILE)}

    def no_export():
        raise AssertionError("exported again")

    for quantized in (False, True):
        e = load_onnx_embedder(MODEL, model_location(MODEL), quantized=quantized, cache_dir=root, load_st=no_export)
        assert e.encode(["lr 3e-4 diverged"]).shape == (1, 384)
    assert {f: (folder / f).stat().st_mtime_ns for f in stamps} == stamps
    assert [p.name for p in root.iterdir()] == [folder.name]      # no temporary folder left behind


def test_missing_onnxruntime_falls_back_to_torch_with_a_warning(monkeypatch, caplog, tmp_path):
    # simulated: onnxruntime is installed here; None in sys.modules makes its import fail
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level(logging.WARNING, logger="kb.embed"):
        e = load_embedder(MODEL, threads=1, backend="onnx-int8", cache_dir=str(tmp_path))
    assert e.backend == "torch"
    assert any("onnxruntime" in r.getMessage() and "torch" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.iterdir())          # nothing exported


def test_the_backend_is_a_setting(monkeypatch):
    monkeypatch.setenv("KB_EMBEDDING_BACKEND", "onnx-int8")
    assert Settings().embedding_backend == "onnx-int8"
    monkeypatch.setenv("KB_EMBEDDING_BACKEND", "openvino")
    assert Settings().embedding_backend == "openvino"
    monkeypatch.setenv("KB_EMBEDDING_BACKEND", "tensorrt")
    with pytest.raises(ValueError):
        Settings()
    with pytest.raises(ValueError, match="unknown embedding backend"):
        load_embedder(MODEL, backend="tensorrt")


@pytest.mark.slow
def test_the_knowledge_base_embeds_with_the_configured_backend(cache, tmp_path, monkeypatch):
    from kb.api import KnowledgeBase
    # the default cache dir, pointed at the module's export so nothing is exported into $HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache[0].parent.parent))
    k = KnowledgeBase.open(Settings(home=tmp_path / "home", embedding_backend="onnx-int8"))
    try:
        assert k.embedder.backend == "onnx-int8"
    finally:
        k.close()
    assert cache[1] == [1]


@pytest.mark.slow
def test_openvino_answers_threads_at_once_as_one_at_a_time(cache):
    from concurrent.futures import ThreadPoolExecutor
    e = load_embedder(MODEL, threads=1, backend="openvino", cache_dir=str(cache[0]))
    texts = real_cards()[:24]
    alone = [e.encode([t])[0] for t in texts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda t: e.encode([t])[0], texts))
    assert all(np.allclose(a, b, atol=1e-6) for a, b in zip(alone, together))
