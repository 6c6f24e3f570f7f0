"""Retrieval (lookahead_jax.retrieval): BM25 against a numpy reference, exact dense against brute
force, `retrieve_from` (RaLMSpec's cache) scoring and ranking exactly as full retrieval, the
tie rule, faiss HNSW/IVF, the on-disk cache (round trip, stale and missing indexes) and the
CLI. Small corpora made here, a toy hashed bag-of-words encoder; never the real corpus or
encoder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from lookahead_jax import retrieval as R
from lookahead_jax.retrieval import (
    INVALID, Corpus, CorpusError, EncoderUnavailable, IndexNotBuilt, StaleIndex, UnknownRetriever,
    rank,
)

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("cat cats dog dogs running runs runner river rivers bank banks money paris france "
         "capital city king queen castle music play played player game games water sea ocean "
         "ship ships train trains station mountain snow winter summer sun moon star").split()
DIM = 48


def toy_encode(texts) -> np.ndarray:
    """Hashed bag of words, L2-normalised: deterministic, shape [Q, DIM]."""
    out = np.zeros((len(texts), DIM), np.float32)
    for i, t in enumerate(texts):
        for w in re.findall(r"\w+", t.lower()):
            out[i, zlib.crc32(w.encode()) % DIM] += 1.0
        n = np.linalg.norm(out[i])
        if n:
            out[i] /= n
    return out


R.register_encoder("toy", lambda: toy_encode, replace=True)
R.register_encoder("toy-b", lambda: (lambda texts: toy_encode([t + " b" for t in texts])),
                   replace=True)


def make_passages(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 30))))
        p = {"id": f"p{i}", "text": text}
        if i % 3 == 0:
            p["title"] = str(rng.choice(WORDS)).title()
        out.append(p)
    return out


QUERIES = ["cat running by the river", "capital city of france", "the king played music",
           "ships at sea in winter", "snow on the mountain", "money in the bank",
           "zzz unknown words only"]


def write_jsonl(path: Path, passages) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in passages))
    return path


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_passages(make_passages(120))


@pytest.fixture(scope="module")
def bm25(corpus):
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    return R.BM25Retriever.build(corpus, progress=False)


@pytest.fixture(scope="module")
def dense(corpus):
    return R.DenseRetriever(toy_encode(corpus.all_contents()), toy_encode, corpus=corpus)


def subsets_with_top1(ids_top1, n, seed=1, size=20):
    """Per query a shuffled random subset of 0..n-1 that contains that query's top-1."""
    rng = np.random.default_rng(seed)
    out = []
    for t in ids_top1:
        c = rng.choice(n, size=size, replace=False)
        out.append(rng.permutation(np.unique(np.append(c, t))))
    return out


def check_subset_agrees(r, queries, k=5):
    """retrieve_from == full ranking restricted to the subset; top-1 and its score identical."""
    n = r.size
    ids, scores = r.retrieve(queries, k)
    full = r.score(queries, [np.arange(n)] * len(queries))  # every document's score
    cands = subsets_with_top1(ids[:, 0], n)
    sub_ids, sub_scores = r.retrieve_from(queries, cands, k)
    for q in range(len(queries)):
        assert sub_ids[q, 0] == ids[q, 0]
        assert sub_scores[q, 0] == scores[q, 0]  # bit for bit, not approximately
        np.testing.assert_array_equal(full[q][ids[q]], scores[q])
        # the subset's ranking is the full ranking (score desc, id asc) restricted to it
        order = np.lexsort((np.arange(n), -full[q]))
        expect = [i for i in order if i in set(cands[q].tolist())][:k]
        np.testing.assert_array_equal(sub_ids[q], expect)
        np.testing.assert_array_equal(sub_scores[q], full[q][expect])


# --------------------------------------------------------------------------------------- corpus


def test_corpus_jsonl_roundtrip_and_fingerprint(tmp_path):
    ps = make_passages(5)
    f = write_jsonl(tmp_path / "c.jsonl", ps)
    c = Corpus.from_jsonl(f)
    assert len(c) == 5 and c[1].id == "p1" and c[1].text == ps[1]["text"]
    assert c[0].title == ps[0]["title"] and c.contents(0) == f"{ps[0]['title']}\n{ps[0]['text']}"
    assert c.contents(1) == ps[1]["text"]  # no title: the text alone
    assert c.source == f.resolve()
    import hashlib

    assert c.fingerprint == hashlib.sha256(f.read_bytes()).hexdigest()
    with open(f, "a") as fh:
        fh.write("\n")  # blank lines are skipped, but the bytes (and so the key) changed
    c2 = Corpus.from_jsonl(f)
    assert len(c2) == 5 and c2.fingerprint != c.fingerprint


@pytest.mark.parametrize("line, needle", [
    ('{"id": "x", "text": ', "not valid JSON"),
    ('["x", "y"]', "expected a JSON object"),
    ('{"id": "x"}', "missing field(s) text"),
    ('{"id": "x", "text": 3}', '"text" must be a string'),
    ('{"id": "p0", "text": "again"}', "duplicate passage id 'p0'"),
])
def test_corpus_bad_line_names_it(tmp_path, line, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "p0", "text": "fine"}\n\n' + line + "\n")
    with pytest.raises(CorpusError) as e:
        Corpus.from_jsonl(f)
    assert f"{f}:3" in str(e.value) and needle in str(e.value)


def test_corpus_empty_and_missing(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    with pytest.raises(CorpusError, match="empty corpus"):
        Corpus.from_jsonl(f)
    with pytest.raises(CorpusError, match="empty corpus"):
        Corpus.from_passages([])
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        Corpus.from_jsonl(tmp_path / "nope.jsonl")


# -------------------------------------------------------------------------------------- ranking


def test_rank_breaks_ties_by_lower_id_and_pads():
    ids = np.array([7, 2, 5, 9], np.int64)
    scores = np.array([1.0, 3.0, 3.0, 0.5], np.float32)
    got = rank(ids, scores, 3)
    np.testing.assert_array_equal(got[0], [2, 5, 7])
    np.testing.assert_array_equal(got[1], [3.0, 3.0, 1.0])
    # the boundary tie is cut by id, whatever the input order
    got = rank(np.array([9, 5, 2]), np.array([3.0, 3.0, 3.0], np.float32), 2)
    np.testing.assert_array_equal(got[0], [2, 5])
    got = rank(np.array([4]), np.array([1.0], np.float32), 3)
    np.testing.assert_array_equal(got[0], [4, INVALID, INVALID])
    assert got[1][0] == 1.0 and np.all(np.isneginf(got[1][1:]))


# ----------------------------------------------------------------------------------------- BM25


def reference_bm25(corpus, queries, k1=1.5, b=0.75):
    """Brute-force BM25 (bm25s's default "lucene" variant) in float64 over bm25s's tokens."""
    import bm25s
    import Stemmer

    st = Stemmer.Stemmer("english")
    docs = bm25s.tokenize(corpus.all_contents(), stopwords="en", stemmer=st, return_ids=False,
                          show_progress=False)
    qs = bm25s.tokenize(queries, stopwords="en", stemmer=st, return_ids=False, show_progress=False)
    n = len(docs)
    avgdl = np.mean([len(d) for d in docs])
    df = {}
    for d in docs:
        for t in set(d):
            df[t] = df.get(t, 0) + 1
    out = np.zeros((len(queries), n))
    for qi, q in enumerate(qs):
        for di, d in enumerate(docs):
            for t in q:  # repeated query tokens count again, as in bm25s
                if t not in df:
                    continue
                tf = d.count(t)
                idf = np.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                out[qi, di] += idf * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
    return out


def test_bm25_matches_numpy_reference(bm25, corpus):
    queries = QUERIES + ["river river cat"]  # a repeated term
    ref = reference_bm25(corpus, queries)
    k = 8
    ids, scores = bm25.retrieve(queries, k)
    assert ids.shape == scores.shape == (len(queries), k)
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    for q in range(len(queries)):
        # what we return is the reference's top-k: same values, and our ids carry them
        np.testing.assert_allclose(scores[q], np.sort(ref[q])[::-1][:k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ref[q][ids[q]], scores[q], rtol=1e-5, atol=1e-6)
        # ids agree exactly wherever the reference's scores are not near-tied
        order = np.lexsort((np.arange(len(corpus)), -ref[q]))[:k]
        gaps = np.abs(np.diff(np.sort(ref[q])[::-1][:k + 1]))
        clear = np.minimum(np.r_[np.inf, gaps[:-1]], gaps) > 1e-4
        np.testing.assert_array_equal(ids[q][clear], order[clear])
    # the query made only of unknown words scores 0 everywhere: ties -> positions 0..k-1
    np.testing.assert_array_equal(ids[queries.index("zzz unknown words only")], np.arange(k))


def test_bm25_scores_are_bm25s_own(bm25, corpus):
    """Our per-document sums are bm25s's `get_scores`, bit for bit."""
    for q, terms in zip(QUERIES[:-1], bm25.query_terms(QUERIES[:-1])):
        ours = bm25.score([q], [np.arange(len(corpus))])[0]
        np.testing.assert_array_equal(ours, bm25.index.get_scores(terms))


def test_bm25_retrieve_from_is_full_retrieval_restricted(bm25):
    check_subset_agrees(bm25, QUERIES[:-1])


def test_ties_identical_in_both_paths(tmp_path):
    pytest.importorskip("bm25s")
    ps = make_passages(30, seed=3)
    for i in (4, 11, 23):  # three identical passages: equal scores under any retriever
        ps[i] = {"id": f"dup{i}", "text": "purple elephant purple elephant"}
    c = Corpus.from_passages(ps)
    for r in (R.BM25Retriever.build(c, progress=False),
              R.DenseRetriever(toy_encode(c.all_contents()), toy_encode, corpus=c)):
        ids, scores = r.retrieve(["purple elephant"], 3)
        np.testing.assert_array_equal(ids[0], [4, 11, 23])
        assert scores[0, 0] == scores[0, 1] == scores[0, 2]
        ids2, _ = r.retrieve(["purple elephant"], 2)
        np.testing.assert_array_equal(ids2[0], [4, 11])
        for cands in ([23, 11, 4, 0], [23, 11]):
            sub, sub_scores = r.retrieve_from(["purple elephant"], [np.array(cands)], 2)
            np.testing.assert_array_equal(sub[0], sorted(set(cands) & {4, 11, 23})[:2])
            assert sub_scores[0, 0] == scores[0, 0]


# ---------------------------------------------------------------------------------------- dense


def test_dense_exact_matches_brute_force(dense, corpus):
    emb = toy_encode(corpus.all_contents())
    q = toy_encode(QUERIES)
    k = 6
    ids, scores = dense.retrieve(QUERIES, k)
    for r in range(len(QUERIES)):
        exact = R.exact_scores(q[r], emb)  # the scoring function applied to every passage
        order = np.lexsort((np.arange(len(emb)), -exact))[:k]
        np.testing.assert_array_equal(ids[r], order)
        np.testing.assert_array_equal(scores[r], exact[order])
        np.testing.assert_allclose(scores[r], (emb.astype(np.float64) @ q[r])[order], atol=1e-6)


def test_dense_exact_top_k_with_near_ties_and_chunks():
    """Many passages within float32 rounding of each other, over several corpus chunks: the
    matmul shortlist must still return exactly the top-k of the exact scores."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(1, 32)).astype(np.float32)
    emb = np.repeat(base, 300, axis=0) + rng.normal(size=(300, 32)).astype(np.float32) * 1e-7
    emb[::7] = base  # exact duplicates too
    emb = emb.astype(np.float32)
    queries = ["a", "b", "c"]
    qv = {s: rng.normal(size=32).astype(np.float32) for s in queries}
    enc = lambda texts: np.stack([qv[t] for t in texts])  # noqa: E731
    for chunk in (300, 64, 7):
        r = R.DenseRetriever(emb, enc, chunk_size=chunk)
        ids, scores = r.retrieve(queries, 10)
        for i, s in enumerate(queries):
            exact = R.exact_scores(qv[s], emb)
            order = np.lexsort((np.arange(300), -exact))[:10]
            np.testing.assert_array_equal(ids[i], order)
            np.testing.assert_array_equal(scores[i], exact[order])


def test_dense_retrieve_from_is_full_retrieval_restricted(dense):
    check_subset_agrees(dense, QUERIES)


def test_dense_encodes_each_query_alone():
    """The same query embeds the same whatever batch it comes in (a batched encoder's
    padding could change its last bits): the encoder is called with one text at a time."""
    calls = []

    def enc(texts):
        calls.append(len(texts))
        return toy_encode(texts)

    r = R.DenseRetriever(toy_encode(["a b", "c d", "e f"]), enc)
    r.retrieve(["a", "b", "a"], 2)
    r.retrieve_from(["a"], [[0, 1]], 1)
    assert calls == [1, 1]  # "a" and "b" once each; the repeats come from the cache


# ---------------------------------------------------------------------------------------- faiss


@pytest.fixture(scope="module")
def faiss_mod():
    faiss = pytest.importorskip("faiss")
    faiss.omp_set_num_threads(1)
    return faiss


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_faiss_scores_are_exact_and_subset_consistent(faiss_mod, corpus, dense, kind):
    emb = toy_encode(corpus.all_contents())
    r = R.DenseRetriever(emb, toy_encode, kind=kind, corpus=corpus)
    k = 5
    ids, scores = r.retrieve(QUERIES, k)
    assert ids.shape == (len(QUERIES), k) and np.all(ids >= 0)
    # faiss picks the passages; their scores and order are the exact scorer's
    exact = dense.score(QUERIES, list(ids))
    for q in range(len(QUERIES)):
        np.testing.assert_array_equal(scores[q], exact[q])
        np.testing.assert_array_equal(ids[q], rank(ids[q], exact[q], k)[0])
    # the cache holding what the index returned (shuffled, plus the top-1 again) gives it back
    rng = np.random.default_rng(0)
    cands = [np.append(rng.permutation(row), row[0]) for row in ids]
    sub_ids, sub_scores = r.retrieve_from(QUERIES, cands, k)
    np.testing.assert_array_equal(sub_ids, ids)
    np.testing.assert_array_equal(sub_scores, scores)


def test_ivf_probing_every_list_is_exact(faiss_mod, corpus, dense):
    r = R.DenseRetriever(toy_encode(corpus.all_contents()), toy_encode, kind="ivf", nprobe=10 ** 6)
    for got, want in zip(r.retrieve(QUERIES, 5), dense.retrieve(QUERIES, 5)):
        np.testing.assert_array_equal(got, want)


# -------------------------------------------------------------------------------- bad arguments


def test_bad_arguments(dense):
    n = dense.size
    for k in (0, n + 1, 1.5, True):
        with pytest.raises(ValueError, match=f"k must be an integer in 1..{n}"):
            dense.retrieve(["x"], k)
    with pytest.raises(ValueError, match="k must be"):
        dense.retrieve_from(["x"], [[0]], 0)
    with pytest.raises(ValueError, match="outside 0.."):
        dense.retrieve_from(["x"], [[0, n]], 1)
    with pytest.raises(ValueError, match="2 candidate lists for 1 queries"):
        dense.retrieve_from(["x"], [[0], [1]], 1)
    with pytest.raises(TypeError, match="not one string"):
        dense.retrieve("x", 1)
    ids, scores = dense.retrieve_from(["x", "y"], [[], [3, 3]], 2)  # empty row; duplicates once
    np.testing.assert_array_equal(ids, [[INVALID, INVALID], [3, INVALID]])
    assert np.isneginf(scores[0]).all()
    with pytest.raises(ValueError, match="unknown dense retriever kind 'flat'"):
        R.DenseRetriever(np.ones((3, 4), np.float32), toy_encode, kind="flat")
    with pytest.raises(ValueError, match=r"shape \(1, 48\) .* dim 4$"):
        R.DenseRetriever(np.ones((3, 4), np.float32), toy_encode).retrieve(["x"], 1)


def test_encoder_errors(monkeypatch):
    with pytest.raises(EncoderUnavailable, match="no encoder named 'nope'.*register_encoder"):
        R.get_encoder("nope")
    from lookahead_jax.retrieval import encoders

    monkeypatch.setitem(sys.modules, "lookahead_jax.models.encoder", None)  # import fails
    monkeypatch.setattr(encoders, "_instances", {})
    with pytest.raises(EncoderUnavailable, match="'minilm' encoder.*not available"):
        R.get_encoder("minilm")
    with pytest.raises(ValueError, match="encoder name"):
        R.register_encoder("a/b", lambda: toy_encode)


# -------------------------------------------------------------------------------------- storage


@pytest.fixture()
def corpus_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "passages.jsonl", make_passages(80, seed=5))


def test_build_load_roundtrip(tmp_path, corpus_file, faiss_mod):
    pytest.importorskip("bm25s")
    cache = tmp_path / "cache"
    c = Corpus.from_jsonl(corpus_file)
    for kind in ("bm25", "dense", "hnsw", "ivf"):
        path = R.build_index(kind, corpus_file, encoder="toy", cache_dir=cache, progress=False)
        assert path == R.index_dir(kind, c, "toy", cache) and R.is_built(kind, c, "toy", cache)
        assert path.parent.name == c.fingerprint[:16]
        loaded = R.load_retriever(kind, corpus_file, encoder="toy", cache_dir=cache)
        assert loaded.kind == kind and loaded.corpus[3].id == "p3"
        if kind == "bm25":
            fresh = R.BM25Retriever.build(c, progress=False)
        elif kind == "dense":
            fresh = R.DenseRetriever(toy_encode(c.all_contents()), toy_encode)
        else:  # the same faiss index: compare with its own exact scores instead of a rebuild
            fresh = None
        got = loaded.retrieve(QUERIES, 4)
        if fresh is not None:
            for a, b in zip(got, fresh.retrieve(QUERIES, 4)):
                np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(
                got[1], np.stack(loaded.score(QUERIES, list(got[0]))))
    # hnsw / ivf read the dense directory's embeddings instead of keeping a copy
    assert sorted(p.name for p in (cache / c.fingerprint[:16]).iterdir()) == \
        ["bm25", "dense-toy", "hnsw-toy", "ivf-toy"]
    assert not (cache / c.fingerprint[:16] / "hnsw-toy" / "embeddings.npy").exists()
    # hnsw without its dense embeddings: loading names the hnsw build, which restores them
    shutil.rmtree(cache / c.fingerprint[:16] / "dense-toy")
    assert not R.is_built("hnsw", c, "toy", cache)
    with pytest.raises(IndexNotBuilt, match="(?s)dense index .*which the hnsw index reads.*--retriever hnsw"):
        R.load_retriever("hnsw", c, encoder="toy", cache_dir=cache)
    R.build_index("hnsw", c, encoder="toy", cache_dir=cache, progress=False)
    assert R.is_built("dense", c, "toy", cache)
    # a second build is a no-op (same directory, untouched)
    meta = (R.index_dir("bm25", c, cache_dir=cache) / "meta.json").read_text()
    R.build_index("bm25", c, cache_dir=cache, progress=False)
    assert (R.index_dir("bm25", c, cache_dir=cache) / "meta.json").read_text() == meta


def test_missing_stale_and_foreign_indexes(tmp_path, corpus_file):
    pytest.importorskip("bm25s")
    cache = tmp_path / "cache"
    cmd = (f"python -m lookahead_jax.retrieval build --corpus {corpus_file.resolve()} "
           f"--retriever bm25 --out {cache}")
    with pytest.raises(IndexNotBuilt) as e:
        R.load_retriever("bm25", corpus_file, cache_dir=cache)
    assert cmd in str(e.value) and e.value.command == cmd
    R.build_index("bm25", corpus_file, cache_dir=cache, progress=False)
    R.load_retriever("bm25", corpus_file, cache_dir=cache)
    old = Corpus.from_jsonl(corpus_file)

    # the file changes: the old index is stale, and the error says so and how to rebuild
    write_jsonl(corpus_file, make_passages(81, seed=5))
    with pytest.raises(StaleIndex) as e:
        R.load_retriever("bm25", corpus_file, cache_dir=cache)
    assert "stale" in str(e.value) and "file changed" in str(e.value) and cmd in str(e.value)

    # an index of another corpus found where this corpus's should be
    new = Corpus.from_jsonl(corpus_file)
    shutil.copytree(R.index_dir("bm25", old, cache_dir=cache), R.index_dir("bm25", new, cache_dir=cache))
    with pytest.raises(StaleIndex, match="built for another corpus .*80 passages.*not this one \\(81"):
        R.load_retriever("bm25", new, cache_dir=cache)
    R.build_index("bm25", new, cache_dir=cache, progress=False)  # rebuilt in place
    assert R.load_retriever("bm25", new, cache_dir=cache).size == 81


def test_encoder_mismatch(tmp_path, corpus_file):
    cache = tmp_path / "cache"
    c = Corpus.from_jsonl(corpus_file)
    R.build_index("dense", c, encoder="toy", cache_dir=cache, progress=False)
    with pytest.raises(IndexNotBuilt, match="(?s)encoder\\(s\\) toy only.*--encoder toy-b"):
        R.load_retriever("dense", c, encoder="toy-b", cache_dir=cache)
    # meta.json names another encoder than the directory: stale
    d = R.index_dir("dense", c, "toy", cache)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "encoder": "toy-b"}))
    with pytest.raises(StaleIndex, match="built with encoder 'toy-b', not 'toy'"):
        R.load_retriever("dense", c, encoder="toy", cache_dir=cache)
    with pytest.raises(EncoderUnavailable):
        R.build_index("dense", c, encoder="not-registered", cache_dir=cache, progress=False)


def test_unknown_kind_lists_the_valid_ones(corpus_file):
    with pytest.raises(UnknownRetriever, match="unknown retriever 'splade'; valid: bm25, dense, hnsw, ivf"):
        R.load_retriever("splade", corpus_file)


def test_cache_root_follows_project_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path))
    assert R.cache_root() == tmp_path / "retrieval"


# ------------------------------------------------------------------------------------------ CLI


def test_cli_build_subprocess_then_query(tmp_path, corpus_file, capsys):
    pytest.importorskip("bm25s")
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.retrieval", "build", "--corpus",
                        str(corpus_file), "--retriever", "bm25", "--out", str(cache), "--quiet"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    c = Corpus.from_jsonl(corpus_file)
    assert p.stdout.strip() == str(R.index_dir("bm25", c, cache_dir=cache))
    assert "80 passages" in p.stderr

    from lookahead_jax.retrieval.cli import main

    assert main(["query", "--corpus", str(corpus_file), "--retriever", "bm25", "--out", str(cache),
                 "-k", "2", "cat running by the river"]) == 0
    out = capsys.readouterr().out.splitlines()
    top = R.load_retriever("bm25", c, cache_dir=cache).retrieve(["cat running by the river"], 2)[0][0]
    assert out[0] == "# cat running by the river"
    assert [line.split()[1] for line in out[1:3]] == [c[i].id for i in top]


def test_cli_build_dense_and_errors(tmp_path, corpus_file, capsys):
    from lookahead_jax.retrieval.cli import main

    cache = tmp_path / "cache"
    argv = ["build", "--corpus", str(corpus_file), "--retriever", "dense", "--encoder", "toy",
            "--out", str(cache), "--quiet"]
    assert main(argv) == 0
    assert R.is_built("dense", corpus_file, "toy", cache)
    capsys.readouterr()
    assert main(argv) == 0 and "up to date" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2}\n')
    assert main(["build", "--corpus", str(bad), "--retriever", "bm25", "--out", str(cache)]) == 2
    assert f"{bad}:2: missing field(s) text" in capsys.readouterr().err
    assert main(["query", "--corpus", str(corpus_file), "--retriever", "ivf", "--encoder", "toy",
                 "--out", str(cache), "x"]) == 2
    assert "--retriever ivf --encoder toy" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse lists the valid choices
        main(["build", "--corpus", str(corpus_file), "--retriever", "splade"])
    assert "invalid choice: 'splade'" in capsys.readouterr().err
