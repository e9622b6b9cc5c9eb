"""The keyword index's chunks as it keeps them from one build to the next, and their BM25 weights.

Each chunk is a row of the chunk x token count matrix: its distinct token ids in ascending order
with how often it holds each, beside its key, kind, project, its text's digest and its record's
stamp (agents.corpus.chunk_stamps). Kept counted and sorted, a rebuild joins the rows it keeps
and the few it tokenized into the matrix as they are: the sort a matrix built from every
chunk's raw tokens needs (scipy's `sum_duplicates`) was about 40% of the weights' cost at
100,000 runs in a profile, paid again after every ingest.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

K1, B = 1.5, 0.75       # bm25s's defaults (method "lucene")


def digest(text: str) -> int:
    """A chunk text's 64-bit fingerprint: a build reuses the tokens of a chunk whose text has it."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@dataclass
class TokenRows:
    keys: list[str]
    kinds: list[str]
    projects: list[str]
    digests: np.ndarray      # uint64, a chunk's text's `digest`
    ids: np.ndarray          # int32, each chunk's distinct token ids, ascending, chunk after chunk
    counts: np.ndarray       # int32, how often the chunk holds each
    lengths: np.ndarray      # int64, how many distinct tokens each chunk holds (its span of `ids`)
    stamps: list[str] | None = None      # None: unknown (saved by an older release), so every chunk is read

    @classmethod
    def of_tokens(cls, keys: list[str], kinds: list[str], projects: list[str], digests: list[int],
                  tokens: np.ndarray, sizes: np.ndarray) -> "TokenRows":
        """Rows of chunks given as token ids in a row (`tokens`, chunk i's `sizes[i]` of them)."""
        n = len(keys)
        m = sp.csr_matrix((np.ones(len(tokens), dtype=np.int32), (np.repeat(np.arange(n), sizes), tokens)),
                          shape=(n, int(tokens.max()) + 1 if len(tokens) else 0))
        m.sum_duplicates()           # each row's ids sorted, a repeated one counted
        return cls(keys, kinds, projects, np.array(digests, dtype=np.uint64), m.indices.astype(np.int32),
                   m.data.astype(np.int32), np.diff(m.indptr).astype(np.int64))

    def starts(self) -> np.ndarray:
        """Where each chunk's span of `ids` starts, and (last) where the last one ends."""
        return np.concatenate([[0], np.cumsum(self.lengths)])

    def take(self, keep: np.ndarray) -> "TokenRows":
        """The rows `keep` (a mask) marks, in their order."""
        pick = keep.tolist()
        def listed(values):
            return [v for v, kept in zip(values, pick) if kept]
        spans = np.repeat(keep, self.lengths)
        return TokenRows(listed(self.keys), listed(self.kinds), listed(self.projects), self.digests[keep],
                         self.ids[spans], self.counts[spans], self.lengths[keep],
                         None if self.stamps is None else listed(self.stamps))

    def __add__(self, other: "TokenRows") -> "TokenRows":
        return TokenRows(self.keys + other.keys, self.kinds + other.kinds, self.projects + other.projects,
                         np.concatenate([self.digests, other.digests]), np.concatenate([self.ids, other.ids]),
                         np.concatenate([self.counts, other.counts]), np.concatenate([self.lengths, other.lengths]),
                         None if self.stamps is None or other.stamps is None else self.stamps + other.stamps)

    def compact(self, vocab: dict[str, int]) -> dict[str, int]:
        """Renumber the ids over the tokens some chunk still holds, in their old order, and return
        that vocabulary: a token whose chunks all changed or went leaves it (what
        `Retriever.vocabulary` answers). `vocab` lists the tokens in id order."""
        held = np.bincount(self.ids, minlength=len(vocab)) > 0
        if held.all():
            return vocab
        renumber = (np.cumsum(held) - 1).astype(np.int32)
        self.ids = renumber[self.ids]         # ascending stays ascending
        tokens = [t for t, h in zip(vocab, held.tolist()) if h]
        return dict(zip(tokens, range(len(tokens))))

    def weights(self, n_tokens: int) -> sp.csc_matrix:
        """(chunk, token) -> idf(token) * tf / (tf + k1 * (1 - b + b * len / avglen)), as a chunk x
        token matrix stored by token: a query sums its tokens' columns."""
        n = len(self.keys)
        starts = self.starts()
        sizes = np.add.reduceat(self.counts.astype(np.int64), starts[:-1])      # every chunk holds a token
        df = np.bincount(self.ids, minlength=n_tokens)
        idf = np.log(1 + (n - df + 0.5) / (df + 0.5)).astype(np.float32)
        norm = (K1 * (1 - B + B * sizes / sizes.mean())).astype(np.float32)
        tf = self.counts.astype(np.float32)
        data = tf / (tf + np.repeat(norm, self.lengths)) * idf[self.ids]
        return sp.csr_matrix((data, self.ids, starts), shape=(n, n_tokens)).tocsc()
