"""Dense retrieval: inner product between an encoded query and passage embeddings [N,E].

    r = DenseRetriever(embeddings, encoder)                 # exact search
    r = DenseRetriever(embeddings, encoder, kind="hnsw")    # faiss IndexHNSWFlat (inner product)
    r = DenseRetriever(embeddings, encoder, kind="ivf")     # faiss IndexIVFFlat (inner product)

Scores. Every score this module returns comes from one function, `exact_scores`: the
float32 products q_i * e_i summed strictly left to right (a cumulative sum). That is a pure
function of (query, passage), unlike a matmul, whose rounding depends on the shapes and the
backend's blocking. So `retrieve` and `retrieve_from` (RaLMSpec's cache) give a passage the
same score bit for bit, and break ties the same way (base.rank).

Exact search ("dense") finds the top-k with a device matmul (jax, f32 at HIGHEST
precision) over chunks of the corpus, keeping per query every passage whose matmul score
is within `eps` of the k-th best, then rescores those few with `exact_scores`. Both the
matmul and the sequential sum are within gamma_E * |q| * |e| of the true inner product
(gamma_E = E*u / (1 - E*u), u = 2^-24, any summation order), so a passage in the exact
top-k has a matmul score >= (k-th matmul score) - 4 * gamma_E * |q| * max|e|; we keep
twice that margin. The result is the exact top-k under `exact_scores`, not an approximation.

Approximate search ("hnsw", "ivf") asks faiss for 2k + 8 neighbours, rescores them with
`exact_scores` and keeps the best k by the same rule (so ties at the k-th place are not
faiss's arbitrary pick; with IVF probing every list the answer is the exact one).
`retrieve_from` scores candidates exactly. So a speculation cache is checked against what
the *approximate* index returns: a cached passage the index missed can outrank its answer,
the speculation then fails verification (RaLMSpec verifies with the real retriever), and
outputs stay identical to a baseline that uses the same approximate index. Search-time
knobs: `ef_search` (HNSW) and `nprobe` (IVF).

Queries are encoded one at a time and remembered (an LRU of recent queries): a batched
encoder's padding can change the last bits of an embedding with the batch's shape, and a
query must embed identically in the speculation and in the verification.

Axes here: Q queries, N corpus passages, C a chunk of the corpus, E embedding dim, k results.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .base import Retriever
from .corpus import Corpus

__all__ = ["DENSE_KINDS", "DenseRetriever", "build_faiss", "exact_scores"]

DENSE_KINDS = ("dense", "hnsw", "ivf")
HNSW_M = 32  # graph degree
HNSW_EF_CONSTRUCTION = 200
HNSW_EF_SEARCH = 128  # raised to k when k is larger
IVF_NPROBE = 32  # lists scanned per query
_U = 2.0 ** -24  # float32 unit roundoff
_ROWS = 4096  # rows per block in exact_scores (bounds its [rows,E] temporary)


def exact_scores(q, e) -> np.ndarray:
    """Inner products of paired rows, q [P,E] (or [E], broadcast) and e [P,E] -> float32 [P]:
    float32 products added left to right, so a pair's score never depends on the others."""
    e = np.asarray(e, np.float32)
    q = np.broadcast_to(np.asarray(q, np.float32), e.shape)
    out = np.empty(len(e), np.float32)
    for s in range(0, len(e), _ROWS):
        out[s:s + _ROWS] = np.cumsum(q[s:s + _ROWS] * e[s:s + _ROWS], axis=1, dtype=np.float32)[:, -1]
    return out


@jax.jit
def _chunk_scores(q, e):
    """q [Q,E], e [C,E] -> [Q,C] inner products, f32 throughout (no TF32 / bf16 passes)."""
    return jnp.einsum("QE,CE->QC", q, e, precision=jax.lax.Precision.HIGHEST)


def build_faiss(embeddings: np.ndarray, kind: str, *, progress: bool = False):
    """An inner-product faiss index over embeddings [N,E]: IndexHNSWFlat (M=32,
    efConstruction=200) or IndexIVFFlat (nlist ~ 4 sqrt(N), at least 39 training points per
    list as faiss asks; nprobe=32)."""
    import faiss
    from tqdm.auto import tqdm

    n, dim = embeddings.shape
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    elif kind == "ivf":
        nlist = max(1, min(int(round(4 * np.sqrt(n))), n // 39))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(embeddings)
        index.nprobe = min(IVF_NPROBE, nlist)
    else:
        raise ValueError(f"unknown faiss index kind {kind!r}; valid: hnsw, ivf")
    step = 4096
    for s in tqdm(range(0, n, step), desc=f"faiss {kind}", unit="chunk", disable=not progress):
        index.add(embeddings[s:s + step])
    return index


class DenseRetriever(Retriever):
    """Inner-product retrieval over passage embeddings (see module docstring)."""

    def __init__(self, embeddings, encoder: Callable, *, kind: str = "dense", index=None,
                 corpus: Optional[Corpus] = None, chunk_size: int = 32768,
                 ef_search: int = HNSW_EF_SEARCH, nprobe: int = IVF_NPROBE,
                 query_cache: int = 4096, progress: bool = False):
        if kind not in DENSE_KINDS:
            raise ValueError(f"unknown dense retriever kind {kind!r}; valid: {', '.join(DENSE_KINDS)}")
        e = np.ascontiguousarray(embeddings, dtype=np.float32)
        if e.ndim != 2 or e.shape[0] == 0 or e.shape[1] == 0:
            raise ValueError(f"embeddings must be a non-empty [N,E] array, got shape {e.shape}")
        if not np.isfinite(e).all():
            raise ValueError("embeddings contain NaN or inf")
        if corpus is not None and len(corpus) != len(e):
            raise ValueError(f"{len(e)} embeddings for a corpus of {len(corpus)} passages")
        self.kind = kind
        self.embeddings = e  # [N,E] host copy: exact rescoring
        self.encoder = encoder
        self.corpus = corpus
        self._max_norm = float(np.sqrt((e.astype(np.float64) ** 2).sum(1)).max())
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = query_cache
        self._cache_lock = threading.Lock()  # RaLMSpec may retrieve on a worker thread too
        if kind == "dense":
            self._chunk = min(chunk_size, len(e))
            self._chunks = []  # device arrays [C,E]; the last zero-padded to C rows
            for s in range(0, len(e), self._chunk):
                block = np.zeros((self._chunk, e.shape[1]), np.float32)
                block[:len(e[s:s + self._chunk])] = e[s:s + self._chunk]
                self._chunks.append(jax.device_put(block))
            self.index = None
        else:
            self.index = index if index is not None else build_faiss(e, kind, progress=progress)
            if self.index.ntotal != len(e) or self.index.d != e.shape[1]:
                raise ValueError(f"faiss index holds {self.index.ntotal} vectors of dim {self.index.d}, "
                                 f"embeddings are {e.shape}")
        self.ef_search, self.nprobe = ef_search, nprobe

    @property
    def size(self) -> int:
        return len(self.embeddings)

    @property
    def dim(self) -> int:
        return self.embeddings.shape[1]

    def warm_up(self, max_queries: int = 1) -> None:
        """Compile what a retrieval of up to `max_queries` queries runs, ahead of the first
        one (a server's warm-up): the encoder's query shapes where it has a `warm_up` (the
        built-in MiniLM: every token-length bucket) and, for the exact kind, the scoring of
        every power-of-two query count against the chunks."""
        warm = getattr(self.encoder, "warm_up", None)
        if callable(warm):
            warm(1)  # `encode` embeds one query at a time
        if self.kind == "dense":
            for q in sorted({1 << max(0, (n - 1).bit_length()) for n in range(1, max_queries + 1)}):
                _chunk_scores(np.zeros((q, self.dim), np.float32), self._chunks[0]).block_until_ready()

    def clear_query_cache(self) -> None:
        """Forget the cached query embeddings (benchmarks: no call reuses another's work)."""
        with self._cache_lock:
            self._cache.clear()

    def encode(self, queries: list) -> np.ndarray:
        """Query embeddings float32 [Q,E], each encoded alone (batch-shape invariant), cached."""
        out = np.empty((len(queries), self.dim), np.float32)
        for i, q in enumerate(queries):
            with self._cache_lock:
                v = self._cache.get(q)
                if v is not None:
                    self._cache.move_to_end(q)
            if v is None:
                v = np.asarray(self.encoder([q]), np.float32)
                if v.shape != (1, self.dim):
                    raise ValueError(f"encoder returned shape {v.shape} for one query; the index "
                                     f"holds embeddings of dim {self.dim}")
                if not np.isfinite(v).all():
                    raise ValueError(f"encoder returned NaN/inf for query {q!r}")
                v = v[0]
                with self._cache_lock:
                    self._cache[q] = v
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
            out[i] = v
        return out

    def _shortlist(self, queries: list, k: int) -> list:
        q = self.encode(queries)  # [Q,E]
        if self.kind == "dense":
            found = self._exact_candidates(q, k)
        else:
            found = self._faiss_candidates(q, k)
        return [(ids, exact_scores(q[r], self.embeddings[ids])) for r, ids in enumerate(found)]

    def _score_subset(self, queries: list, candidates: list) -> list:
        q = self.encode(queries)
        return [exact_scores(q[r], self.embeddings[c]) for r, c in enumerate(candidates)]

    def _exact_candidates(self, q: np.ndarray, k: int) -> list:
        """Per query the ids that can be in the exact top-k (module docstring: the margin)."""
        n_q, dim = q.shape
        gamma = dim * _U / (1 - dim * _U)
        eps = 8 * gamma * np.sqrt((q.astype(np.float64) ** 2).sum(1)) * self._max_norm  # [Q]
        q_pad = np.zeros((1 << max(0, (n_q - 1).bit_length()), dim), np.float32)  # Q -> pow2
        q_pad[:n_q] = q
        keep = [(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in range(n_q)]
        for c, chunk in enumerate(self._chunks):
            start = c * self._chunk
            valid = min(self._chunk, self.size - start)
            s = np.asarray(_chunk_scores(q_pad, chunk))[:n_q, :valid]  # [Q,C]
            for r in range(n_q):
                ids = np.concatenate([keep[r][0], np.arange(start, start + valid, dtype=np.int64)])
                sc = np.concatenate([keep[r][1], s[r]])
                if len(sc) > k:
                    kth = float(np.partition(sc, len(sc) - k)[len(sc) - k])
                    near = sc.astype(np.float64) >= kth - eps[r]
                    ids, sc = ids[near], sc[near]
                keep[r] = (ids, sc)
        return [ids for ids, _ in keep]

    def _faiss_candidates(self, q: np.ndarray, k: int) -> list:
        if self.kind == "hnsw":
            self.index.hnsw.efSearch = max(self.ef_search, 2 * k + 8)
        else:
            self.index.nprobe = min(self.nprobe, self.index.nlist)
        # Over-fetch, so that passages tied (or within rounding) at the k-th place are ordered
        # by the exact scores and the id rule, not by faiss's arbitrary pick among them.
        fetch = min(self.size, 2 * k + 8)
        _, found = self.index.search(q, fetch)  # [Q,fetch], -1 where the index found fewer
        return [np.unique(row[row >= 0]).astype(np.int64) for row in found]
