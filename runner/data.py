"""Training data for the proxy runner: token shards, named sources, a mixture over them.

    write_shard(path, tokens)                    # the nanoGPT / modded-nanogpt .bin format
    sources = load_sources({"web": "data/web_*.bin"}, cache_dir)   # + the built-in prose, code
    batches = MixtureBatches(sources, {"web": 0.7, "code": 0.3}, seq_len=256, seed=0)
    x, y = batches.train_batch(step, batch_size)  # the same batch for the same (seed, step)
    for x, y in batches.val_batches("web", n_batches, batch_size): ...

A source spec `builtin:prose` names a built-in one (what a run's config records for it, so a
stored config trains again as it is). A shard is a header of 256 int32 (magic 20240520, version 1, token count) followed by the
tokens as uint16. A source is a path, a glob or a list of them, or {"train": ..., "val": ...}; a
shard whose file name says `val` is validation data, and a source with none holds out the last
VAL_FRACTION of each shard. The built-in corpus needs no download: `prose` is the docstrings
and .txt files of the Python standard library, `code` its .py source, as bytes (vocab 256);
files are split into train and validation by a hash of their path, the same split for both
sources, so no text is trained on in one and validated on in the other.

Batches are a pure function of (seed, step), so a run resumed from a checkpoint sees exactly
the batches the uninterrupted run would have; validation windows are evenly spaced over each
source's validation tokens and the same for every run and seed.
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kb.errors import InvalidRecord

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
VAL_FRACTION = 0.1
BUILTIN = ("prose", "code")
BYTE_VOCAB = 256
CODE_BYTES = 8 * 2**20          # the code source stops here; prose takes every docstring (about 2 MB)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ---- shards -------------------------------------------------------------------------------------

def write_shard(path: str | Path, tokens) -> Path:
    """Write tokens (ints below 65536) as a .bin shard, atomically (tmp file, then rename)."""
    path = Path(path)
    toks = np.asarray(tokens)
    if toks.size and (toks.min() < 0 or toks.max() >= 2**16):
        raise ValueError("a .bin shard holds tokens 0..65535 (uint16)")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, toks.size)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.astype(np.uint16).tobytes())
    os.replace(tmp, path)
    return path


def read_shard(path: str | Path) -> np.ndarray:
    """A shard's tokens, memory-mapped (uint16). InvalidRecord naming the file for a bad header
    or a size that disagrees with it."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise InvalidRecord(f"{size} bytes is shorter than the {HEADER_BYTES}-byte header", source=str(path))
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise InvalidRecord(f"magic number {header[0]} is not {MAGIC}: not a .bin token shard", source=str(path))
    if header[1] != VERSION:
        raise InvalidRecord(f"shard version {header[1]}; only version {VERSION} is read", source=str(path))
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise InvalidRecord(f"the header says {count} tokens but the file holds {(size - HEADER_BYTES) / 2:g}",
                            source=str(path))
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))


# ---- sources ------------------------------------------------------------------------------------

@dataclass
class Source:
    name: str
    train: list[np.ndarray]
    val: list[np.ndarray]
    origin: str | list | dict         # what the run's config records, read back as the same source:
                                      # builtin:<name>, or the shards' absolute paths
    files: list[str] = field(default_factory=list)

    def tokens(self, split: str) -> int:
        return sum(len(a) for a in getattr(self, split))

    def max_token(self) -> int:
        return max(int(a.max()) for a in self.train + self.val if len(a))


def _paths(spec, name: str) -> list[Path]:
    specs = spec if isinstance(spec, (list, tuple)) else [spec]
    out: list[Path] = []
    for s in specs:
        if not isinstance(s, (str, os.PathLike)):
            raise InvalidRecord(f"{s!r} is not a path or glob", field=f"data.sources.{name}")
        s = os.path.expanduser(str(s))
        found = sorted(glob.glob(s)) if glob.has_magic(s) else [s]
        if os.path.isdir(s):
            found = sorted(glob.glob(os.path.join(s, "*.bin")))
        if not found or not all(os.path.isfile(p) for p in found):
            raise InvalidRecord(f"no .bin shard at {s}", field=f"data.sources.{name}")
        out.extend(Path(p) for p in found)
    return out


def _tail_split(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    train, val = [], []
    for a in arrays:
        cut = int(len(a) * (1 - VAL_FRACTION))
        train.append(a[:cut])
        val.append(a[cut:])
    return train, val


def user_source(name: str, spec) -> Source:
    """A source from shard paths: {"train": ..., "val": ...}, or paths whose `val` files validate."""
    if isinstance(spec, dict):
        unknown = set(spec) - {"train", "val"}
        if unknown or "train" not in spec:
            raise InvalidRecord("a source given as an object names `train` (and optionally `val`) shards",
                                field=f"data.sources.{name}")
        train_paths = _paths(spec["train"], name)
        val_paths = _paths(spec["val"], name) if spec.get("val") else []
    else:
        paths = _paths(spec, name)
        val_paths = [p for p in paths if "val" in p.name.lower()]
        train_paths = [p for p in paths if p not in val_paths]
    if not train_paths:
        raise InvalidRecord("no training shard (every file's name says val)", field=f"data.sources.{name}")
    train = [read_shard(p) for p in train_paths]
    val = [read_shard(p) for p in val_paths]
    if not val:
        train, val = _tail_split(train)
    files = [str(p.resolve()) for p in train_paths + val_paths]
    if isinstance(spec, dict):
        origin = {"train": [str(p.resolve()) for p in train_paths], "val": [str(p.resolve()) for p in val_paths]}
    else:
        origin = files[0] if len(files) == 1 else files
    return Source(name, train, val, origin=origin, files=files)


# ---- the built-in corpus ------------------------------------------------------------------------

def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py and .txt files (no tests, no installed packages), in an order
    fixed by a hash of each relative path: a shuffle that is the same on every machine."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith((".py", ".txt")))
    return sorted(found, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).digest())


def is_val_file(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 10 == 0          # VAL_FRACTION of the files, by path


def docstrings(source: bytes) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):       # a deliberately broken file among the stdlib's (lib2to3 data)
        return []
    nodes = (n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return [d for n in nodes if (d := ast.get_docstring(n))]


def build_builtin(folder: Path) -> None:
    """Write prose_{train,val}.bin and code_{train,val}.bin from the standard library into folder."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = {(s, split): [] for s in BUILTIN for split in ("train", "val")}
    code_bytes = 0
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        split = "val" if is_val_file(rel) else "train"
        raw = path.read_bytes()
        if path.suffix == ".txt":
            parts["prose", split].append(raw)
            continue
        parts["prose", split].extend(d.encode("utf-8", "replace") for d in docstrings(raw))
        if code_bytes < CODE_BYTES:
            parts["code", split].append(raw)
            code_bytes += len(raw)
    folder.mkdir(parents=True, exist_ok=True)
    for (source, split), chunks in parts.items():
        # documents joined by a blank line, the separator both domains already use
        data = np.frombuffer(b"\n\n".join(chunks), dtype=np.uint8)
        write_shard(folder / f"{source}_{split}.bin", data)


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "pretrain-kb-corpus"


def builtin_folder(cache_dir: Path) -> Path:
    """The built-in corpus's shards, built on first use (a few seconds) and kept under cache_dir;
    named by the Python version, whose standard library it is."""
    tag = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-v1"
    folder = Path(cache_dir) / tag
    if not all((folder / f"{s}_{split}.bin").exists() for s in BUILTIN for split in ("train", "val")):
        build_builtin(folder)
    return folder


def builtin_source(name: str, cache_dir: Path) -> Source:
    folder = builtin_folder(cache_dir)
    files = [folder / f"{name}_train.bin", folder / f"{name}_val.bin"]
    return Source(name, [read_shard(files[0])], [read_shard(files[1])], origin=f"builtin:{name}",
                  files=[str(f) for f in files])


def load_sources(specs: dict, cache_dir: Path, names: list[str]) -> dict[str, Source]:
    """The named sources: user shards from specs, the built-in corpus for `prose` and `code`."""
    out = {}
    for name in names:
        spec = specs.get(name)
        if isinstance(spec, str) and spec.startswith("builtin:") and spec[len("builtin:"):] in BUILTIN:
            out[name] = builtin_source(spec[len("builtin:"):], cache_dir)
            out[name].name = name
        elif name in specs:
            out[name] = user_source(name, spec)
        elif name in BUILTIN:
            out[name] = builtin_source(name, cache_dir)
        else:
            raise InvalidRecord(f"unknown source {name!r}; data.sources names {sorted(specs)}, "
                                f"built in: {list(BUILTIN)}", field=f"data.mixture.{name}")
    return out


# ---- batches ------------------------------------------------------------------------------------

class MixtureBatches:
    """Training batches drawn from sources by mixture weight; validation windows per source."""

    def __init__(self, sources: dict[str, Source], weights: dict[str, float], seq_len: int, seed: int):
        self.sources = sources
        self.names = list(sources)
        self.weights = np.array([weights.get(n, 0.0) for n in self.names], dtype=np.float64)
        self.seq_len = seq_len
        self.seed = seed
        for s in sources.values():
            for split in ("train", "val"):
                if not any(len(a) > seq_len for a in getattr(s, split)):
                    raise InvalidRecord(f"source {s.name!r} has no {split} shard longer than seq_len "
                                        f"{seq_len} tokens", field=f"data.sources.{s.name}")

    def _window(self, arrays: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
        spans = np.array([max(len(a) - self.seq_len - 1, 0) for a in arrays], dtype=np.float64)
        i = int(rng.choice(len(arrays), p=spans / spans.sum())) if len(arrays) > 1 else 0
        start = int(rng.integers(0, int(spans[i]) + 1))
        return np.asarray(arrays[i][start:start + self.seq_len + 1], dtype=np.int64)

    def draw(self, step: int, batch_size: int) -> tuple[list[str], torch.Tensor]:
        """The sources picked and the (batch, seq_len + 1) windows of step `step`."""
        rng = np.random.default_rng([self.seed, step])
        picks = rng.choice(len(self.names), size=batch_size, p=self.weights)
        rows = [self._window(self.sources[self.names[k]].train, rng) for k in picks]
        return [self.names[k] for k in picks], torch.from_numpy(np.stack(rows))

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, w = self.draw(step, batch_size)
        return w[:, :-1], w[:, 1:]

    def val_batches(self, name: str, n_batches: int, batch_size: int):
        """n_batches batches of windows spaced evenly over the source's validation tokens."""
        arrays = [a for a in self.sources[name].val if len(a) > self.seq_len]
        total = n_batches * batch_size
        per = [total * len(a) // sum(map(len, arrays)) for a in arrays]
        per[-1] += total - sum(per)
        rows = []
        for a, count in zip(arrays, per):
            starts = np.linspace(0, len(a) - self.seq_len - 1, num=count).astype(np.int64)
            rows.extend(np.asarray(a[s:s + self.seq_len + 1], dtype=np.int64) for s in starts)
        windows = torch.from_numpy(np.stack(rows))
        for b in range(n_batches):
            w = windows[b * batch_size:(b + 1) * batch_size]
            yield w[:, :-1], w[:, 1:]
