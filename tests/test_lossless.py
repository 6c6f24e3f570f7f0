"""Losslessness: every accelerated path emits exactly plain decoding's tokens (f32).

Tiny random models (fast) over 54 prompts from RAG passages, HumanEval and GSM8K; every
lookahead mode x budget x branch length; batch 1 and 4; EOS and stop strings; warm and
cold tries; drafts that force partial and zero acceptance; sampling with the same seed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from lookahead_jax.generate import generate
from lookahead_jax.drafters.base import PerRowDrafter
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.drafters.ngram_trie import Draft, NgramTrie
from tiny import ByteTokenizer, load_prompts, tiny_model

MAX_NEW = 32
CACHE = 1280  # one cache length for every call keeps compilations few
PROMPTS = load_prompts(18)  # 54 prompts, 18 per source
TEXTS = [p["prompt"] for p in PROMPTS]
REFS = [[p["reference"]] for p in PROMPTS]


def run(model, tok, batch, **kw):
    """Generate all TEXTS in batches of `batch`; returns (token ids, total steps, outputs)."""
    ids, steps, rows = [], 0, []
    for s in range(0, len(TEXTS), batch):
        refs = REFS[s:s + batch] if kw.get("strategy") == "lookahead" else None
        out = generate(model, tok, TEXTS[s:s + batch], max_new_tokens=MAX_NEW, references=refs,
                         max_cache_len=CACHE, **kw)
        ids += out.token_ids
        steps += out.stats["forward_steps"]
        rows += out.rows
    return ids, steps, rows


@pytest.fixture(scope="module")
def greedy(model, tok):
    return {b: run(model, tok, b)[0] for b in (1, 4)}


def test_batched_greedy_equals_unbatched(greedy):
    assert greedy[1] == greedy[4]


def _grid(combos, fast):
    """pytest params of `combos`; those not in `fast` are marked slow (CI runs them all,
    `python -m pytest` a spread: every mode, budget and branch length at least once)."""
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow) for c in combos]


BATCH4 = [(m, b, br) for br in (1, 4, 12) for b in (1, 8, 32, 128) for m in ("hierarchical", "parallel", "single")]
BATCH4_FAST = {("hierarchical", 1, 12), ("hierarchical", 32, 4), ("parallel", 8, 12), ("single", 32, 1)}


@pytest.mark.parametrize("mode,budget,branch", _grid(BATCH4, BATCH4_FAST))
def test_lookahead_equals_greedy_batch4(model, tok, greedy, mode, budget, branch):
    drafter = TrieDrafter(branch_length=branch, mode=mode, max_nodes=budget)  # cold trie
    ids, steps, rows = run(model, tok, 4, strategy="lookahead", decoding_length=budget,
                           branch_length=branch, mode=mode, drafter=drafter)
    assert ids == greedy[4]
    # the reference passages make drafts accept: fewer forwards than tokens
    assert steps < sum(len(x) for x in ids)


BATCH1 = [(m, b, br) for b, br in ((1, 12), (8, 4), (32, 12), (128, 1), ("auto", 12))
          for m in ("hierarchical", "parallel", "single")]
BATCH1_FAST = {("hierarchical", "auto", 12), ("parallel", 8, 4), ("single", 128, 1)}


@pytest.mark.parametrize("mode,budget,branch", _grid(BATCH1, BATCH1_FAST))
def test_lookahead_equals_greedy_batch1(model, tok, greedy, mode, budget, branch):
    ids, _, _ = run(model, tok, 1, strategy="lookahead", decoding_length=budget,
                    branch_length=branch, mode=mode,
                    drafter=TrieDrafter(branch_length=branch, mode=mode))
    assert ids == greedy[1]


@pytest.mark.parametrize("drafts", ["trie", "suffix"])
def test_warm_global_trie(model, tok, greedy, drafts):
    """The shared trie (drafts="trie") or the suffix drafter's cache of earlier outputs (the
    default) keeps outputs across calls: the second pass accepts more, same tokens."""
    m = tiny_model("llama", seed=1)  # fresh model object -> fresh global trie / output cache
    ids1, steps1, _ = run(m, tok, 4, strategy="lookahead", decoding_length=32, drafts=drafts)
    ids2, steps2, _ = run(m, tok, 4, strategy="lookahead", decoding_length=32, drafts=drafts)
    assert ids1 == greedy[4] and ids2 == greedy[4]
    assert steps2 < steps1


class OracleDrafter(PerRowDrafter):
    """Proposes the true continuation (from a reference run) corrupted at depth `cut`, plus
    a random branch: exactly `cut` drafts must be accepted per step (partial acceptance);
    cut = 0 gives zero acceptance."""

    def __init__(self, truth, cut, seed=0):
        self.truth, self.cut, self.rng = truth, cut, random.Random(seed)
        self.max_nodes = 16

    def begin(self, state, references=None):
        self.n_prompt = [len(r.prompt_ids) for r in state.rows]

    def propose_row(self, row, context, budget):
        g = len(context) - self.n_prompt[row]
        true = self.truth[row][g:g + 8]
        toks, parents = [], []
        for i, t in enumerate(true):
            toks.append(t if i != self.cut else (t + 1) % 259)
            parents.append(len(toks) - 2 if i else -1)
        prev = -1
        for i in range(min(4, len(true))):  # a branch that is wrong at its first token
            toks.append((true[i] + 1 + self.rng.randrange(257)) % 259)
            parents.append(prev)
            prev = len(toks) - 1
        return Draft(toks[:budget], parents[:budget])


@pytest.mark.parametrize("cut", [0, 1, 3, 8])
def test_forced_partial_and_zero_acceptance(model, tok, greedy, cut):
    batch = TEXTS[:4]
    truth = greedy[4][:4]
    out = generate(model, tok, batch, max_new_tokens=MAX_NEW, strategy="lookahead",
                     drafter=OracleDrafter(truth, cut), decoding_length=16, max_cache_len=CACHE)
    assert out.token_ids == truth
    for r in out.rows:
        # prefill gives 1 token; each later step gives cut + 1 (until the budget runs out)
        expected_steps = 1 + -(-(MAX_NEW - 1) // (cut + 1))
        assert r.forward_steps == expected_steps, (cut, r.forward_steps)


class GarbageDrafter(OracleDrafter):
    def propose_row(self, row, context, budget):
        toks = [self.rng.randrange(259) for _ in range(budget)]
        parents = [self.rng.randrange(-1, i) for i in range(budget)]  # random tree
        return Draft(toks, parents)


def test_garbage_drafts_are_harmless(model, tok, greedy):
    d = GarbageDrafter(None, 0)
    d.max_nodes = 32
    ids, _, rows = run(model, tok, 4, strategy="lookahead", drafter=d, decoding_length=32)
    assert ids == greedy[4]


def test_wrong_trie_is_harmless(model, tok, greedy):
    """A trie filled with unrelated n-grams (wrong references) still gives identical output."""
    rng = np.random.default_rng(0)
    trie = NgramTrie(branch_length=6)
    trie.insert_output(rng.integers(3, 259, 5000).tolist(), req="junk")
    trie.end_request("junk")
    d = TrieDrafter(branch_length=6, trie=trie, max_nodes=32)
    wrong = [["".join(chr(rng.integers(97, 123)) for _ in range(300))] for _ in TEXTS]
    ids = []
    for s in range(0, len(TEXTS), 4):
        out = generate(model, tok, TEXTS[s:s + 4], max_new_tokens=MAX_NEW, strategy="lookahead",
                         drafter=d, decoding_length=32, references=wrong[s:s + 4],
                         max_cache_len=CACHE)
        ids += out.token_ids
    assert ids == greedy[4]


def test_eos_mid_batch(model, greedy):
    """Rows end at an EOS token at different steps; lookahead ends them identically."""
    eos = greedy[4][1][10]  # a token row 1 emits at step 10 (other rows: wherever it occurs)
    tok = ByteTokenizer()
    tok.eos_token_ids = {eos}
    batch = TEXTS[:4]
    ref = generate(model, tok, batch, max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    assert ref.rows[1].finish_reason == "eos" and ref.rows[1].token_ids[-1] == eos
    assert len({len(r.token_ids) for r in ref.rows}) > 1  # rows finish at different steps
    for budget in (8, 32):
        out = generate(model, tok, batch, max_new_tokens=MAX_NEW, strategy="lookahead",
                         decoding_length=budget, references=REFS[:4], max_cache_len=CACHE,
                         drafter=TrieDrafter(max_nodes=budget))
        assert out.token_ids == ref.token_ids
        assert [r.finish_reason for r in out.rows] == [r.finish_reason for r in ref.rows]


def test_stop_strings(model, tok, greedy):
    batch = TEXTS[4:8]
    texts = [tok.decode(g) for g in greedy[4][4:8]]
    stop = texts[0][12:14]
    ref = generate(model, tok, batch, max_new_tokens=MAX_NEW, stop=[stop], max_cache_len=CACHE)
    assert ref.rows[0].finish_reason == "stop" and stop not in ref.rows[0].text
    out = generate(model, tok, batch, max_new_tokens=MAX_NEW, stop=[stop], strategy="lookahead",
                     decoding_length=32, references=REFS[4:8], max_cache_len=CACHE)
    assert out.token_ids == ref.token_ids and out.texts == ref.texts


@pytest.mark.parametrize("temperature,top_k,top_p", _grid([(1.0, 0, 1.0), (0.7, 20, 0.9)], {(0.7, 20, 0.9)}))
@pytest.mark.parametrize("drafts", ["suffix", "trie"])
def test_lookahead_sampling_equals_plain_sampling(model, tok, temperature, top_k, top_p, drafts):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    ref, _, _ = run(model, tok, 4, **kw)
    ids, steps, _ = run(model, tok, 4, strategy="lookahead", decoding_length=32, drafts=drafts, **kw)
    assert ids == ref
    other = generate(model, tok, TEXTS[:8], max_new_tokens=MAX_NEW, max_cache_len=CACHE, **{**kw, "seed": 99})
    assert other.token_ids != ref[:8]  # the seed matters


def test_sampling_rng_is_keyed_by_row_and_position(model, tok):
    """The same prompt as row 0 of two different batches samples the same tokens."""
    kw = dict(max_new_tokens=16, temperature=1.0, seed=7, max_cache_len=CACHE)
    a = generate(model, tok, [TEXTS[0], TEXTS[1]], **kw)
    b = generate(model, tok, [TEXTS[0], TEXTS[5], TEXTS[9]], **kw)
    assert a.token_ids[0] == b.token_ids[0]


@pytest.mark.slow  # CI's full run (the default run keeps its siblings)
def test_n_samples_and_stop_token_ids_under_lookahead(model, tok):
    """n samples per prompt are rows of their own (distinct tokens), and lookahead gives
    plain sampling's; stop_token_ids end rows like EOS, identically under lookahead."""
    kw = dict(max_new_tokens=16, temperature=1.0, seed=3, max_cache_len=CACHE, n=3)
    ref = generate(model, tok, TEXTS[:2], **kw)
    assert [(r.prompt_index, r.sample_index) for r in ref.rows] == [(i, j) for i in range(2) for j in range(3)]
    assert len({tuple(t) for t in ref.token_ids[:3]}) == 3  # three different samples of prompt 0
    out = generate(model, tok, TEXTS[:2], strategy="lookahead", decoding_length=16, references=REFS[:2], **kw)
    assert out.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="need temperature > 0"):
        generate(model, tok, TEXTS[:1], n=2)
    g = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    stop_id = g.token_ids[0][5]
    ref = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE, stop_token_ids=[stop_id])
    assert ref.token_ids[0] == g.token_ids[0][:g.token_ids[0].index(stop_id) + 1]
    assert ref.rows[0].finish_reason == "eos"
    out = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE, stop_token_ids=[stop_id],
                     strategy="lookahead", decoding_length=16, references=REFS[:4])
    assert out.token_ids == ref.token_ids
    with pytest.raises(ValueError, match="stop_token_ids"):
        generate(model, tok, TEXTS[:1], stop_token_ids=[10**6])


def teacher_forced_logprobs(model, prompt_ids, out_ids):
    """log p(out_ids[i] | prompt, out_ids[:i]) from one causal forward of the whole text."""
    import jax
    import jax.numpy as jnp

    from lookahead_jax.models import forward, init_cache

    ids = list(prompt_ids) + list(out_ids)
    L = len(ids)
    pos = jnp.arange(L)[None]
    mask = pos[:, :, None] >= jnp.arange(L)[None, None, :]
    logits, _ = forward(model.params, jnp.asarray([ids]), pos, init_cache(model.config, 1, L), mask, model.config)
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    return [float(lp[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(out_ids)]


@pytest.mark.slow  # CI's full run (the default run keeps its siblings)
def test_min_new_tokens_and_logprobs_are_exact_under_speculation(model, greedy):
    """min_new_tokens bans EOS (and stop ids) until that many tokens are out, in plain
    decoding and inside every verify step alike; logprobs are the model's log-probability
    of each emitted token (checked against one teacher-forced forward). Lookahead and
    SpecInfer give plain decoding's tokens and logprobs with both, batch 4, EOS mid-batch."""
    eos = greedy[4][1][10]  # row 1 emits it at step 10
    tok = ByteTokenizer()
    tok.eos_token_ids = {eos}
    batch = TEXTS[:4]
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, logprobs=True)
    plain = generate(model, tok, batch, **kw)
    r1 = plain.rows[1]
    assert r1.finish_reason == "eos" and len(r1.token_ids) <= 11
    for r in plain.rows:
        assert len(r.logprobs) == len(r.token_ids)
        np.testing.assert_allclose(r.logprobs, teacher_forced_logprobs(model, r.prompt_token_ids, r.token_ids),
                                   rtol=0, atol=2e-4)
    assert generate(model, tok, batch, max_new_tokens=MAX_NEW, max_cache_len=CACHE).rows[0].logprobs is None
    low = generate(model, tok, batch, min_new_tokens=20, **kw)
    m1 = low.rows[1]
    assert m1.token_ids[:len(r1.token_ids) - 1] == r1.token_ids[:-1]  # the same until the banned EOS
    assert eos not in m1.token_ids[:20] and len(m1.token_ids) > 20
    np.testing.assert_allclose(m1.logprobs, teacher_forced_logprobs(model, m1.prompt_token_ids, m1.token_ids),
                               rtol=0, atol=2e-4)  # the model's own log-probabilities (no ban)
    fast = [dict(strategy="lookahead", decoding_length=16, references=REFS[:4]),
            dict(strategy="specinfer", draft_model=model, draft_weights="float32", expansion=(2, 2, 1),
                 budget="fixed")]
    for strat in fast:
        for min_new, want in ((0, plain), (20, low)):
            out = generate(model, tok, batch, min_new_tokens=min_new, **kw, **strat)
            assert out.token_ids == want.token_ids, (strat["strategy"], min_new)
            assert out.stats["forward_steps"] < want.stats["forward_steps"]  # drafts were accepted
            for a, b in zip(out.rows, want.rows):  # the same up to the float rounding of the verify
                # block's shapes against one-token steps (~2e-6 relative seen on an AVX-512 host)
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    # sampling: the ban and the logprobs are the same under lookahead's verification
    skw = dict(kw, temperature=1.0, seed=5, min_new_tokens=20)
    ref = generate(model, tok, batch, **skw)
    out = generate(model, tok, batch, strategy="lookahead", decoding_length=16, references=REFS[:4], **skw)
    assert out.token_ids == ref.token_ids
    assert all(eos not in r.token_ids[:20] for r in ref.rows)
    for a, b in zip(out.rows, ref.rows):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="min_new_tokens"):
        generate(model, tok, batch, min_new_tokens=-1)

