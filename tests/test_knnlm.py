"""KNN-LM and speculative KNN-LM (lookahead_jax/knnlm/) on the tiny llama + a byte tokenizer.

The datastore: build / load round trip (keys are the model's hidden states, values the next
tokens, entries of a passage consecutive), up to date on a second build, and the errors
(missing, another model, a changed corpus, an empty corpus, no entries). The search: device
exact search (several chunks) == numpy brute force, ties ranked by id, the brute-force
fallback, the subset and cache searches, faiss flat == exact. The distribution: exp(scores) == lam p_kNN + (1 - lam) p_LM
computed in numpy. Decoding: lambda = 0 gives plain decoding's tokens; speculative ==
plain KNN-LM token for token and log-probability for log-probability (greedy and sampling,
batch 6, strides 1/2/5/auto, rows ending mid-batch, min_new_tokens, a cache that predicts
every neighbour list and one that predicts none, exact and faiss search, IVF candidates
beside the cache); the CLI.
The corpus: each prompt followed by the model's own continuation (text the decoding meets
again: speculation succeeds) plus shuffled words of it."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.generate import generate
import lookahead_jax.loading as loading
from lookahead_jax import knnlm
from lookahead_jax.core.engine import engine_for
from lookahead_jax import KNNLM
from lookahead_jax.knnlm import DatastoreNotBuilt, StaleDatastore, build_datastore, load_datastore
from lookahead_jax.knnlm import search as S
from lookahead_jax.strategies import speculation
from lookahead_jax.strategies.knnlm import KnnSpecRun
from lookahead_jax.strategies.speculation import os3_stride_knnlm as os3_stride
from lookahead_jax.models import hidden_states, init_cache, logits_from_hidden
from lookahead_jax.retrieval import Corpus, CorpusError
from tiny import ByteTokenizer, load_prompts, tiny_model

MAX_NEW = 20
PROMPTS = [r["prompt"][-40:] for r in load_prompts(2)]  # 6 prompts, 3 sources


class Latin1Tokenizer(ByteTokenizer):
    """Bytes as latin-1 characters (others as their UTF-8 bytes): every decoded text encodes
    back to its tokens, so the model's continuations can be written into passages."""

    def encode(self, text, add_special_tokens=True):
        raw = b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode("utf-8") for c in text)
        return ([1] if add_special_tokens else []) + [b + 3 for b in raw]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("latin-1")


@pytest.fixture(scope="module")
def tok():
    return Latin1Tokenizer()


@pytest.fixture(scope="module")
def corpus(model, tok) -> Corpus:
    out = generate(model, tok, PROMPTS, max_new_tokens=40)
    passages = [tok.decode(tok.encode(p, False) + t) for p, t in zip(PROMPTS, out.token_ids)]
    words = " ".join(out.texts).split()
    rng = np.random.default_rng(0)
    passages += [" ".join(rng.choice(words, int(rng.integers(3, 10)))) for _ in range(24)]
    passages[7] = {"id": "titled", "title": "A title", "text": passages[7]}
    return Corpus.from_passages(passages)


@pytest.fixture(scope="module")
def ds(model, tok, corpus, tmp_path_factory):
    path = build_datastore(model, tok, corpus, path=tmp_path_factory.mktemp("knn") / "ds", progress=False)
    return load_datastore(model, corpus, path)


def run(model, tok, strat, prompts=PROMPTS, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return generate(model, tok, prompts, strategy=strat, **kw)


def direct_hidden(model, ids):
    """Final hidden states [T,D] and logits [T,V] of one token sequence: one forward of the
    plain (unpacked) params."""
    cfg = model.config

    @jax.jit
    def fwd(params, tokens):
        T = tokens.shape[1]
        pos = jnp.arange(T, dtype=jnp.int32)[None]
        mask = jnp.arange(T)[None, None, :] <= pos[:, :, None]
        h, _ = hidden_states(params, tokens, pos, init_cache(cfg, 1, T), mask, cfg)
        return h[0], logits_from_hidden(params, h, cfg)[0]

    return fwd(model.params, jnp.asarray([ids], jnp.int32))


def numpy_topk(keys, h, k):
    """Brute force in float64: ids of the k smallest squared distances, ties by id."""
    d = ((keys.astype(np.float64) - np.asarray(h, np.float64)[None]) ** 2).sum(1)
    return np.lexsort((np.arange(len(d)), d))[:k], d


# ----------------------------------------------------------------------------- datastore
def test_datastore_round_trip(model, tok, corpus, ds):
    toks = [tok.encode(p.contents) for p in corpus]
    assert ds.size == sum(len(t) - 1 for t in toks)
    assert ds.meta["n_passages"] == len(corpus) and ds.meta["corpus_sha256"] == corpus.fingerprint
    assert ds.meta["model"]["name"] == "tiny-llama" and ds.keys.dtype == np.float16
    assert list(ds.offsets) == list(np.concatenate([[0], np.cumsum([len(t) - 1 for t in toks])]))
    for i in (0, 7, len(corpus) - 1):  # keys = hidden states before the LM head, values = next tokens
        a, b = ds.offsets[i], ds.offsets[i + 1]
        h, _ = direct_hidden(model, toks[i])
        np.testing.assert_allclose(ds.keys[a:b].astype(np.float32), np.asarray(h)[:-1], rtol=2e-3, atol=2e-3)
        assert list(ds.values[a:b]) == toks[i][1:]
        assert ds.passage_of(a) == i and ds.passage_of(b - 1) == i
    # up to date: a second build does nothing; other settings rebuild
    created = ds.meta["created"]
    path = build_datastore(model, tok, corpus, path=ds.path, progress=False)
    assert load_datastore(model, corpus, path).meta["created"] == created
    small = build_datastore(model, tok, corpus, path=ds.path.parent / "small", max_passages=3,
                            key_dtype="float32", progress=False)
    s = load_datastore(model, None, small)
    assert s.size == sum(len(t) - 1 for t in toks[:3]) and s.keys.dtype == np.float32


def test_datastore_errors(model, tok, corpus, ds, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "c.jsonl"
    f.write_text(corpus.to_jsonl())
    with pytest.raises(DatastoreNotBuilt) as e:  # nothing built: the command names the fix
        load_datastore(model, f)
    cmd = f"python -m lookahead_jax.knnlm build --model tiny-llama --corpus {f.resolve()}"
    assert e.value.command == cmd and cmd in str(e.value)
    with pytest.raises(DatastoreNotBuilt, match="python -m lookahead_jax.knnlm build"):
        load_datastore(model)
    with pytest.raises(DatastoreNotBuilt, match="Build it with"):  # generate fails before any forward
        run(model, tok, KNNLM(corpus=str(f)))
    path = build_datastore(model, tok, f, progress=False)
    assert path == knnlm.datastore_dir(model, f) and load_datastore(model).path == path  # the only one
    assert run(model, tok, KNNLM(corpus=str(f)), max_new_tokens=3).stats["retrieval"]["entries"] == ds.size
    other = tiny_model("llama", seed=2)
    with pytest.raises(StaleDatastore, match="built for model tiny-llama") as e:
        load_datastore(other, f, path)
    assert "--out" in e.value.command
    with pytest.raises(StaleDatastore):  # a Datastore object is checked as well
        run(other, tok, KNNLM(datastore=ds))
    f.write_text(corpus.to_jsonl() + json.dumps({"id": "new", "text": "one more"}) + "\n")
    with pytest.raises(StaleDatastore, match="the file changed"):
        load_datastore(model, f)
    with pytest.raises(StaleDatastore, match="another corpus"):
        load_datastore(model, f, path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(CorpusError, match="empty corpus"):
        build_datastore(model, tok, empty, progress=False)
    with pytest.raises(ValueError, match="no datastore entries"):
        build_datastore(model, tok, Corpus.from_passages(["", ""]), path=tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="is not a KNN-LM datastore"):  # never replaces other files
        build_datastore(model, tok, f, path=tmp_path, progress=False)
    assert f.exists()


def test_missing_datastore_suggests_a_subset(model, tmp_path, monkeypatch):
    """A missing datastore of a large corpus names a build over its first passages (minutes,
    where the whole corpus would take hours); a small corpus is built whole."""
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    n = knnlm.datastore.SUGGESTED_MAX_PASSAGES
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"id": f"p{i}", "text": f"passage {i}"}) + "\n" for i in range(n + 1)))
    with pytest.raises(DatastoreNotBuilt) as e:
        load_datastore(model, big)
    assert e.value.command == f"python -m lookahead_jax.knnlm build --model tiny-llama --corpus {big.resolve()} " \
                              f"--max-passages {n}"
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"id": f"p{i}", "text": f"passage {i}"}) + "\n" for i in range(n)))
    with pytest.raises(DatastoreNotBuilt) as e:
        load_datastore(model, small)
    assert "--max-passages" not in e.value.command
    with pytest.raises(DatastoreNotBuilt) as e:  # no corpus named: the placeholder gets the subset too
        load_datastore(model)
    assert e.value.command.endswith(f"--corpus CORPUS.jsonl --max-passages {n}")


# ----------------------------------------------------------------------------- search
def test_exact_search_is_brute_force_and_ranks_ties_by_id(model, tok, ds):
    index = S.KnnIndex(ds, chunk=512)  # several chunks
    assert index.keys.shape[0] > 2
    keys = np.asarray(ds.keys, np.float32)
    rng = np.random.default_rng(1)
    h = np.concatenate([keys[rng.integers(0, ds.size, 5)] + 0.05 * rng.standard_normal((5, ds.dim)),
                        rng.standard_normal((3, ds.dim)) * 3]).astype(np.float32)
    for k in (1, 8, 32):
        ids, ok = S.exact_search(index.keys, jnp.asarray(h), index.norms, index.n_valid, index.xmax, k=k)
        brute = S.brute_search(index.keys, jnp.asarray(h), index.n_valid, k=k)
        assert np.asarray(ok).all()
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(brute))
        for q in range(len(h)):
            want, _ = numpy_topk(keys, h[q], k)
            assert set(np.asarray(ids)[q]) == set(want)  # f64 vs the canonical f32 sums: no near-ties here
    # duplicated keys: ties go to the lower id
    dup = rng.standard_normal((300, 4)).astype(np.float16)
    dup[[10, 50, 200]] = dup[3]
    small = S.KnnIndex(knnlm.Datastore(ds.path, ds.meta, dup, np.arange(300, dtype=np.int32), np.array([0, 300])),
                       chunk=64)
    q = jnp.asarray(dup[[200]].astype(np.float32))
    ids, ok = S.exact_search(small.keys, q, small.norms, small.n_valid, small.xmax, k=4)
    assert np.asarray(ok).all()
    np.testing.assert_array_equal(np.asarray(ids), [[3, 10, 50, 200]])
    # all keys equal: the shortlist cannot be proven (ok false) and brute force ranks by id
    flat = knnlm.Datastore(ds.path, ds.meta, np.ones((300, 4), np.float16), np.arange(300, dtype=np.int32),
                           np.array([0, 300]))
    fi = S.KnnIndex(flat, chunk=64)
    ids, ok = S.exact_search(fi.keys, jnp.zeros((2, 4)), fi.norms, fi.n_valid, fi.xmax, k=5)
    assert not np.asarray(ok).any()
    np.testing.assert_array_equal(np.asarray(S.brute_search(fi.keys, jnp.zeros((2, 4)), fi.n_valid, k=5)),
                                  [[0, 1, 2, 3, 4]] * 2)
    # a subset search ranks its candidates as the full search does
    ids, _ = S.exact_search(index.keys, jnp.asarray(h), index.norms, index.n_valid, index.xmax, k=8)
    cand = np.full((len(h), 64), -1, np.int32)
    for q, row in enumerate(np.asarray(ids)):
        c = np.unique(np.concatenate([row, rng.integers(0, ds.size, 40)]))
        cand[q, :len(c)] = rng.permutation(c)
    sub = S.subset_search(index.keys, jnp.asarray(h), jnp.asarray(cand), index.n_valid, k=8)
    np.testing.assert_array_equal(np.asarray(sub), np.asarray(ids))
    spec = S.cache_search(index.keys, jnp.asarray(h), jnp.asarray(cand), index.norms, index.n_valid, k=8)
    np.testing.assert_array_equal(np.asarray(spec), np.asarray(ids))  # speculation's search agrees here


def test_faiss_flat_matches_exact_search(ds):
    pytest.importorskip("faiss")
    index = S.KnnIndex(ds)
    keys = np.asarray(ds.keys, np.float32)
    h = keys[::997][:8] + 0.01
    for kind in ("flat", "hnsw"):
        cand = index.faiss_candidates(h, kind, 16)
        got = np.asarray(S.subset_search(index.keys, jnp.asarray(h), jnp.asarray(cand), index.n_valid, k=16))
        want, _ = S.exact_search(index.keys, jnp.asarray(h), index.norms, index.n_valid, index.xmax, k=16)
        if kind == "flat":
            np.testing.assert_array_equal(got, np.asarray(want))
        else:  # approximate: most neighbours found
            assert np.mean([len(set(a) & set(b)) for a, b in zip(got, np.asarray(want))]) >= 8


@pytest.mark.parametrize("lam", [0.25, 1.0])
def test_distribution_is_the_knnlm_mixture(model, tok, corpus, ds, lam):
    """exp(scores) == lam * p_kNN + (1 - lam) * softmax(logits), from numpy brute force."""
    index = S.KnnIndex(ds)
    keys = np.asarray(ds.keys, np.float32)
    k, temp = 16, 3.0
    for text in (PROMPTS[0], corpus[1].text[:30]):
        h, logits = direct_hidden(model, tok.encode(text))
        h, logits = h[-1:], logits[-1:]
        ids, _ = S.exact_search(index.keys, h, index.norms, index.n_valid, index.xmax, k=k)
        want, d = numpy_topk(keys, np.asarray(h[0]), k)
        assert set(np.asarray(ids)[0]) == set(want)
        scores = np.asarray(S.knn_scores(h, logits, ids, index.keys, index.values, lam=lam, temperature=temp))[0]
        w = np.exp(-(d[want] - d[want].min()) / temp)
        w /= w.sum()
        p_knn = np.zeros(model.config.vocab_size)
        np.add.at(p_knn, ds.values[want], w)
        z = np.asarray(logits[0], np.float64)
        p_lm = np.exp(z - z.max())
        p_lm /= p_lm.sum()
        p = lam * p_knn + (1 - lam) * p_lm
        np.testing.assert_allclose(np.exp(scores), p, rtol=1e-4, atol=1e-6)
        assert abs(np.exp(scores).sum() - 1) < 1e-5


# ----------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=20, seed=5)])
def test_lambda_zero_is_plain_decoding(model, tok, ds, sampling):
    plain = generate(model, tok, PROMPTS, max_new_tokens=MAX_NEW, **sampling)
    out = run(model, tok, KNNLM(datastore=ds, knn_lambda=0.0), **sampling)
    assert out.token_ids == plain.token_ids
    assert out.stats["retrieval"]["searches"] == sum(len(t) for t in out.token_ids)
    assert all(r.forward_steps - 1 == r.decode_steps == r.new_tokens for r in out.rows)  # a tokenless prefill, 1 a step


def test_knnlm_follows_its_neighbours(model, tok, ds):
    """lam = 1, k = 1: every token is the value of the entry nearest to the hidden state."""
    out = run(model, tok, KNNLM(datastore=ds, knn_lambda=1.0, knn_k=1), prompts=PROMPTS[:1], max_new_tokens=6)
    ids = tok.encode(PROMPTS[0]) + out.token_ids[0]
    h, _ = direct_hidden(model, ids)
    keys = np.asarray(ds.keys, np.float32)
    n = len(tok.encode(PROMPTS[0]))
    for j, t in enumerate(out.token_ids[0]):
        nearest, _ = numpy_topk(keys, np.asarray(h[n - 1 + j]), 1)
        assert ds.values[nearest[0]] == t


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert [r.finish_reason for r in a.rows] == [r.finish_reason for r in b.rows]
    assert [r.logprobs for r in a.rows] == [r.logprobs for r in b.rows]  # bitwise


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=3)])
def test_speculative_equals_plain(model, tok, ds, sampling):
    kw = dict(logprobs=True, stop_token_ids=[116, 158], min_new_tokens=2, **sampling)
    hits = rollbacks = 0
    ends = set()
    for k in (2, 16):
        plain = run(model, tok, KNNLM(datastore=ds, knn_k=k), **kw)
        ends |= {r.new_tokens for r in plain.rows if r.finish_reason == "eos"}
        for s in (1, 2, 5, "auto"):
            if s == "auto":  # OS3 from no measurements: default strides, then its own picks
                engine_for(model).stores.of(S.KnnlmStore).os3.clear()
            spec = run(model, tok, KNNLM(datastore=ds, knn_k=k, speculative=True, speculation_stride=s), **kw)
            assert_same(spec, plain)
            st = spec.stats["retrieval"]
            assert 0 < st["speculation_checks"] <= st["speculations"]
            assert st["rollbacks"] <= st["speculation_checks"] - st["speculation_hits"]
            hits += st["speculation_hits"]
            rollbacks += st["rollbacks"]
            if s != "auto":
                assert st["mean_speculation_stride"] == s
            rows = [r.retrieval for r in spec.rows]
            assert sum(r["rollbacks"] for r in rows) == st["rollbacks"]
            print(k, s, {x: st[x] for x in ("speculation_accuracy", "rollbacks", "tokens_kept", "search_calls")})
    assert len(ends) > 1  # rows end mid-batch, at several lengths
    assert hits > 0 and (rollbacks > 0 or not sampling)


def test_speculative_stop_strings_end_rows_mid_round(model, tok, ds):
    """A row that ends on a stop string mid-round (the host cannot see it before the round's
    tokens are read) keeps exactly plain KNN-LM's tokens, text and finish: the steps it ran
    past its end are dropped."""
    base = run(model, tok, KNNLM(datastore=ds, knn_k=4), logprobs=True)
    stops = sorted({t[len(t) // 2:len(t) // 2 + 2] for t in base.texts if len(t) > 6})
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), logprobs=True, stop=stops)
    assert sum(r.finish_reason == "stop" for r in plain.rows) >= 2
    assert any(0 < r.new_tokens < MAX_NEW - 2 for r in plain.rows if r.finish_reason == "stop")
    for s in (5, 16):
        spec = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=s),
                   logprobs=True, stop=stops)
        assert_same(spec, plain)
        assert spec.texts == plain.texts


@pytest.mark.parametrize("speculative", [False, True])
def test_slots_insert_mid_decode_equals_alone(model, tok, ds, speculative):
    """KNN-LM on the slot API: requests inserted into 2 slots while the other decodes give
    their tokens (and log-probabilities) alone; events carry only verified tokens."""
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from tiny import drive_slots

    strat = KNNLM(datastore=ds, knn_k=4, speculative=speculative, speculation_stride=3)
    slots = Slots(engine_for(model), tok, 2, 512, strat, logprobs=True)
    idx = [3, 0, 5, 1]
    got = drive_slots(slots, [Request(tok.encode(PROMPTS[i]), GenerationParams(max_new_tokens=MAX_NEW), sampling_row=i) for i in idx], every=3)
    for i, (row, streamed) in zip(idx, got):
        one = run(model, tok, KNNLM(datastore=ds, knn_k=4), prompts=[PROMPTS[i]], logprobs=True, first_index=i)
        assert row.ids == streamed == one.token_ids[0], f"prompt {i}"
        assert row.logprobs == one.rows[0].logprobs
        assert row.retrieval["searches"] > 0
    st = slots.run.summary()["retrieval"]
    assert st["searches"] >= sum(len(r.ids) for r, _ in got) // (3 if speculative else 1)


def test_speculative_prediction_forced(model, tok, ds, monkeypatch):
    """A cache holding every entry (speculation always right: no rollback) and one holding
    no neighbour (always wrong: every position checked again); the tokens stay plain's."""
    kw = dict(logprobs=True)
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), **kw)
    strat = KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=3)
    everything = np.arange(ds.size, dtype=np.int32)
    monkeypatch.setattr(KnnSpecRun, "_candidates", lambda self: np.tile(everything, (len(self.cache), 1)))
    right = run(model, tok, strat, **kw)
    assert_same(right, plain)
    st = right.stats["retrieval"]
    assert st["speculation_accuracy"] == 1.0 and st["rollbacks"] == 0
    far = np.full((1, 64), -1, np.int32)
    far[0, :8] = np.arange(8)  # BOS-side entries only: no real neighbour list fits in them
    monkeypatch.setattr(KnnSpecRun, "_candidates", lambda self: np.tile(far, (len(self.cache), 1)))
    wrong = run(model, tok, strat, **kw)
    assert_same(wrong, plain)
    st = wrong.stats["retrieval"]
    assert st["speculation_accuracy"] == 0.0 and st["rollbacks"] > 0


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=3)])
def test_ivf_speculation_equals_plain(model, tok, ds, monkeypatch, sampling):
    """knn_speculate="ivf": the IVF index's candidates join the cache's. With caches that
    hold no real neighbour list (alone: every speculation wrong, as above), the IVF
    candidates, every list probed, make speculation right; tokens and log-probabilities
    stay plain KNN-LM's (batch 6, rows ending mid-batch)."""
    pytest.importorskip("faiss")
    kw = dict(logprobs=True, stop_token_ids=[116, 158], **sampling)
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), **kw)
    far = np.full((1, 64), -1, np.int32)
    far[0, :8] = np.arange(8)
    monkeypatch.setattr(KnnSpecRun, "_candidates", lambda self: np.tile(far, (len(self.cache), 1)))
    for s in (1, 3):
        spec = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=s,
                                     knn_speculate="ivf", knn_nprobe=4096), **kw)
        assert_same(spec, plain)
        st = spec.stats["retrieval"]
        assert st["speculate"] == "ivf" and st["ivf_s"] > 0 and st["speculation_checks"] > 20
        assert st["speculation_accuracy"] >= 0.9, st
    assert (ds.path / "ivf.faiss").exists()


def test_speculate_auto_picks_ivf_only_for_large_stores(model, tok, ds, monkeypatch):
    """knn_speculate="auto" (the default) ranks the cache alone on a small datastore and
    adds the IVF index's candidates from IVF_AUTO_MIN entries, where faiss is installed
    (without faiss: the cache); the run reports what it used."""
    import builtins

    from lookahead_jax.knnlm import search as K

    assert KNNLM().knn_speculate == "auto"
    assert K.resolve_speculate("auto", K.IVF_AUTO_MIN - 1) == "cache"
    assert K.resolve_speculate("cache", 10 ** 9) == "cache" and K.resolve_speculate("ivf", 10) == "ivf"
    out = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=2))
    assert out.stats["retrieval"]["speculate"] == "cache" and "ivf_s" not in out.stats["retrieval"]
    real_import = builtins.__import__

    def no_faiss(name, *a, **kw):
        if name == "faiss":
            raise ImportError("no faiss here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_faiss)
    assert K.resolve_speculate("auto", K.IVF_AUTO_MIN) == "cache"
    monkeypatch.setattr(builtins, "__import__", real_import)
    if importlib.util.find_spec("faiss") is None:
        return
    assert K.resolve_speculate("auto", K.IVF_AUTO_MIN) == "ivf"
    monkeypatch.setattr(K, "IVF_AUTO_MIN", ds.size)  # this datastore counts as large
    out = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=2))
    assert out.stats["retrieval"]["speculate"] == "ivf" and out.stats["retrieval"]["ivf_s"] > 0


def test_ivf_index_and_candidates(ds):
    """The IVF index: about 2 sqrt(n) lists (at most n / 64), saved and read back; its
    candidates join a cache's without repeating an id, inactive rows get none."""
    pytest.importorskip("faiss")
    from lookahead_jax.knnlm.datastore import build_ivf, ivf_lists

    assert ivf_lists(1_000_000) == 2048 and ivf_lists(600) == 9 and ivf_lists(10) == 1
    index = S.KnnIndex(ds)
    built = build_ivf(ds)
    assert built.ntotal == ds.size and built.nlist == ivf_lists(ds.size)
    assert (ds.path / "ivf.faiss").exists() and build_ivf(ds, save=False).ntotal == ds.size
    h = np.asarray(ds.keys[[5, 40, 90]], np.float32)
    base = np.full((3, 16), -1, np.int32)
    base[0, :4] = [5, 6, 7, 8]
    cand = index.with_ivf(base, h, np.array([True, False, True]), k=4, nprobe=64)
    assert cand.shape == (3, 16 + 16) and (cand[:, :16] == base).all()
    assert (cand[1, 16:] == -1).all() and 5 in cand[0] and 90 in cand[2, 16:]
    for row in cand:
        ids = row[row >= 0]
        assert len(ids) == len(set(ids.tolist()))


def test_os3_plain_rounds_keep_tokens_and_measure_g(model, tok, ds, monkeypatch):
    """Where OS3 picks s = 0 (forced here after the first rounds), rows decode by real steps
    between speculative rounds; the tokens are plain KNN-LM's, and the shadow checks of the
    plain rounds keep g measured (outcomes noted while nothing is speculated)."""
    from lookahead_jax.strategies import knnlm_runs as knn_strategy

    kw = dict(logprobs=True, min_new_tokens=2, stop_token_ids=[116, 158])
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), **kw)
    picks = iter([2, 0, 0, 0, 0, 3] * 100)
    monkeypatch.setattr(knn_strategy, "os3_stride_knnlm", lambda *a, **k: next(picks))
    monkeypatch.setattr(speculation, "KNN_WINDOW", 10 ** 6)  # every outcome stays countable
    engine_for(model).stores.of(S.KnnlmStore).os3.clear()
    noted = []
    real_plain_step = KnnSpecRun._plain_step

    def plain_step(self, state, active, shadow):
        n = len(self.m.outcomes)
        real_plain_step(self, state, active, shadow)
        noted.append((shadow, len(self.m.outcomes) - n))

    monkeypatch.setattr(KnnSpecRun, "_plain_step", plain_step)
    spec = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride="auto"), **kw)
    assert_same(spec, plain)
    st = spec.stats["retrieval"]
    assert st["plain_rounds"] > 0 and st["speculations"] > 0
    assert any(sh and n > 0 for sh, n in noted)  # shadow checks noted outcomes
    assert all(n == 0 for sh, n in noted if not sh)


def test_os3_measures_carry_across_calls(model, tok, ds, monkeypatch):
    """OS3's measurements live on the engine per datastore and settings: a second call
    consults OS3 from its first round (the first call ran default strides until it had
    measured a round), and another k starts afresh."""
    from lookahead_jax.strategies import knnlm_runs as knn_strategy

    engine_for(model).stores.of(S.KnnlmStore).os3.clear()
    consulted = []
    real = knn_strategy.os3_stride_knnlm
    # s >= 1: a plain (s = 0) choice holds 16 rounds without asking OS3, and whether OS3 picks
    # it on this tiny store depends on the host's timing (s = 0 has its own test above)
    monkeypatch.setattr(knn_strategy, "os3_stride_knnlm",
                        lambda *a, **k: consulted.append(1) or max(1, real(*a, **k)))

    def rounds(out):  # rounds that were not a request's first token
        return out.stats["retrieval"]["plain_rounds"] + out.stats["retrieval"]["verify_calls"]

    strat = KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride="auto")
    first = run(model, tok, strat)
    assert 0 < len(consulted) < rounds(first)
    consulted.clear()
    second = run(model, tok, strat)
    assert second.token_ids == first.token_ids and len(consulted) == rounds(second)
    assert len(engine_for(model).stores.of(S.KnnlmStore).os3) == 1
    consulted.clear()
    other = run(model, tok, KNNLM(datastore=ds, knn_k=2, speculative=True, speculation_stride="auto"))
    assert len(consulted) < rounds(other) and len(engine_for(model).stores.of(S.KnnlmStore).os3) == 2


def test_speculation_predicts_text_from_the_datastore(model, tok, ds):
    """Decoding the prompts whose continuations are in the datastore: the entries after
    each neighbour are the next neighbours, so most speculations are right."""
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=1))
    spec = run(model, tok, KNNLM(datastore=ds, knn_k=1, speculative=True, speculation_stride=4))
    assert_same(spec, plain)
    st = spec.stats["retrieval"]
    assert st["speculation_accuracy"] > 0.5
    assert st["search_calls"] < plain.stats["retrieval"]["search_calls"] / 2  # batched verification


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_faiss_search_decoding(model, tok, ds, kind):
    pytest.importorskip("faiss")
    exact = run(model, tok, KNNLM(datastore=ds, knn_k=8))
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=8, knn_search=kind))
    if kind == "flat":
        assert plain.token_ids == exact.token_ids
    spec = run(model, tok, KNNLM(datastore=ds, knn_k=8, knn_search=kind, speculative=True, speculation_stride=3))
    assert_same(spec, plain)


def test_streaming_sends_only_verified_text(model, tok, ds):
    got = {}
    spec = run(model, tok, KNNLM(datastore=ds, knn_k=16, speculative=True, speculation_stride=5),
               prompts=PROMPTS[:1], on_text=lambda i, t: got.setdefault(i, []).append(t))
    assert "".join(got[0]) == spec.texts[0]


def test_options_are_checked(model, tok, ds):
    for bad, msg in ((dict(knn_k=0), "knn_k"), (dict(knn_lambda=1.5), "knn_lambda"),
                     (dict(knn_temperature=0), "knn_temperature"), (dict(knn_search="ivf"), "knn_search"),
                     (dict(speculative=True, knn_speculate="all"), "knn_speculate"),
                     (dict(speculative=True, knn_nprobe=0), "knn_nprobe"),
                     (dict(speculation_stride=0), "speculation_stride"), (dict(datastore=3), "datastore")):
        with pytest.raises(ValueError, match=msg):
            run(model, tok, "knnlm", **bad)
    assert os3_stride(0.9, 1.0, 2.0) == 6 and os3_stride(0.0, 1.0, 2.0) == 1
    # a verification that grows with its queries (b(n) = 1 + n, the same b(1)): shorter rounds
    assert os3_stride(0.9, 1.0, 1.0, 1.0) == 3
    assert os3_stride(0.9, 1.0, 1.0, 1.0, rows=4) < os3_stride(0.9, 1.0, 1.0, 1.0)  # 4 rows: 4 queries a step
    # plain KNN-LM (s = 0) only where allowed and strictly faster: a cheap search, rare keeps
    assert os3_stride(0.3, 1.2, 0.2, a0=1.0, min_s=0) == 0 and os3_stride(0.3, 1.2, 0.2, a0=1.0) == 1
    assert os3_stride(0.9, 1.0, 2.0, a0=1.0, min_s=0) == 6  # a dear search: speculation pays
    assert os3_stride(0.9, 1.0, 0.15, a0=1.0, min_s=0) == 0  # a near tie (s = 2 1.6% ahead): plain
    assert os3_stride(0.95, 1.0, 0.2, a0=1.0, min_s=0) >= 2  # 6% ahead: speculate


# ----------------------------------------------------------------------------- CLI
def test_cli_build_and_generate(model, tok, corpus, tmp_path, monkeypatch, capsys):
    from lookahead_jax.cli import main
    from lookahead_jax.knnlm.cli import main as knn_main

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "load", lambda name, dtype="float32", **kw: (model, tok))
    f = tmp_path / "c.jsonl"
    f.write_text(corpus.to_jsonl())
    args = ["--prompt", PROMPTS[0], "--max-new-tokens", "8", "--json", "--strategy", "knnlm", "--corpus", str(f),
            "--knn-k", "4"]
    assert main(args) == 2
    assert "python -m lookahead_jax.knnlm build --model tiny-llama --corpus" in capsys.readouterr().err
    assert knn_main(["build", "--model", "tiny-llama", "--corpus", str(f), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "entries" in out.err and out.out.strip() == str(knnlm.datastore_dir(model, f))
    assert knn_main(["build", "--model", "tiny-llama", "--corpus", str(f), "--quiet"]) == 0
    assert "up to date" in capsys.readouterr().err
    rows = {}
    for extra in ([], ["--speculative", "--speculation-stride", "2"]):
        assert main(args + extra) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        rows[bool(extra)], summary = lines[0], lines[-1]["summary"]
        assert summary["retrieval"]["searches"] == lines[0]["retrieval"]["searches"]
        assert extra or (summary["decode_steps"], summary["tokens_per_step"]) == (8, 1.0)  # + prefill, not 8 / 9
    assert rows[True]["token_ids"] == rows[False]["token_ids"] and len(rows[False]["token_ids"]) == 8
    assert "speculation_accuracy" in rows[True]["retrieval"]
    assert knn_main(["build", "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert "corpus file not found" in capsys.readouterr().err


def test_penalties_are_refused(model, tok, ds):
    """knnlm picks tokens from its own mixture, which the penalties do not reach: asking
    for them is an error, not silently ignored."""
    with pytest.raises(ValueError, match="penalties"):
        generate(model, tok, "Hello", max_new_tokens=4, strategy=KNNLM(datastore=ds),
                   repetition_penalty=1.3)
