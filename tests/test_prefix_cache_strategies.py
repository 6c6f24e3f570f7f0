"""The prefix cache under the strategies that tests/test_prefix_cache.py (greedy, lookahead,
sampling) and tests/test_prefix_cache_ralm.py (RaLM, RaLMSpec) do not run: SpecInfer (the
target's prompt blocks and the draft model's units come from their caches) and KNN-LM,
plain and speculative (a run whose prompts are forwarded whole, in the block size's
pieces). Each: requests sharing a passage through slots with chunked prefill and the
cache give, token for token (and log-probability for log-probability for KNN-LM), what
they give without the cache, in a first pass and a second in which every block is cached;
the cache served prompt tokens."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax import KNNLM
from lookahead_jax.core.engine import Engine
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.knnlm import build_datastore, load_datastore
from lookahead_jax.retrieval import Corpus
from lookahead_jax.strategies import SpecInfer
from tiny import drive_slots, load_prompts, tiny_model

C = 16
BUDGET = 64 << 20
PASSAGE = load_prompts()[0]["prompt"][:90]
TEXTS = [PASSAGE + q for q in (" Who wrote it?", " What is it about?", " When?")] + \
    [p["prompt"][-40:] for p in load_prompts(1)]


def through(engine, tok, strat, budget, logprobs=False) -> tuple:
    """TEXTS (twice over: the second half hits everything) through 2 slots with chunked
    prefill: per request (ids, log-probabilities), and the slots."""
    slots = Slots(engine, tok, 2, 512, strat, prefill_chunk=C, prefix_cache=budget, logprobs=logprobs)
    reqs = [Request(tok.encode(t), GenerationParams(max_new_tokens=16), sampling_row=i)
            for i, t in enumerate(TEXTS + TEXTS)]
    try:
        got = drive_slots(slots, reqs, every=3)
    finally:
        slots.close()
    for row, streamed in got:
        assert row.ids == streamed
    return [(row.ids, row.logprobs) for row, _ in got], slots


def test_specinfer_with_the_cache(model, tok):
    strat = SpecInfer(draft_model=tiny_model("llama", seed=2), expansion=(1, 1, 2), budget="fixed")
    engine = Engine(model)
    want, _ = through(engine, tok, strat, None)
    got, slots = through(engine, tok, strat, BUDGET)
    assert got == want
    n = len(TEXTS)
    assert [ids for ids, _ in want[:n]] == [ids for ids, _ in want[n:]]  # (the same requests twice)
    assert slots.prefix.cache.hits > 0 and slots.prefix.cache.hit_requests >= n
    assert slots.drafter.prefix.cache.hit_requests >= n  # (the draft's: tests/test_specinfer_prefix.py)


@pytest.fixture(scope="module")
def datastore(model, tok, tmp_path_factory):
    out = generate(model, tok, TEXTS, max_new_tokens=30)
    passages = [t + out.texts[i] for i, t in enumerate(TEXTS)]
    rng = np.random.default_rng(0)
    words = " ".join(out.texts).split()
    passages += [" ".join(rng.choice(words, int(rng.integers(3, 10)))) for _ in range(12)]
    corpus = Corpus.from_passages(passages)
    path = build_datastore(model, tok, corpus, path=tmp_path_factory.mktemp("knn") / "ds", progress=False)
    return load_datastore(model, corpus, path)


@pytest.mark.parametrize("speculative", [False, True])
def test_knnlm_with_the_cache(model, tok, datastore, speculative):
    strat = KNNLM(datastore=datastore, knn_k=4, speculative=speculative, speculation_stride=3)
    engine = Engine(model)
    want, _ = through(engine, tok, strat, None, logprobs=True)
    got, slots = through(engine, tok, strat, BUDGET, logprobs=True)
    assert got == want
    assert slots.prefix.cache.hits > 0 and slots.prefix.cache.hit_requests >= len(TEXTS)
