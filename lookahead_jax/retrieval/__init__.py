"""Retrieval for RaLMSpec: batched top-k over a passage corpus, and over a cached subset of it.

    from lookahead_jax.retrieval import load_retriever
    # after `python -m lookahead_jax.retrieval build --corpus passages.jsonl --retriever bm25`:
    r = load_retriever("bm25", "passages.jsonl")
    ids, scores = r.retrieve(queries, k)                     # np.int64 [Q,k], np.float32 [Q,k]
    ids, scores = r.retrieve_from(queries, cached_ids, k)    # same scores, same order, subset only
    r.corpus[ids[0, 0]].text

`corpus.py` passages from JSON Lines; `base.py` the Retriever interface and the one ranking
rule (score desc, then position asc); `bm25.py` BM25 (bm25s + PyStemmer); `dense.py` exact
inner product (jax matmul, exact rescoring) and faiss HNSW / IVF; `encoders.py` encoders by
name; `store.py` the on-disk cache; `remote.py` / `server.py` a retriever in another process
(`python -m lookahead_jax.retrieval serve`, `RemoteRetriever("HOST:PORT")`); `cli.py` the
command line.
"""

from .base import INVALID, Retriever, rank
from .corpus import Corpus, CorpusError, Passage, load_corpus
from .encoders import DEFAULT_ENCODER, EncoderUnavailable, get_encoder, register_encoder
from .remote import RemoteRetrievalError, RemoteRetriever
from .store import (
    KINDS, IndexNotBuilt, IndexUnavailable, StaleIndex, UnknownRetriever, build_index, cache_root,
    index_dir, is_built, load_retriever,
)


def __getattr__(name):  # the retriever classes pull in bm25s / jax / faiss only when asked for
    if name == "BM25Retriever":
        from .bm25 import BM25Retriever

        return BM25Retriever
    if name in ("DenseRetriever", "exact_scores", "build_faiss"):
        from . import dense

        return getattr(dense, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INVALID", "KINDS", "BM25Retriever", "Corpus", "CorpusError", "DEFAULT_ENCODER",
    "DenseRetriever", "EncoderUnavailable", "IndexNotBuilt", "IndexUnavailable", "Passage",
    "RemoteRetrievalError", "RemoteRetriever", "Retriever", "StaleIndex", "UnknownRetriever", "build_index", "cache_root", "exact_scores",
    "get_encoder", "index_dir", "is_built", "load_corpus", "load_retriever", "rank",
    "register_encoder",
]
