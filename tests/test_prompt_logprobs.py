"""Prompt log-probabilities (`GenerationParams.prompt_logprobs`): each prompt id's
log-probability given the ids before it, and the k most likely ids there, come from the
prefill itself (whole prompts, or chunked while other requests decode) and equal one plain
causal forward's log_softmax; asking for them changes no generated token, and
max_new_tokens 0 scores the prompt only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.models import forward, init_cache
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, tiny_model

TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
         "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"]
K = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


def reference(model, ids) -> np.ndarray:
    """log_softmax of one causal forward over `ids`: [T, V]."""
    T = len(ids)
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]
    logits, _ = forward(model.params, jnp.asarray([ids]), jnp.arange(T)[None], init_cache(model.config, 1, T),
                        causal, model.config)
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def check_row(model, ids, lps, top):
    ref = reference(model, ids)
    assert lps[0] is None and top[0] is None and len(lps) == len(top) == len(ids)
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lps[1:], want, atol=1e-4)
    for i in range(1, len(ids)):
        got_ids, got_v = zip(*top[i])
        np.testing.assert_allclose(got_v, np.sort(ref[i - 1])[::-1][:K], atol=1e-4)
        np.testing.assert_allclose(ref[i - 1, list(got_ids)], got_v, atol=1e-4)


@pytest.mark.parametrize("served", [False, True])
@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("strategy", [None, "lookahead"])
def test_prompt_logprobs_equal_a_plain_forward_and_change_no_token(model, chunk, strategy, served):
    """served: slots that return log-probabilities (the server's) compute the scores on
    demand (`StepInputs.scores`), the others in programs of their own."""
    tok = ByteTokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    strat = Lookahead(decoding_length=4) if strategy else None

    def run(params):
        slots = Slots(engine_for(model), tok, 2, 256, strat, prefill_chunk=chunk, logprobs=served)
        rows = {}
        slots.insert(0, Request(ids[0], GenerationParams(max_new_tokens=30)))  # decoding beside the others
        order, holder = [1, 2], {0: 0}
        while order or slots.busy:
            if order and slots.free_slots:
                s = slots.free_slots[0]
                holder[s] = i = order.pop(0)
                slots.insert(s, Request(ids[i], params))
            for ev in slots.step():
                if ev.finish:
                    rows[holder[ev.slot]] = slots.free(ev.slot)
        return rows

    plain = run(GenerationParams(max_new_tokens=12))
    scored = run(GenerationParams(max_new_tokens=12, prompt_logprobs=K))
    for i in (1, 2):
        assert scored[i].ids == plain[i].ids and plain[i].prompt_logprobs is None
        check_row(model, ids[i], scored[i].prompt_logprobs, scored[i].prompt_top)
    assert scored[0].prompt_logprobs is None  # only the requests that ask


def test_max_new_tokens_zero_scores_the_prompt_only(model):
    tok = ByteTokenizer()
    prompts = TEXTS[:2]
    out = generate(model, tok, prompts, params=GenerationParams(max_new_tokens=0, prompt_logprobs=K))
    for r, text in zip(out.rows, prompts):
        assert r.token_ids == [] and r.text == "" and r.finish_reason == "length"
        check_row(model, tok.encode(text), r.prompt_logprobs, r.prompt_top_logprobs)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        GenerationParams(max_new_tokens=0)


@pytest.mark.parametrize("strategy", ["greedy", "lookahead"])
def test_top_logprobs_of_generated_tokens_are_the_model_s(model, strategy):
    """top_logprobs k: at each generated token the k most likely ids and their
    log-probabilities where it was chosen (the prefill's first token, then verify steps that
    accept several tokens), as one plain forward over prompt + output gives them; greedy:
    the chosen token is the first of them. The tokens are those without top_logprobs."""
    tok = ByteTokenizer()
    kw = dict(strategy=strategy, **({"decoding_length": 4} if strategy == "lookahead" else {}))
    plain = generate(model, tok, TEXTS[:2], max_new_tokens=16, logprobs=True, **kw)
    out = generate(model, tok, TEXTS[:2], params=GenerationParams(max_new_tokens=16, logprobs=True, top_logprobs=K),
                   **kw)
    for r, p in zip(out.rows, plain.rows):
        assert r.token_ids == p.token_ids and len(r.top_logprobs) == len(r.token_ids)
        ctx = r.prompt_token_ids + r.token_ids
        ref = reference(model, ctx)
        for j, (t, alts) in enumerate(zip(r.token_ids, r.top_logprobs)):
            at = ref[len(r.prompt_token_ids) + j - 1]
            ids, vs = zip(*alts)
            assert len(alts) == K and ids[0] == t  # greedy: the pick is the most likely
            assert vs[0] == r.logprobs[j]  # bit for bit (clients test greediness by equality)
            np.testing.assert_allclose(vs, np.sort(at)[::-1][:K], atol=1e-4)
            np.testing.assert_allclose(at[list(ids)], vs, atol=1e-4)
        assert p.top_logprobs is None


@pytest.mark.parametrize("strategy", [None, "lookahead"])
def test_scores_on_demand_compile_nothing_of_their_own(model, strategy):
    """On slots that return log-probabilities (the server's: `Slots(logprobs=True)`) top
    and prompt log-probabilities are computed on demand: requests that ask run the very
    programs a batch without them compiled (whole and chunked prefill, plain and tree
    verify steps), and get the values a plain forward gives."""
    tok = ByteTokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    engine = engine_for(model)
    strat = Lookahead(decoding_length=4) if strategy else None

    def run(params):
        slots = Slots(engine, tok, 2, 256, strat, prefill_chunk=8, logprobs=True)
        slots.insert(0, Request(ids[0], GenerationParams(max_new_tokens=20)))
        slots.step()
        slots.insert(1, Request(ids[1], params))  # chunked: blocks while row 0 decodes
        while slots.busy:
            slots.step()
        return slots.free(1)

    plain = run(GenerationParams(max_new_tokens=12))
    n = len(engine.compiled.compilations)
    scored = run(GenerationParams(max_new_tokens=12, prompt_logprobs=K, logprobs=True, top_logprobs=K))
    assert engine.compiled.compilations[n:] == []
    assert scored.ids == plain.ids and plain.tops is None and plain.prompt_logprobs is None
    check_row(model, ids[1], scored.prompt_logprobs, scored.prompt_top)
    ref = reference(model, ids[1] + scored.ids)
    assert len(scored.tops) == len(scored.ids)
    for j, (t, alts) in enumerate(zip(scored.ids, scored.tops)):
        got_ids, got_v = zip(*alts)
        assert len(alts) == K and got_ids[0] == t and got_v[0] == scored.logprobs[j]
        np.testing.assert_allclose(got_v, np.sort(ref[len(ids[1]) + j - 1])[::-1][:K], atol=1e-4)
