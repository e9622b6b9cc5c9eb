"""Keyword retrieval (BM25) over the citable chunks, beside the dense index.

Dense vectors miss exact tokens that matter here (a run id, `rmsnorm`, `nccl_timeout`, a
learning rate written `3e-4`); BM25 finds them. The index is built from SQL and saved under
the knowledge base's home with the signature of what it was built from; an open index whose
signature no longer matches SQL is rebuilt, so the first question after an ingest pays for it.

The scores are bm25s's (its default: Lucene's BM25, k1 1.5, b 0.75; a test holds them equal),
but the index is built here: each word's token ids found once a build, then one sparse matrix of
each (chunk, token)'s weight, by numpy. At 100,000 runs (209,529 chunks) that took 21.1 s
against bm25s's 37.4 s for the same chunks (`benchmarks/keyword_index.py`), most of it the
tokenizing; reading the chunks from SQL is another 11.7 s. So a build keeps every chunk's token
ids with its text's digest (`TokenRows`, saved beside the index), and the rebuild after an
ingest tokenizes only the chunks that are new or whose text changed (after 1,000 more runs:
12.7 s, against 28.0 s from scratch); every chunk is still read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from array import array
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import scipy.sparse as sp
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


K1, B = 1.5, 0.75       # bm25s's defaults (method "lucene")
EMPTY = "<empty>"        # the one token of a chunk with none: the query tokenizer never makes it


def bm25_weights(ids: np.ndarray, lengths: np.ndarray, n_tokens: int) -> sp.csc_matrix:
    """(chunk, token) -> idf(token) * tf / (tf + k1 * (1 - b + b * len / avglen)), from every
    chunk's token ids in a row (`ids`, chunk i's `lengths[i]` of them), as a chunk x token matrix
    stored by token: a query sums its tokens' columns."""
    rows = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    tf = sp.csr_matrix((np.ones(len(ids), dtype=np.float32), (rows, ids)), shape=(len(lengths), n_tokens))
    tf.sum_duplicates()
    df = np.bincount(tf.indices, minlength=n_tokens)
    idf = np.log(1 + (len(lengths) - df + 0.5) / (df + 0.5)).astype(np.float32)
    norm = (K1 * (1 - B + B * lengths / lengths.mean())).astype(np.float32)
    tf.data = tf.data / (tf.data + np.repeat(norm, np.diff(tf.indptr))) * idf[tf.indices]
    return tf.tocsc()


def _compact(ids: np.ndarray, vocab: dict[str, int]) -> tuple[np.ndarray, dict[str, int]]:
    """Ids renumbered over the tokens some chunk still holds, in their old order: a token whose
    chunks all changed or went leaves the vocabulary (what `Retriever.vocabulary` answers)."""
    held = np.bincount(ids, minlength=len(vocab)) > 0
    if held.all():
        return ids, vocab
    renumber = np.cumsum(held) - 1
    return renumber[ids].astype(np.int32), {t: int(renumber[i]) for t, i in vocab.items() if held[i]}


def digest(text: str) -> int:
    """A chunk text's 64-bit fingerprint: a build reuses the tokens of a chunk whose text has it."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@dataclass
class TokenRows:
    """Every chunk's token ids in a row (`ids`, chunk i's `lengths[i]` of them), with its key and
    its text's `digest`: what a build keeps for the next one, which tokenizes only new and
    changed chunks (a rebuild after an ingest: the tokenizing was most of it)."""
    keys: list[str]
    digests: np.ndarray      # uint64
    ids: np.ndarray          # int32
    lengths: np.ndarray      # int64

    def slices(self) -> dict[str, tuple[int, int, int]]:
        """key -> (digest, start, stop) of its ids."""
        stops = np.cumsum(self.lengths)
        return {k: (int(d), int(e - n), int(e)) for k, d, n, e in zip(self.keys, self.digests, self.lengths, stops)}


def _vocabulary(saved: dict) -> dict[str, int]:
    """token -> id of a saved index (its chunks.json lists the tokens in id order)."""
    return {t: i for i, t in enumerate(saved["vocab"])}


class SparseIndex:
    def __init__(self, weights: sp.csc_matrix | None, vocab: dict[str, int], keys: list[str], kinds: np.ndarray,
                 projects: np.ndarray, sig: str, rows: TokenRows | None = None, tokenized: int = 0):
        self.weights, self.vocab = weights, vocab
        self.keys, self.kinds, self.projects, self.signature = keys, kinds, projects, sig
        self.rows = rows                # a built index's token rows (None when loaded for queries)
        self.tokenized = tokenized      # chunks this build tokenized (the rest it reused)
        self._position = {k: i for i, k in enumerate(keys)}

    @classmethod
    def build(cls, chunks: list[Chunk], sig: str = "",
              previous: tuple[TokenRows, dict[str, int]] | None = None) -> "SparseIndex":
        """The index of `chunks`; with `previous` (an earlier build's token rows and vocabulary),
        a chunk whose key and text are unchanged keeps its tokens, and only the others are tokenized."""
        vocab: dict[str, int] = dict(previous[1]) if previous else {}
        old = previous[0].slices() if previous else {}
        old_ids = previous[0].ids if previous else None
        ids_of: dict[str, tuple[int, ...]] = {}     # a word's tokens (`_forms`) as ids, once a build
        ids, lengths, digests = array("i"), array("q"), array("Q")
        tokenized = 0
        for c in chunks:
            start = len(ids)
            d = digest(c.text)
            digests.append(d)
            was = old.get(c.key)
            if was is not None and was[0] == d:
                ids.frombytes(old_ids[was[1]:was[2]].tobytes())      # its tokens as the last build found them
            else:
                tokenized += 1
                for word in _words(c.text):
                    got = ids_of.get(word)
                    if got is None:
                        got = ids_of[word] = tuple(vocab.setdefault(t, len(vocab)) for t in _forms(word))
                    ids.extend(got)
                if len(ids) == start:
                    ids.append(vocab.setdefault(EMPTY, len(vocab)))
            lengths.append(len(ids) - start)
        ids, vocab = _compact(np.frombuffer(ids, dtype=np.int32) if len(ids) else np.zeros(0, dtype=np.int32), vocab)
        n = np.frombuffer(lengths, dtype=np.int64) if len(lengths) else np.zeros(0, dtype=np.int64)
        rows = TokenRows([c.key for c in chunks], np.frombuffer(digests, dtype=np.uint64), ids, n)
        weights = bm25_weights(ids, n, len(vocab)) if chunks else None
        return cls(weights, vocab, rows.keys, np.array([c.kind for c in chunks], dtype=object),
                   np.array([c.project for c in chunks], dtype=object), sig, rows, tokenized)

    @classmethod
    def open(cls, engine: Engine, folder: Path) -> "SparseIndex":
        """The saved index if SQL has not changed since it was built, else a fresh one (saved)."""
        sig = signature(engine)
        meta = folder / "chunks.json"
        previous = None
        if meta.exists():
            try:
                saved = json.loads(meta.read_text())
                if saved["signature"] == sig:
                    return cls._load(folder, saved)
                previous = cls._token_rows(folder, saved)
            except (OSError, ValueError, KeyError) as e:     # a torn or foreign folder: rebuild
                log.warning("keyword index at %s unreadable (%s); rebuilding", folder, e)
        index = cls.build(list(all_chunks(engine)), sig, previous)
        try:
            index.save(folder)
        except OSError as e:           # a read-only home still answers, from memory
            log.info("keyword index not saved (%s)", e)
        return index

    @classmethod
    def _load(cls, folder: Path, saved: dict) -> "SparseIndex":
        weights = sp.load_npz(folder / "weights.npz").tocsc() if saved["keys"] else None
        return cls(weights, _vocabulary(saved), saved["keys"],
                   np.array(saved["kinds"], dtype=object), np.array(saved["projects"], dtype=object),
                   saved["signature"])

    @staticmethod
    def _token_rows(folder: Path, saved: dict) -> tuple[TokenRows, dict[str, int]] | None:
        """The saved build's token rows and vocabulary, for a rebuild to reuse; None without them."""
        if not saved["keys"] or not (folder / "tokens.npz").exists():
            return None
        with np.load(folder / "tokens.npz") as t:
            rows = TokenRows(saved["keys"], t["digests"], t["ids"], t["lengths"])
            built = str(t["signature"])
        # another process may have swapped the folder between the two reads: ids of another vocabulary
        if (built != saved["signature"] or rows.ids.dtype != np.int32 or len(rows.lengths) != len(rows.keys)
                or int(rows.lengths.sum()) != len(rows.ids)):
            raise ValueError("token rows do not match the keys")
        return rows, _vocabulary(saved)

    def save(self, folder: Path) -> None:
        # written beside, then swapped in, so a reader never sees half an index
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.weights is not None:
            sp.save_npz(tmp / "weights.npz", self.weights, compressed=False)
        if self.rows is not None and self.keys:
            np.savez(tmp / "tokens.npz", digests=self.rows.digests, ids=self.rows.ids, lengths=self.rows.lengths,
                     signature=np.array(self.signature))
        (tmp / "chunks.json").write_text(json.dumps({
            "signature": self.signature, "keys": self.keys, "vocab": list(self.vocab),
            "kinds": self.kinds.tolist(), "projects": self.projects.tolist()}))
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)

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
        n = min(limit, int((scores > 0).sum()))
        if n == 0:
            return []
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(self.keys[i], float(scores[i])) for i in top]
