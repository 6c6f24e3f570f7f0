"""The prefix cache in the retrieval strategies (issue 53): a RaLM / RaLMSpec run's slots
with `prefill_chunk` and `prefix_cache` forward their whole prompts (passage before the
question) in the block size's pieces, storing each committed unit, and a re-prefill after
a passage change starts at a unit boundary and takes the new context's cached units
(`decode.replace_prompt`, `PrefixRows.take`).

* Lossless: RaLM and RaLMSpec (bm25, stride 2; RaLMSpec forced always wrong: rollbacks)
  through 2 slots with the cache give each request's tokens and passages of RaLM without
  it, in a first pass (hits from other rows' passages) and a second (every passage cached).
* The cache serves re-prefills: in the second pass (every context seen before) each
  re-prefill forwards at most one block, fewer tokens than without the cache.
* A dense retriever (RaLMSpec, OS3's auto stride): the same.
* `generate(prefix_cache=)` with RaLM / RaLMSpec: the tokens and passages without it.
"""

from __future__ import annotations

import dataclasses

import pytest

from lookahead_jax import retrieval as R
from lookahead_jax.core.engine import Engine
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.prefix_cache import PrefixCache
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.strategies import RaLM, RaLMSpec
from tiny import drive_slots, load_prompts, own_word_passages

MAX_NEW = 24
C = 16  # prefill chunk: units of 15 slots
BUDGET = 64 << 20
PROMPTS = [r["prompt"][:60] for r in load_prompts(3)]  # 9 prompts, 3 sources
ORDER = [4, 0, 7, 2, 5, 4, 1]  # prompt 4 twice: its first passage is cached the second time


@pytest.fixture(scope="module")
def corpus(model, tok) -> R.Corpus:
    """80 passages of 3-11 words of the model's own output (the passage really changes)."""
    return R.Corpus.from_passages(own_word_passages(model, tok, PROMPTS, 80, 48))


@pytest.fixture(scope="module")
def bm25(corpus):
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    return R.BM25Retriever.build(corpus, progress=False)


class Wrong:
    """Speculation always wrong (a passage other than the full index's top-1): rollbacks."""

    def __init__(self, inner):
        self.inner, self.corpus = inner, inner.corpus

    def retrieve(self, queries, k):
        return self.inner.retrieve(queries, k)

    def retrieve_from(self, queries, candidates, k):
        ids, scores = self.inner.retrieve(queries, k)
        return (ids + 1) % len(self.corpus), scores


def alone(model, tok, strat, i: int):
    """Prompt i alone through `generate` (whole prompts, no cache): the reference."""
    return generate(model, tok, [PROMPTS[i]], strategy=strat, max_new_tokens=MAX_NEW)


def through_slots(engine, tok, strat, budget):
    """ORDER's prompts through 2 slots with chunked prefill (and the prefix cache when
    `budget`): per request (tokens, passages), and the run's retrieval counters."""
    slots = Slots(engine, tok, 2, 1024, strat, prefill_chunk=C, prefix_cache=budget)
    try:
        got = drive_slots(slots, [Request(tok.encode(PROMPTS[i]), GenerationParams(max_new_tokens=MAX_NEW))
                                  for i in ORDER])
        counters = slots.run.counters()
    finally:
        slots.close()
    for row, streamed in got:
        assert row.ids == streamed
    return [(row.ids, row.retrieval["passages"]) for row, _ in got], counters, slots


@pytest.mark.parametrize("kind", ["ralm", "ralmspec-wrong"])
def test_retrieval_runs_with_the_cache_are_lossless_and_hit(model, tok, bm25, kind):
    strat = RaLM(retriever=bm25, stride=2, query_tokens=16) if kind == "ralm" else \
        RaLMSpec(retriever=Wrong(bm25), stride=2, query_tokens=16, speculation_stride=2)
    engine = Engine(model)  # its own stores: this test's prefix cache
    plain = RaLM(retriever=bm25, stride=2, query_tokens=16)
    want = []
    for i in ORDER:
        ref = alone(model, tok, plain, i)
        want.append((ref.token_ids[0], ref.rows[0].retrieval["passages"]))
    without, c0, _ = through_slots(engine, tok, strat, None)
    first, c1, slots = through_slots(engine, tok, strat, BUDGET)
    s1 = dict(slots.prefix.cache.summary())
    second, c2, slots = through_slots(engine, tok, strat, BUDGET)
    s2 = slots.prefix.cache.summary()
    assert without == want and first == want and second == want
    assert c0["reprefills"] == c1["reprefills"] == c2["reprefills"] > 0
    # the second pass: every passage cached, so its re-prefills forward less than without the
    # cache (which keeps only the prefix shared with the old context, e.g. the BOS)
    assert s2["prefix_cache_hits"] > s1["prefix_cache_hits"] > 0
    assert c2["reprefill_tokens"] < c0["reprefill_tokens"]
    # the second pass saw every context before (same tokens, same passages): each re-prefill
    # takes every unit of its new context but the last block from the cache, so it forwards
    # at most one block (C tokens)
    assert c2["reprefill_tokens"] <= c2["reprefills"] * C < c0["reprefill_tokens"]
    assert s2["prefix_cache_bytes"] <= BUDGET


def test_dense_retriever_with_the_cache(model, tok, corpus):
    """RaLMSpec with a dense retriever (OS3's auto stride, prefetch) and the cache gives
    RaLM's tokens without it; its re-prefills hit the second time."""
    import numpy as np

    def encode(texts):  # hashed character bigrams, L2-normalised
        import zlib

        out = np.zeros((len(texts), 64), np.float32)
        for i, t in enumerate(texts):
            for a, b in zip(t, t[1:]):
                out[i, zlib.crc32((a + b).encode("utf-8", "surrogatepass")) % 64] += 1.0
            out[i] /= max(np.linalg.norm(out[i]), 1e-9)
        return out

    dense = R.DenseRetriever(encode(corpus.all_contents()), encode, corpus=corpus)
    kw = dict(retriever=dense, stride=1, query_tokens=8)
    want = []
    for i in ORDER:
        ref = alone(model, tok, RaLM(**kw), i)
        want.append((ref.token_ids[0], ref.rows[0].retrieval["passages"]))
    engine = Engine(model)
    spec = RaLMSpec(**kw, speculation_stride="auto", prefetch=5)
    first, _, _ = through_slots(engine, tok, spec, BUDGET)
    second, c2, slots = through_slots(engine, tok, dataclasses.replace(spec), BUDGET)
    assert first == want and second == want
    assert c2["reprefills"] > 0 and slots.prefix.cache.hits > 0
    engine.stores.clear(PrefixCache)


@pytest.mark.parametrize("kind", ["ralm", "ralmspec"])
def test_generate_with_the_cache(model, tok, bm25, kind):
    """`generate(prefix_cache=)` with a retrieval strategy (its slots prefill in blocks of
    64 with the cache): every row's tokens and passages are those without it, in a first
    call and a second whose prompts and passages are all cached."""
    from lookahead_jax.core.engine import engine_for

    strat = RaLM(retriever=bm25, stride=2, query_tokens=16) if kind == "ralm" else \
        RaLMSpec(retriever=bm25, stride=2, query_tokens=16, speculation_stride=2)
    prompts = [PROMPTS[i] for i in ORDER]
    want = generate(model, tok, prompts, strategy=strat, max_new_tokens=MAX_NEW)
    engine_for(model).stores.clear(PrefixCache)
    for call in range(2):
        got = generate(model, tok, prompts, strategy=strat, max_new_tokens=MAX_NEW, prefix_cache=BUDGET,
                       max_cache_len=1024)
        assert got.token_ids == want.token_ids, f"call {call}"
        assert got.stats["passages"] == want.stats["passages"]
    assert got.stats["prefix_cache_hits"] > 0
