"""OpenAI's `logit_bias`: applied at every position, exact under speculation (issue 52).

* `add_bias` adds each row's bias to that row's logits at every position (a row without
  one is left bitwise as it was); `RowBias` is one shape whatever a request biases.
* Applied: +100 on an id makes greedy emit it; -100 on plain greedy's first token makes
  the next most likely id come first.
* Lossless greedy (f32, 4 prompts, batch 4): lookahead (suffix drafts, trie drafts, drafts
  of the biased truth cut at depth 3: exactly 3 accepted a step) and SpecInfer (an
  unbiased draft model) give plain greedy's tokens under the same bias.
* One `Slots` batch (the server's: `penalty_rows`, lookahead) mixing rows with different
  biases, a forcing one and one without, inserted mid-decode: each row's tokens are its
  own (those of plain decoding with its bias).
* Sampling: lookahead draws plain sampling's tokens under a bias; SpecInfer's speculative
  sampler (a draft model that knows nothing of the bias) draws the first two tokens from
  softmax(logits + bias) (chi-square; the unbiased distribution is rejected by the same
  samples).
* On the server's slots (`penalty_rows`, warmed up) a request with a bias compiles nothing.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import MAX_LOGIT_BIAS, GenerationParams
from lookahead_jax.core.sampling import RowBias, SamplingParams, add_bias, filter_logits
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.generate import generate
from lookahead_jax.models import forward, init_cache
from lookahead_jax.strategies import Lookahead
from test_lossless import OracleDrafter
from tiny import ByteTokenizer, load_prompts, tiny_model

chisquare = pytest.importorskip("scipy.stats").chisquare

MAX_NEW = 16
CACHE = 512
TEXTS = [p["prompt"][:200] for p in load_prompts(2)][:4]
FORCED = 77  # an id a +100 bias forces


def drafts_accepted(out) -> bool:
    """Some step emitted more than one token (fewer forwards than tokens, over the rows)."""
    return sum(r.forward_steps for r in out.rows) < sum(len(t) for t in out.token_ids)


@pytest.fixture(scope="module")
def plain(model, tok):
    """Plain greedy (batch 4) without a bias and with `bias`: the unbiased output's most
    frequent id and each row's first id banned, two ids pushed up and down."""
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    none = generate(model, tok, TEXTS, **kw).token_ids
    common = collections.Counter(t for row in none for t in row).most_common(1)[0][0]
    bias = {common: -100.0, 101: 3.0, 66: -2.0, **{row[0]: -100.0 for row in none}}
    biased = generate(model, tok, TEXTS, logit_bias=bias, **kw).token_ids
    assert all(a != b for a, b in zip(none, biased))  # the bias changes every row
    return dict(none=none, bias=bias, biased=biased)


# ----------------------------------------------------------------------------- the math
def test_add_bias_adds_each_rows_bias_at_every_position():
    rng = np.random.default_rng(0)
    B, T, V = 3, 4, 50
    logits = jnp.asarray(rng.normal(size=(B, T, V)).astype(np.float32))
    biases = [((3, 100.0), (7, -2.5)), (), ((0, -100.0), (49, 0.5))]
    rb = RowBias.of(biases)
    assert rb.ids.shape == rb.values.shape == (B, MAX_LOGIT_BIAS)
    got = np.asarray(jax.jit(add_bias)(logits, rb))
    want = np.asarray(logits).copy()
    for b, pairs in enumerate(biases):
        for t, v in pairs:
            want[b, :, t] += v
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[1], np.asarray(logits[1]))  # no bias: bitwise the same
    none = np.asarray(jax.jit(add_bias)(logits, RowBias.of([()] * B)))
    np.testing.assert_array_equal(none, np.asarray(logits))


def test_the_bias_is_applied(model, tok, plain):
    """+100 on an id: greedy emits only it; -100 on plain greedy's first id: the first id
    is the next most likely one (the unbiased step's second alternative)."""
    forced = generate(model, tok, TEXTS[:2], max_new_tokens=4, max_cache_len=CACHE, logit_bias={FORCED: 100})
    assert forced.token_ids == [[FORCED] * 4] * 2
    top2 = generate(model, tok, TEXTS[0], max_cache_len=CACHE,
                    params=GenerationParams(max_new_tokens=1, logprobs=True, top_logprobs=2)).rows[0].top_logprobs[0]
    first, second = top2[0][0], top2[1][0]
    assert first == plain["none"][0][0]
    banned = generate(model, tok, TEXTS[0], max_new_tokens=1, max_cache_len=CACHE, logit_bias={str(first): -100})
    assert banned.token_ids[0] == [second]


# ----------------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("how", ["suffix", "trie", "oracle", "specinfer"])
def test_speculation_equals_plain_greedy_under_the_bias(model, tok, plain, how):
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, logit_bias=plain["bias"])
    truth = plain["biased"]
    if how == "specinfer":  # the draft is not biased: every pick the bias moves is the verifier's
        out = generate(model, tok, TEXTS, strategy="specinfer", draft_model=model, draft_weights="float32",
                       expansion=(2, 2, 1), budget="fixed", **kw)
    elif how == "oracle":  # the biased truth, wrong at depth 3: 3 drafts accepted every step
        out = generate(model, tok, TEXTS, strategy="lookahead", drafter=OracleDrafter(truth, 3),
                       decoding_length=16, **kw)
        assert all(r.forward_steps == 1 + -(-(MAX_NEW - 1) // 4) for r in out.rows)
    else:  # the biased outputs as references: deep accepted paths
        refs = [[tok.decode(ids)] for ids in truth]
        drafter = TrieDrafter(max_nodes=8) if how == "trie" else None
        out = generate(model, tok, TEXTS, strategy="lookahead", decoding_length=8, references=refs,
                       drafter=drafter, **kw)
    assert out.token_ids == truth
    assert drafts_accepted(out)


def test_mixed_slots_batch_each_row_its_own_bias(model, tok, plain):
    """The server's slots (`penalty_rows`, lookahead): requests with different biases, a
    forcing one and one without, inserted while others decode, each give plain greedy's
    tokens with their own bias (rows are independent: the batch-4 references hold)."""
    slots = Slots(engine_for(model), tok, 2, CACHE, Lookahead(decoding_length=7), penalty_rows=True)
    want = {0: plain["none"][0], 1: plain["biased"][1], 2: [FORCED] * MAX_NEW, 3: plain["biased"][3]}
    bias = {0: (), 1: plain["bias"], 2: {FORCED: 100.0}, 3: plain["bias"]}
    queue, got, holder, n = [0, 1, 2, 3], {}, {}, 0
    while queue or slots.busy:
        if queue and slots.free_slots and n % 2 == 0:
            i, s = queue.pop(0), slots.free_slots[-1]
            holder[s] = i
            slots.insert(s, Request(tok.encode(TEXTS[i]), GenerationParams(max_new_tokens=MAX_NEW,
                                                                            logit_bias=bias[i])))
        for ev in slots.step():
            if ev.finish:
                got[holder[ev.slot]] = slots.free(ev.slot).ids
        n += 1
    assert got == want


# ----------------------------------------------------------------------------- sampling
def test_lookahead_sampling_equals_plain_sampling(model, tok, plain):
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, temperature=0.8, top_k=40, seed=5,
              logit_bias=plain["bias"])
    ref = generate(model, tok, TEXTS, **kw).token_ids
    refs = [[tok.decode(ids)] for ids in ref]
    la = generate(model, tok, TEXTS, strategy="lookahead", decoding_length=8, references=refs, **kw)
    assert la.token_ids == ref and drafts_accepted(la)


SMALL_V = 8
SMALL_BIAS = {4: 1.5, 6: -1.0, 7: -100.0, 2: 0.7}


def _two_tokens(model, prompt, sp, bias):
    """P(t1, t2 | prompt) of plain sampling with `sp` from softmax(logits + bias), from
    full forwards (numpy adds the bias: an independent path)."""
    seqs = np.array([prompt + [a] for a in range(SMALL_V)], np.int32)  # [V, P+1]
    n = seqs.shape[1]
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), seqs.shape)
    mask = np.broadcast_to(np.tril(np.ones((n, 16), bool)), (SMALL_V, n, 16))
    logits, _ = forward(model.params, seqs, pos, init_cache(model.config, SMALL_V, 16), mask, model.config)
    add = np.zeros(SMALL_V, np.float32)
    for t, v in bias.items():
        add[t] = v
    p = np.asarray(jax.nn.softmax(filter_logits(jnp.asarray(np.asarray(logits) + add), sp), axis=-1), np.float64)
    return (p[0, -2][:, None] * p[:, -1]).reshape(-1)  # [t1 * V + t2]


def _chi2(counts, probs):
    """Chi-square p-value of counts against probabilities (cells expecting <= 5 dropped;
    a sample in a cell of probability 0 fails outright)."""
    if counts[probs == 0].sum():
        return 0.0
    keep = probs * counts.sum() > 5
    obs = counts[keep]
    return chisquare(obs, probs[keep] / probs[keep].sum() * obs.sum()).pvalue


@pytest.mark.parametrize("rows", [pytest.param(4000), pytest.param(20_000, marks=pytest.mark.slow)])
def test_speculative_sampling_follows_the_biased_distribution(rows):
    """SpecInfer's speculative sampler with a draft model that knows nothing of the bias:
    the first two tokens follow softmax(logits + bias) (the target's, verified against),
    and the same samples reject the unbiased distribution."""
    dims = dict(vocab_size=SMALL_V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, head_scale=1.0)
    target, draft = tiny_model("llama", seed=3, **dims), tiny_model("llama", seed=4, **dims)
    prompt, sp = [1, 5, 3], SamplingParams(1.0)
    out = generate(target, ByteTokenizer(), [prompt] * rows, max_new_tokens=2, strategy="specinfer",
                   draft_model=draft, expansion=(2, 2), budget="fixed", temperature=1.0, seed=11, ignore_eos=True,
                   max_cache_len=16, logit_bias=SMALL_BIAS)
    ids = np.array(out.token_ids)
    counts = np.bincount(ids[:, 0] * SMALL_V + ids[:, 1], minlength=SMALL_V ** 2).astype(np.float64)
    assert _chi2(counts, _two_tokens(target, prompt, sp, SMALL_BIAS)) > 1e-3
    assert _chi2(counts, _two_tokens(target, prompt, sp, {})) < 1e-6


# ----------------------------------------------------------------------------- compilation
@pytest.mark.parametrize("strategy", ["plain", "lookahead"])
def test_bias_compiles_nothing_on_the_servers_slots(model, tok, strategy):
    """On slots built as the server builds them (`penalty_rows`, `fallback`, chunked
    prefill) and warmed up, requests without a bias and then with biases (a ban, a push,
    a forcing +100) compile nothing: a bias is data, [B, MAX_LOGIT_BIAS] whatever it
    holds; the biased tokens are plain decoding's with the same bias."""
    strat = {"plain": None, "lookahead": Lookahead(decoding_length=7)}[strategy]
    engine = engine_for(model)
    ids = [tok.encode(t)[:40] for t in TEXTS[:2]]
    slots = Slots(engine, tok, 2, CACHE, strat, penalty_rows=True, fallback=True, prefill_chunk=64)
    slots.warm_up()
    n = len(engine.compiled.compilations)

    def run(biases):
        slots.insert([0, 1], [Request(x, GenerationParams(max_new_tokens=8, logit_bias=b)) for x, b in zip(ids, biases)])
        while slots.busy:
            slots.step()
        return [slots.free(s).ids for s in range(2)]

    unbiased = run([(), ()])
    biases = [{unbiased[0][0]: -100.0, 101: 3.0}, {FORCED: 100.0}]
    got = run(biases)
    assert engine.compiled.compilations[n:] == []
    kw = {} if strat is None else dict(strategy="lookahead", decoding_length=7)
    want = generate(model, tok, [tok.decode(ids[0])], max_new_tokens=8, max_cache_len=CACHE, logit_bias=biases[0],
                    **kw).token_ids[0]
    assert got == [want, [FORCED] * 8] and got[0] != unbiased[0]
