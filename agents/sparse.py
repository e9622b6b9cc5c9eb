"""Keyword retrieval (BM25) over the citable chunks, beside the dense index.

Dense vectors miss exact tokens that matter here (a run id, `rmsnorm`, `nccl_timeout`, a
learning rate written `3e-4`); BM25 finds them. The index is built from SQL and saved under
the knowledge base's home with the signature of what it was built from; an open index whose
signature no longer matches SQL is brought up to date, so the first question after an ingest
pays for that.

The scores are bm25s's (its default: Lucene's BM25, k1 1.5, b 0.75; a test holds them equal),
but the index is built here: each word's token ids found once a build, then one sparse matrix of
each (chunk, token)'s weight, by numpy. At 100,000 runs (209,529 chunks) that took 9.3 s
against bm25s's 21.8 s for the same chunks (`benchmarks/keyword_index.py`), most of it the
tokenizing; reading the chunks from SQL is another 6.7 s. So a build keeps each chunk's row
(agents.token_rows: its distinct token ids and their counts, its text's digest, its record's
stamp), and the rebuild after an ingest reads from SQL only the chunks whose stamp changed
(agents.corpus.chunk_stamps: ids and times, no text), tokenizes only those whose text changed,
and computes the weights again over every row (each idf and the mean length move with any chunk):
after 1,000 more runs, 3.3 s against 16.1 s from scratch and 12.3 s when every chunk was read.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import re
import shutil
import tempfile
from array import array
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from agents.corpus import Chunk, all_chunks, chunk_stamps, chunks_by_key
from agents.token_rows import TokenRows, digest
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
    for word in _words(text):
        out.extend(_forms(word))
    return out


def _words(text: str) -> list[str]:
    """What `tokens` cuts a text into, before each word's forms (`_forms`)."""
    return _TOKEN.findall(text.lower())


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


# what float() reads of a token (`_TOKEN`'s letters, a digit first): tested first, as a failed
# float() raises, and most tokens that start with a digit are names (`350m-lr0.001-b32`)
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?")


def _number(tok: str) -> str | None:
    if not (tok[0].isdigit() or tok[0] == ".") or not _NUMBER.fullmatch(tok):
        return None
    return f"{float(tok):.6g}"


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


EMPTY = "<empty>"        # the one token of a chunk with none: the query tokenizer never makes it


def _format() -> str:
    try:
        return version("pretrain-kb")
    except PackageNotFoundError:
        return ""


# a chunk's text comes from the code that renders it as well as from its record, and its tokens
# from the tokenizer's code, so saved rows are trusted only within one release: the first
# rebuild after an upgrade reads and tokenizes every chunk again
FORMAT = _format()


def tokenize(chunks: list[Chunk], vocab: dict[str, int], reuse: TokenRows | None = None) -> tuple[TokenRows, int]:
    """The chunks' rows (ids from `vocab`, new tokens added to it) and how many were tokenized: a
    chunk whose key and text `reuse` holds keeps the row found then (those rows come first)."""
    digests = [digest(c.text) for c in chunks]
    same = np.zeros(len(reuse.keys) if reuse is not None else 0, dtype=bool)
    wanted = {c.key for c in chunks} if reuse is not None else set()
    at = {k: i for i, k in enumerate(reuse.keys) if k in wanted} if reuse is not None else {}
    fresh: list[int] = []
    for j, c in enumerate(chunks):
        i = at.get(c.key)
        if i is not None and int(reuse.digests[i]) == digests[j]:
            same[i] = True
        else:
            fresh.append(j)
    ids_of: dict[str, tuple[int, ...]] = {}     # a word's tokens (`_forms`) as ids, once a build
    tokens_, sizes = array("i"), array("q")
    for j in fresh:
        start = len(tokens_)
        for word in _words(chunks[j].text):
            got = ids_of.get(word)
            if got is None:
                got = ids_of[word] = tuple(vocab.setdefault(t, len(vocab)) for t in _forms(word))
            tokens_.extend(got)
        if len(tokens_) == start:
            tokens_.append(vocab.setdefault(EMPTY, len(vocab)))
        sizes.append(len(tokens_) - start)
    new = TokenRows.of_tokens([chunks[j].key for j in fresh], [chunks[j].kind for j in fresh],
                              [chunks[j].project for j in fresh], [digests[j] for j in fresh],
                              np.frombuffer(tokens_, dtype=np.int32), np.frombuffer(sizes, dtype=np.int64))
    if reuse is None:
        return new, len(fresh)
    kept = reuse.take(same)
    by_key = {c.key: c for c in chunks}
    kept.projects = [by_key[k].project for k in kept.keys]     # a note can move with its text unchanged
    return kept + new, len(fresh)


def _vocabulary(saved: dict) -> dict[str, int]:
    """token -> id of a saved index (its chunks.json lists the tokens in id order)."""
    return {t: i for i, t in enumerate(saved["vocab"])}


@dataclass
class Previous:
    """What the last build saved, for the next to reuse: its rows and vocabulary."""
    rows: TokenRows
    vocab: dict[str, int]
    format: str          # the release that wrote them (`FORMAT`)

    @classmethod
    def load(cls, folder: Path, saved: dict) -> "Previous | None":
        """The build saved in `folder` (`saved` its chunks.json); None without its rows (an
        empty index, or one saved before rows were kept)."""
        if not saved["keys"] or not (folder / "tokens.npz").exists():
            return None
        with np.load(folder / "tokens.npz") as t:
            if "counts" not in t.files:
                return None
            stamps = [s.decode() for s in t["stamps"].tolist()] if "stamps" in t.files else None
            rows = TokenRows(saved["keys"], saved["kinds"], saved["projects"], t["digests"], t["ids"], t["counts"],
                             t["lengths"], stamps)
            built = str(t["signature"])
        # another process may have swapped the folder between the two reads: ids of another vocabulary
        n = len(rows.keys)
        if (built != saved["signature"] or rows.ids.dtype != np.int32 or len(rows.ids) != len(rows.counts)
                or not len(rows.lengths) == len(rows.digests) == len(rows.kinds) == len(rows.projects) == n
                or int(rows.lengths.sum()) != len(rows.ids) or (stamps is not None and len(stamps) != n)):
            raise ValueError("token rows do not match the keys")
        return cls(rows, _vocabulary(saved), saved.get("format", ""))


class SparseIndex:
    def __init__(self, weights: sp.csc_matrix | None, vocab: dict[str, int], keys: list[str], kinds: np.ndarray,
                 projects: np.ndarray, sig: str, rows: TokenRows | None = None, tokenized: int = 0, read: int = 0):
        self.weights, self.vocab = weights, vocab
        self.keys, self.kinds, self.projects, self.signature = keys, kinds, projects, sig
        self.rows = rows                # a built index's rows (None when loaded for queries)
        self.tokenized = tokenized      # chunks this build tokenized (the rest it reused)
        self.read = read                # chunks this build read from SQL (the rest it kept)
        self._position = {k: i for i, k in enumerate(keys)}

    @classmethod
    def build(cls, chunks: list[Chunk], sig: str = "", previous: Previous | None = None,
              stamps: dict[str, str] | None = None) -> "SparseIndex":
        """The index of `chunks`; with `previous` (an earlier build), a chunk whose key and text
        are unchanged keeps its row, and only the others are tokenized. `stamps` (key -> stamp,
        read before the chunks) are kept for the next rebuild (`update`)."""
        vocab = dict(previous.vocab) if previous else {}
        rows, tokenized = tokenize(chunks, vocab, previous.rows if previous else None)
        rows.stamps = None if stamps is None else [stamps.get(k, "") for k in rows.keys]
        return cls._of(rows, vocab, sig, tokenized, len(chunks))

    @classmethod
    def update(cls, previous: Previous, stamps: dict[str, str], engine: Engine, sig: str = "") -> "SparseIndex":
        """`previous` brought up to what SQL holds: the chunks whose stamp changed are read and
        tokenized, the others keep their rows, and those SQL no longer holds go. `stamps` is
        `chunk_stamps(engine)`, read before."""
        old = previous.rows
        was = dict(zip(old.keys, old.stamps))
        changed = [k for k, t in stamps.items() if t != was.get(k)]
        keep = np.fromiter((stamps.get(k) == t for k, t in zip(old.keys, old.stamps)), dtype=bool,
                           count=len(old.keys))
        fresh = list(chunks_by_key(engine, changed).values())
        vocab = dict(previous.vocab)
        rows, tokenized = tokenize(fresh, vocab, old)
        rows.stamps = [stamps[k] for k in rows.keys]
        return cls._of(old.take(keep) + rows, vocab, sig, tokenized, len(fresh))

    @classmethod
    def _of(cls, rows: TokenRows, vocab: dict[str, int], sig: str, tokenized: int, read: int) -> "SparseIndex":
        vocab = rows.compact(vocab)
        weights = rows.weights(len(vocab)) if rows.keys else None
        return cls(weights, vocab, rows.keys, np.array(rows.kinds, dtype=object),
                   np.array(rows.projects, dtype=object), sig, rows, tokenized, read)

    @classmethod
    def open(cls, engine: Engine, folder: Path) -> "SparseIndex":
        """The saved index if SQL has not changed since it was built, else the saved one updated
        (`update`), or a fresh one where nothing usable was saved; saved in either case."""
        sig = signature(engine)
        meta = folder / "chunks.json"
        previous = None
        if meta.exists():
            try:
                saved = json.loads(meta.read_text())
                if saved["signature"] == sig:
                    return cls._load(folder, saved)
                previous = Previous.load(folder, saved)
            except (OSError, ValueError, KeyError) as e:     # a torn or foreign folder: rebuild
                log.warning("keyword index at %s unreadable (%s); rebuilding", folder, e)
        stamps = chunk_stamps(engine)
        if previous is not None and previous.format != FORMAT:
            previous = None          # another release's rows: its texts and tokens may differ
        if previous is not None and previous.rows.stamps is not None:
            index = cls.update(previous, stamps, engine, sig)
        else:
            index = cls.build(list(all_chunks(engine)), sig, previous, stamps)
        try:
            index.save(folder)
        except OSError as e:           # a read-only home still answers, from memory
            log.info("keyword index not saved (%s)", e)
        return index

    @classmethod
    def _load(cls, folder: Path, saved: dict) -> "SparseIndex":
        weights = sp.load_npz(folder / "weights.npz").tocsc() if saved["keys"] else None
        # another process may have swapped the folder between the two reads
        if weights is not None and weights.shape != (len(saved["keys"]), len(saved["vocab"])):
            raise ValueError("weights do not match the keys")
        return cls(weights, _vocabulary(saved), saved["keys"],
                   np.array(saved["kinds"], dtype=object), np.array(saved["projects"], dtype=object),
                   saved["signature"])

    def save(self, folder: Path) -> None:
        # written beside, then swapped in, so a reader never sees half an index; beside under a
        # name of its own, as replicas of `kb serve` sharing a home save at the same time (one
        # shared name let one's files land in the other's folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        try:
            self._write(tmp)
            old = Path(tempfile.mkdtemp(prefix=folder.name + ".old-", dir=folder.parent))
            try:
                if folder.exists():
                    folder.rename(old / "index")
                tmp.rename(folder)          # fails if another save swapped its own in meanwhile: that one stays
            finally:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _write(self, tmp: Path) -> None:
        if self.weights is not None:
            sp.save_npz(tmp / "weights.npz", self.weights, compressed=False)
        if self.rows is not None and self.keys:
            extra = {} if self.rows.stamps is None else {"stamps": np.array(self.rows.stamps, dtype=np.bytes_)}
            np.savez(tmp / "tokens.npz", digests=self.rows.digests, ids=self.rows.ids, counts=self.rows.counts,
                     lengths=self.rows.lengths, signature=np.array(self.signature), **extra)
        (tmp / "chunks.json").write_text(json.dumps({
            "signature": self.signature, "format": FORMAT, "keys": self.keys, "vocab": list(self.vocab),
            "kinds": self.kinds.tolist(), "projects": self.projects.tolist()}))

    def scores(self, query: list[str]) -> np.ndarray:
        """Each chunk's BM25 score for the query's tokens (a repeated token counts each time)."""
        cols = [self.vocab[t] for t in query if t in self.vocab]
        w = self.weights
        if w is None or not cols:
            return np.zeros(len(self.keys), dtype=np.float32)
        spans = [slice(w.indptr[c], w.indptr[c + 1]) for c in cols]
        return np.bincount(np.concatenate([w.indices[s] for s in spans]),
                           weights=np.concatenate([w.data[s] for s in spans]),
                           minlength=len(self.keys)).astype(np.float32)

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
        scores = self.scores(query) * mask
        positive = scores[scores > 0]
        n = min(limit, len(positive))
        if n == 0:
            return []
        # the n-th best score, among the positive ones only: a partition of every chunk's score,
        # mostly equal zeros, was the slowest step of a search (tens of ms at 100,000 runs)
        cut = -np.partition(-positive, n - 1)[n - 1]
        above = np.flatnonzero(scores > cut).tolist()
        # ties go by key, not by position: a rebuild that kept some rows and appended others
        # answers as a build from scratch does
        tied = heapq.nsmallest(n - len(above), np.flatnonzero(scores == cut).tolist(), key=self.keys.__getitem__)
        top = sorted(above + tied, key=lambda i: (-scores[i], self.keys[i]))
        return [(self.keys[i], float(scores[i])) for i in top]
