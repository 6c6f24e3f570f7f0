"""Sparse retrieval: BM25 via `bm25s`, English stopwords and the Snowball stemmer (`PyStemmer`).

Scoring is bm25s's default ("lucene"), with k1 = 1.5, b = 0.75:

    score(q, d) = sum over query tokens t (repeats counted) of
                  idf(t) * tf(t,d) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)      = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

bm25s precomputes every (term, document) summand in float32 into a CSC matrix [N, V]
(`index.scores`: data, indices = document, indptr per term; documents ascending within a
term). A query's scores are then float32 sums of those summands, one term after another,
in query order. Full retrieval adds each term's column into a dense [N] array; the subset
path looks the candidates up in each column (binary search) and adds in the same order, so
a candidate's score is the full index's, bit for bit, whatever the other candidates are.
A query with no indexed token scores 0 everywhere (ties: lowest positions first).

Host-only module: no jax.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from .base import Retriever
from .corpus import Corpus

__all__ = ["BM25Retriever"]

STOPWORDS = "en"  # bm25s's English stopword list
STEMMER = "english"  # PyStemmer's Snowball English stemmer


def _bm25s():
    """Import bm25s, whose logger is set to DEBUG at import: with any root handler (jax's
    absl adds one) every index() call would print debug lines."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


def _stemmer(language: str):
    import Stemmer  # PyStemmer

    return Stemmer.Stemmer(language)


class BM25Retriever(Retriever):
    """BM25 over a Corpus (see module docstring). Build with `build`, persist with
    `save`/`load` (bm25s's own files plus `bm25.json` with our tokenizer settings)."""

    kind = "bm25"

    def __init__(self, index, corpus: Optional[Corpus] = None, *, stopwords: str = STOPWORDS,
                 stemmer: str = STEMMER):
        self.index = index  # a bm25s.BM25 with its scores and vocab_dict
        self.corpus = corpus
        self.stopwords = stopwords
        self.stemmer_language = stemmer
        self._local = threading.local()  # a stemmer per thread (RaLMSpec verifies on a worker thread)
        s = index.scores
        self._data = np.asarray(s["data"], np.float32)  # [nnz] summands
        self._docs = np.asarray(s["indices"], np.int64)  # [nnz] document per summand
        self._indptr = np.asarray(s["indptr"], np.int64)  # [V+1]
        self._n = int(s["num_docs"])
        self._sort_columns()
        if corpus is not None and len(corpus) != self._n:
            raise ValueError(f"BM25 index has {self._n} documents, corpus has {len(corpus)}")

    def _sort_columns(self) -> None:
        """The subset path binary-searches each column: make sure documents ascend within
        every column (bm25s builds them so; an index from elsewhere might not be)."""
        term = np.repeat(np.arange(len(self._indptr) - 1), np.diff(self._indptr))  # [nnz]
        step = np.diff(self._docs)
        if np.all((step > 0) | (np.diff(term) != 0)):
            return
        order = np.lexsort((self._docs, term))
        self._docs, self._data = self._docs[order], self._data[order]

    @classmethod
    def build(cls, corpus: Corpus, *, k1: float = 1.5, b: float = 0.75, progress: bool = True,
              stopwords: str = STOPWORDS, stemmer: str = STEMMER) -> "BM25Retriever":
        bm25s = _bm25s()

        tokens = bm25s.tokenize(corpus.all_contents(), stopwords=stopwords, stemmer=_stemmer(stemmer),
                                show_progress=progress)
        index = bm25s.BM25(k1=k1, b=b, method="lucene")
        index.index(tokens, show_progress=progress)
        return cls(index, corpus, stopwords=stopwords, stemmer=stemmer)

    def save(self, path) -> None:
        path = Path(path)
        self.index.save(str(path), show_progress=False)
        (path / "bm25.json").write_text(json.dumps(
            {"stopwords": self.stopwords, "stemmer": self.stemmer_language,
             "k1": self.index.k1, "b": self.index.b, "method": self.index.method}))

    @classmethod
    def load(cls, path, corpus: Optional[Corpus] = None) -> "BM25Retriever":
        bm25s = _bm25s()

        path = Path(path)
        settings = json.loads((path / "bm25.json").read_text())
        index = bm25s.BM25.load(str(path), show_progress=False)
        return cls(index, corpus, stopwords=settings["stopwords"], stemmer=settings["stemmer"])

    @property
    def size(self) -> int:
        return self._n

    @property
    def params(self) -> dict:
        return {"k1": self.index.k1, "b": self.index.b, "method": self.index.method,
                "stopwords": self.stopwords, "stemmer": self.stemmer_language}

    def query_terms(self, queries: list) -> list:
        """Per query the vocabulary ids of its tokens, in order, repeats kept, unknown dropped
        (what bm25s's own `get_scores` sums over)."""
        bm25s = _bm25s()

        if not queries:
            return []
        stemmer = getattr(self._local, "stemmer", None)
        if stemmer is None:
            stemmer = self._local.stemmer = _stemmer(self.stemmer_language)
        tokens = bm25s.tokenize(queries, stopwords=self.stopwords, stemmer=stemmer,
                                return_ids=False, show_progress=False)
        vocab = self.index.vocab_dict
        return [[vocab[t] for t in toks if t in vocab] for toks in tokens]

    def _shortlist(self, queries: list, k: int) -> list:
        out, all_ids = [], np.arange(self._n, dtype=np.int64)
        for terms in self.query_terms(queries):
            acc = np.zeros(self._n, np.float32)  # [N]
            for t in terms:
                lo, hi = self._indptr[t], self._indptr[t + 1]
                acc[self._docs[lo:hi]] += self._data[lo:hi]  # a column holds a document once
            out.append((all_ids, acc))
        return out

    def _score_subset(self, queries: list, candidates: list) -> list:
        out = []
        for terms, cand in zip(self.query_terms(queries), candidates):
            acc = np.zeros(len(cand), np.float32)  # [M]
            for t in terms:
                lo, hi = self._indptr[t], self._indptr[t + 1]
                col = self._docs[lo:hi]  # ascending document positions containing t
                pos = np.minimum(np.searchsorted(col, cand), max(len(col) - 1, 0))
                hit = col[pos] == cand if len(col) else np.zeros(len(cand), bool)
                acc[hit] += self._data[lo:hi][pos[hit]]
            out.append(acc)
        return out
