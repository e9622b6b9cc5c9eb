"""Keyword retrieval (BM25, by bm25s) over the citable chunks, beside the dense index.

Dense vectors miss exact tokens that matter here (a run id, `rmsnorm`, `nccl_timeout`, a
learning rate written `3e-4`); BM25 finds them. The index is built from SQL and saved under
the knowledge base's home with the signature of what it was built from; an open index whose
signature no longer matches SQL is rebuilt (bm25s has no incremental add, and a rebuild of
100,000 chunks takes seconds, against milliseconds per query).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from agents.corpus import Chunk, all_chunks
from kb.models import Ablation, Failure, Note, Run

log = logging.getLogger(__name__)

_TOKEN = re.compile(r"[a-z0-9]+(?:[._/+-][a-z0-9]+)*")
_STOP = frozenset("""a an and are as at be by did do does for from had has have how i in is it its
of on or run runs that the their there these this to was were what when where which who why
with we our you""".split())


def tokens(text: str) -> list[str]:
    """Lower-cased words; a compound (`val/loss`, `base-lr0.001`) also yields its parts, and a
    number its one canonical spelling, so `3e-4` and `0.0003` are the same token."""
    out: list[str] = []
    for tok in _TOKEN.findall(text.lower()):
        out.extend(_forms(tok))
    return out


@lru_cache(maxsize=1 << 17)
def _forms(tok: str) -> tuple[str, ...]:
    # cached: run cards repeat the same keys and values, and the keyword index tokenizes every
    # chunk on a rebuild (209,529 chunks at 100,000 runs)
    number = _number(tok)
    if number is not None:
        return (number,)
    out = [] if tok in _STOP else [_stem(tok)]
    parts = re.split(r"[._/+-]", tok)
    if len(parts) > 1:
        out.extend(p for p in parts if p and p not in _STOP and _number(p) is None)
    return tuple(out)


def _stem(tok: str) -> str:
    """A light suffix strip (diverged, diverges, diverging -> diverg): enough for the few
    inflections questions and records disagree on, without a stemmer dependency."""
    if not tok.isalpha() or len(tok) <= 4:
        return tok
    for suffix in ("ing", "ed", "es", "s"):
        if tok.endswith(suffix) and len(tok) - len(suffix) >= 4:
            tok = tok[: -len(suffix)]
            break
    return tok[:-1] if tok.endswith("e") and len(tok) > 4 else tok


def _number(tok: str) -> str | None:
    if not (tok[0].isdigit() or tok[0] == "."):
        return None
    try:
        value = float(tok)
    except ValueError:
        return None
    return f"{value:.6g}"


# words every question here uses: a match on these alone is no evidence of the topic
GENERIC = frozenset(tokens(
    "run runs model models training train trained val validation eval loss losses learning rate lr "
    "best worst lowest highest better worse mean average compare gave give get got result results "
    "experiment experiments know learn learned about tell me show list any all many much "
    "step steps final value values param params token tokens size batch config configuration "
    "team we our us happen happened change changed effect effects"))


def signature(engine: Engine) -> str:
    """What the chunks were built from, cheaply: counts and newest writes of each table."""
    parts = []
    with Session(engine) as s:
        for model, newest in ((Run, Run.ingested_at), (Note, Note.ingested_at),
                              (Ablation, Ablation.ingested_at), (Failure, Failure.id)):
            n, top = s.execute(select(func.count(), func.max(newest)).select_from(model)).one()
            parts.append(f"{n}:{top}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


class SparseIndex:
    def __init__(self, model, keys: list[str], kinds: np.ndarray, projects: np.ndarray, sig: str):
        self.model, self.keys, self.kinds, self.projects, self.signature = model, keys, kinds, projects, sig
        self._position = {k: i for i, k in enumerate(keys)}

    @classmethod
    def build(cls, chunks: list[Chunk], sig: str = "") -> "SparseIndex":
        import bm25s
        model = bm25s.BM25()
        if chunks:
            model.index([tokens(c.text) or ["<empty>"] for c in chunks], show_progress=False)
        return cls(model, [c.key for c in chunks], np.array([c.kind for c in chunks], dtype=object),
                   np.array([c.project for c in chunks], dtype=object), sig)

    @classmethod
    def open(cls, engine: Engine, folder: Path) -> "SparseIndex":
        """The saved index if SQL has not changed since it was built, else a fresh one (saved)."""
        sig = signature(engine)
        meta = folder / "chunks.json"
        if meta.exists():
            try:
                saved = json.loads(meta.read_text())
                if saved["signature"] == sig:
                    return cls._load(folder, saved)
            except (OSError, ValueError, KeyError) as e:     # a torn or foreign folder: rebuild
                log.warning("keyword index at %s unreadable (%s); rebuilding", folder, e)
        index = cls.build(list(all_chunks(engine)), sig)
        try:
            index.save(folder)
        except OSError as e:           # a read-only home still answers, from memory
            log.info("keyword index not saved (%s)", e)
        return index

    @classmethod
    def _load(cls, folder: Path, saved: dict) -> "SparseIndex":
        import bm25s
        model = bm25s.BM25.load(str(folder / "bm25")) if saved["keys"] else bm25s.BM25()
        return cls(model, saved["keys"], np.array(saved["kinds"], dtype=object),
                   np.array(saved["projects"], dtype=object), saved["signature"])

    def save(self, folder: Path) -> None:
        # written beside, then swapped in, so a reader never sees half an index
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.keys:
            self.model.save(str(tmp / "bm25"))
        (tmp / "chunks.json").write_text(json.dumps({
            "signature": self.signature, "keys": self.keys,
            "kinds": self.kinds.tolist(), "projects": self.projects.tolist()}))
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)

    def search(self, text: str, limit: int = 20, *, kinds: set[str] | None = None,
               project: str | None = None, keys: set[str] | None = None) -> list[tuple[str, float]]:
        """(chunk key, BM25 score) best first; only chunks with a positive score."""
        query = tokens(text)
        if not self.keys or not query:
            return []
        mask = np.ones(len(self.keys), dtype=np.float32)
        if kinds:
            mask *= np.isin(self.kinds, list(kinds))
        if project:
            mask *= self.projects == project
        if keys is not None:
            allowed = np.zeros(len(self.keys), dtype=np.float32)
            allowed[[self._position[k] for k in keys if k in self._position]] = 1
            mask *= allowed
        scores = self.model.get_scores(query, weight_mask=mask)
        n = min(limit, int((scores > 0).sum()))
        if n == 0:
            return []
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(self.keys[i], float(scores[i])) for i in top]
