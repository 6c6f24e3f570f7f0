"""The retriever interface: batched top-k over a whole corpus, and over a given subset of it.

    ids, scores = r.retrieve(queries, k)                    # np.int64 [Q,k], np.float32 [Q,k]
    ids, scores = r.retrieve_from(queries, candidates, k)   # candidates[q]: corpus positions
    scores = r.score(queries, candidates)                   # list of np.float32 [len(candidates[q])]

`retrieve_from` is RaLMSpec's speculation cache: it ranks only the documents cached for a
query, with exactly the scores the full index gives them, and both paths order results the
same way: higher score first, then the lower corpus position (`rank`). So whenever the full
index's top-1 is among the candidates, `retrieve_from` returns that same document with the
same score, bit for bit. A subclass supplies two scorers and nothing else ranks:

    _shortlist(queries, k) -> per query (ids, scores): every document that can be in the
                              top-k (all of them, or a provable superset), exact scores
    _score_subset(queries, candidates) -> per query exact scores of the given ids

Rows with fewer than k candidates are padded with INVALID = -1 ids and -inf scores.

Axes here: Q queries, N corpus passages, M candidates of one query, k results.
Host-only module: no jax.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .corpus import Corpus

__all__ = ["INVALID", "Retriever", "rank"]

INVALID = -1  # id of a padding result (score -inf)


def rank(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple:
    """Top-k of one query's candidates: higher score first, ties to the lower id; padded.

    ids int64 [M] (distinct), scores float32 [M] -> (ids [k], scores [k]).
    # ids [7, 2, 5, 9], scores [1., 3., 3., 0.5], k=3 -> ids [2, 5, 7], scores [3., 3., 1.]
    """
    if len(ids) > k:
        # Every id scoring at least the k-th largest score (ties at the boundary included),
        # then an exact sort of those few: argpartition alone would cut ties arbitrarily.
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        keep = scores >= kth
        ids, scores = ids[keep], scores[keep]
    order = np.lexsort((ids, -scores))[:k]  # last key is primary: -score, then id
    out_ids = np.full(k, INVALID, np.int64)
    out_scores = np.full(k, -np.inf, np.float32)
    out_ids[:len(order)] = ids[order]
    out_scores[:len(order)] = scores[order]
    return out_ids, out_scores


class Retriever:
    """Base class: validation and ranking shared by every retriever (see module docstring)."""

    kind: str = "?"
    corpus: Optional[Corpus] = None  # the passages, when the retriever was built from a Corpus

    @property
    def size(self) -> int:
        """N, the number of passages indexed."""
        raise NotImplementedError

    # --- to implement -----------------------------------------------------------------------

    def _shortlist(self, queries: list, k: int) -> list:
        raise NotImplementedError

    def _score_subset(self, queries: list, candidates: list) -> list:
        raise NotImplementedError

    # --- public API -------------------------------------------------------------------------

    def retrieve(self, queries: Sequence[str], k: int) -> tuple:
        """Top-k corpus positions and scores per query: (np.int64 [Q,k], np.float32 [Q,k])."""
        queries = self._check_queries(queries)
        self._check_k(k)
        rows = [rank(np.asarray(i, np.int64), np.asarray(s, np.float32), k)
                for i, s in self._shortlist(queries, k)]
        return _stack(rows, len(queries), k)

    def score(self, queries: Sequence[str], candidates: Sequence) -> list:
        """Scores of the given corpus positions per query, exactly as the full index scores
        them: a list of np.float32 [len(candidates[q])] (duplicates and order kept)."""
        queries = self._check_queries(queries)
        candidates = self._check_candidates(candidates, len(queries))
        return [np.asarray(s, np.float32) for s in self._score_subset(queries, candidates)]

    def retrieve_from(self, queries: Sequence[str], candidates: Sequence, k: int) -> tuple:
        """`retrieve` restricted to candidates[q] (corpus positions; duplicates ignored): the
        same scores and the same order as `retrieve` gives those documents. Rows with fewer
        than k distinct candidates are padded with INVALID ids and -inf scores."""
        queries = self._check_queries(queries)
        self._check_k(k)
        candidates = [np.unique(c) for c in self._check_candidates(candidates, len(queries))]
        scores = self._score_subset(queries, candidates)
        rows = [rank(c, np.asarray(s, np.float32), k) for c, s in zip(candidates, scores)]
        return _stack(rows, len(queries), k)

    # --- checks -----------------------------------------------------------------------------

    def _check_queries(self, queries) -> list:
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, not one string: use [query]")
        queries = list(queries)
        bad = [i for i, q in enumerate(queries) if not isinstance(q, str)]
        if bad:
            raise TypeError(f"queries must be strings; query {bad[0]} is "
                            f"{type(queries[bad[0]]).__name__}")
        return queries

    def _check_k(self, k) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= self.size:
            raise ValueError(f"k must be an integer in 1..{self.size} (the corpus size), got {k!r}")

    def _check_candidates(self, candidates, n_queries: int) -> list:
        candidates = list(candidates)
        if len(candidates) != n_queries:
            raise ValueError(f"got {len(candidates)} candidate lists for {n_queries} queries")
        out = []
        for q, c in enumerate(candidates):
            c = np.asarray(c)
            if c.size == 0:
                out.append(np.zeros(0, np.int64))
                continue
            if c.ndim != 1 or not np.issubdtype(c.dtype, np.integer):
                raise ValueError(f"candidates[{q}] must be a 1-D array of integer corpus positions, "
                                 f"got dtype {c.dtype} shape {c.shape}")
            if c.min() < 0 or c.max() >= self.size:
                raise ValueError(f"candidates[{q}] holds positions outside 0..{self.size - 1}: "
                                 f"min {c.min()}, max {c.max()}")
            out.append(c.astype(np.int64))
        return out


def _stack(rows: list, n_queries: int, k: int) -> tuple:
    if not rows:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
