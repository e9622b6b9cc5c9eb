"""The embedding model run by onnxruntime: exported once from the sentence-transformers model,
then loaded without torch or sentence-transformers (whose import alone costs ~7 s).

    from kb.onnx_embed import load_onnx_embedder
    e = load_onnx_embedder("all-MiniLM-L6-v2", "/path/to/model/folder", quantized=True)
    e.encode(["run lr-sweep-3e-4 diverged at step 1200"]).shape   # (1, 384)

The whole sentence-transformers pipeline (transformer, pooling, normalisation) is traced into one
graph, so the fp32 export gives the torch backend's vectors (cosine ~1) and an index built by
either serves the other. The int8 file is a dynamic per-channel quantisation of that graph: about
2x faster on CPU, vectors at cosine ~0.99 (benchmarks/embed_speed.py measures recall).
OpenVINO compiles the same fp32 file (no second export): in f32 it gives torch's vectors ~2x
faster; `bf16` computes in bfloat16 where the CPU has it (AVX-512 BF16, AMX), f32 elsewhere.

Exports live under the user cache dir (site-packages may be read-only), one folder per model
fingerprint; a folder is written under a temporary name and renamed, so two processes exporting
at once both end with a whole export.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# bump when the exported graph or the meta file changes shape: older exports are then redone
EXPORT_VERSION = 1
FP32_FILE, INT8_FILE, META_FILE = "model.onnx", "model_int8.onnx", "meta.json"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrain-kb" / "onnx"


def export_folder(model: str, location: str, cache_dir: Path | None = None) -> Path:
    """Where this model's export lives: named by the model and a fingerprint of its files, so a
    changed model (another wheel version, a retrained folder) gets a fresh export."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    digest = hashlib.sha256(f"v{EXPORT_VERSION}\0{model}\0{location}".encode())
    folder = Path(location)
    if folder.is_dir():
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            st = f.stat()
            digest.update(f"\0{f.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[-60:]
    return root / f"{slug}-{digest.hexdigest()[:16]}"


def export_onnx(st, target: Path) -> None:
    """Trace a loaded SentenceTransformer into `target`: model.onnx, tokenizer.json, meta.json."""
    import torch

    probe = st.tokenizer(["a short text", "a somewhat longer text, so the batch is padded"],
                         padding=True, return_tensors="pt")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in probe]

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.st = st

        def forward(self, *inputs):
            return self.st(dict(zip(names, inputs)))["sentence_embedding"]

    target.mkdir(parents=True, exist_ok=True)
    axes = {n: {0: "batch", 1: "tokens"} for n in names} | {"sentence_embedding": {0: "batch"}}
    with torch.no_grad(), warnings.catch_warnings():
        # the tracer warns on the models' shape checks (mask length == token count), true for every
        # batch; tests/test_embed_backends.py checks padded, unpadded and truncated batches
        warnings.simplefilter("ignore")
        # the TorchScript exporter: no onnxscript needed, and it handles BERT-style models whole
        torch.onnx.export(SentenceEmbedding().eval(), tuple(probe[n] for n in names), str(target / FP32_FILE),
                          input_names=names, output_names=["sentence_embedding"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    st.tokenizer.save_pretrained(str(target / "tokenizer"))
    tokenizer_json = target / "tokenizer" / "tokenizer.json"
    if not tokenizer_json.exists():
        raise RuntimeError(f"{st.tokenizer.__class__.__name__} has no fast tokenizer to export")
    shutil.move(str(tokenizer_json), target / "tokenizer.json")
    shutil.rmtree(target / "tokenizer", ignore_errors=True)
    tok = st.tokenizer
    meta = {"export_version": EXPORT_VERSION, "inputs": names, "dim": int(st.get_embedding_dimension()),
            "max_seq_length": int(st.max_seq_length), "pad_id": int(tok.pad_token_id or 0),
            "pad_token": tok.pad_token or "[PAD]"}
    (target / META_FILE).write_text(json.dumps(meta, indent=1))


def quantize_int8(fp32: Path, int8: Path) -> None:
    """Dynamic int8, per output channel: per-tensor scales put MiniLM's vectors at cosine ~0.92
    to torch's, per-channel at ~0.99 (measured over run cards)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = int8.with_name(f".{int8.name}.{os.getpid()}.tmp")
    quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8, per_channel=True)
    os.replace(tmp, int8)


def ensure_export(model: str, location: str, quantized: bool, cache_dir: Path | None = None,
                  load_st=None) -> Path:
    """The export's folder, exporting (and quantising) only what is not there yet.
    `load_st()` gives the SentenceTransformer to trace; it is called only when exporting."""
    folder = export_folder(model, location, cache_dir)
    if not (folder / META_FILE).exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        tmp.chmod(0o755)     # mkdtemp makes it private; the export is no secret
        try:
            log.info("exporting embedding model %s to ONNX in %s (once)", model, folder)
            export_onnx(load_st(), tmp)
            try:
                tmp.rename(folder)
            except OSError:        # another process renamed its export first: use that one
                if not (folder / META_FILE).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if quantized and not (folder / INT8_FILE).exists():
        log.info("quantizing embedding model %s to int8 in %s (once)", model, folder)
        quantize_int8(folder / FP32_FILE, folder / INT8_FILE)
    return folder


class OnnxEmbedder:
    """Same interface as kb.embed.Embedder: encode() gives L2-normalised float32 rows."""

    def __init__(self, folder: Path, name: str, quantized: bool, threads: int = 1):
        import onnxruntime as ort

        self._tokenizer_from(folder, name)
        self.backend = "onnx-int8" if quantized else "onnx"
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(folder / (INT8_FILE if quantized else FP32_FILE)),
                                            options, providers=["CPUExecutionProvider"])

    def _run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, feed)[0]

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # longest first, as sentence-transformers does: batches of like lengths pad little
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            encoded = self.tokenizer.encode_batch([texts[i] for i in rows])
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            feed = {"input_ids": ids,
                    "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
                    "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64)}
            out[rows] = self._run({n: feed[n] for n in self.inputs})
        # the graph normalises already; again here because int8 rounding leaves norms at ~1 +- 1e-3
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def _tokenizer_from(self, folder: Path, name: str) -> None:
        from tokenizers import Tokenizer

        meta = json.loads((folder / META_FILE).read_text())
        self.name, self.dim, self.inputs = name, int(meta["dim"]), list(meta["inputs"])
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(int(meta["max_seq_length"]))
        self.tokenizer.enable_padding(pad_id=int(meta["pad_id"]), pad_token=meta["pad_token"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.backend}, dim={self.dim})"


class OpenVinoEmbedder(OnnxEmbedder):
    """The fp32 export compiled by OpenVINO for the CPU: `precision` "f32" (torch's vectors) or
    "bf16" (bfloat16 arithmetic where the CPU has it)."""

    def __init__(self, folder: Path, name: str, precision: str = "f32", threads: int = 1):
        import openvino as ov

        self._tokenizer_from(folder, name)
        self.backend = "openvino" if precision == "f32" else f"openvino-{precision}"
        compiled = ov.Core().compile_model(str(folder / FP32_FILE), "CPU", {
            "INFERENCE_NUM_THREADS": max(1, threads), "INFERENCE_PRECISION_HINT": precision,
            # one request at a time, as the caller asks: no throughput streams holding cores
            "PERFORMANCE_HINT": "LATENCY"})
        self._request = compiled.create_infer_request()
        self._output = compiled.output(0)
        # one request, and kb serve embeds questions from several threads: a request is not
        # safe to run twice at once (onnxruntime's session.run is)
        self._lock = threading.Lock()

    def _run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        with self._lock:
            # copied out: the request reuses its output buffer on the next call
            return np.array(self._request.infer(feed)[self._output], dtype=np.float32)


def load_onnx_embedder(model: str, location: str, quantized: bool, threads: int = 1,
                       cache_dir: Path | None = None, load_st=None) -> OnnxEmbedder:
    folder = ensure_export(model, location, quantized, cache_dir, load_st)
    return OnnxEmbedder(folder, model, quantized, threads)


def load_openvino_embedder(model: str, location: str, precision: str = "f32", threads: int = 1,
                           cache_dir: Path | None = None, load_st=None) -> OpenVinoEmbedder:
    folder = ensure_export(model, location, False, cache_dir, load_st)
    return OpenVinoEmbedder(folder, model, precision, threads)
