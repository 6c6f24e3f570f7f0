"""The decode loop `generate()` on tiny random models (f32, no real weights).

1. Greedy `generate` == a naive loop that re-runs one full causal forward of the whole
   sequence per token (fresh cache, no reuse) and takes the argmax: batch 1 and a batch of
   3 right-padded prompts of different lengths; llama, qwen2 and gemma3 (prompts longer
   than gemma3's sliding window of 16).
2. Cached incremental decoding (generate's prefill + verify steps, including a tree step
   whose accepted path is not contiguous in the cache) == one full forward: logits within
   1e-4, same argmax.
3. Argument errors raise ValueError with a message that names the problem.
4. Stats: forward steps, mean accepted tokens, compile time kept apart from wall time,
   a small and known number of compilations.
5. Streaming: the deltas passed to `on_text` concatenate to the final text.
6. chat=True goes through the tokenizer's chat template.

Losslessness of lookahead against greedy is in test_lossless.py, not repeated here.
"""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# `lookahead_jax.generate` (the attribute) may be the function re-exported by the package,
# so the module is taken from sys.modules once `from ... import` has loaded it.
from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.tree import verify_block
from lookahead_jax.generate import generate
from lookahead_jax.core.inputs import StepInputs, StepMode
from lookahead_jax.core.verify import jitted_extend
from lookahead_jax import presets
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.loading import load, parse_dtype
from lookahead_jax.models import forward, init_cache
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.drafters.ngram_trie import Draft
from lookahead_jax.core.verify import jitted_verify_step, tree_mask, window_for
from tiny import ByteTokenizer, tiny_model


FAMILIES = ("llama", "qwen2", "gemma3")
MAX_NEW = 12
FULL_LEN = 64  # the reference forward pads every sequence to this many tokens (one compile)
WINDOW = 16  # tiny gemma3's sliding window (tests/tiny.py)
# byte lengths 5, 23 and 40 (+ BOS): different prompt lengths in one right-padded batch
PROMPTS = ["Hi yo", "The quick brown fox jum", "In 1905 Einstein published four papers o"]
LONG = PROMPTS[2]
assert len(LONG) + 1 > WINDOW and len(LONG) + 1 + MAX_NEW <= FULL_LEN


class NoEosTokenizer(ByteTokenizer):
    """Byte tokenizer without EOS: every row runs exactly max_new_tokens."""

    eos_token_ids = frozenset()


@pytest.fixture(scope="module")
def tok():
    return NoEosTokenizer()


@pytest.fixture(scope="module")
def models():
    """One tiny model per family, shared so their compiled steps are reused."""
    return {f: tiny_model(f, seed=3) for f in FAMILIES}


# ----------------------------------------------------------------------------- reference
@functools.lru_cache(maxsize=None)
def full_logits_fn(config):
    """jit: tokens [B,L] -> logits [B,L,V] of one causal forward on a fresh cache of L slots."""

    def run(params, tokens):
        B, L = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        causal = jnp.tril(jnp.ones((L, L), bool))  # [T,S]: query t sees slots <= t
        mask = jnp.broadcast_to(causal, (B, L, L))
        logits, _ = forward(params, tokens, positions, init_cache(config, B, L), mask, config)
        return logits

    return jax.jit(run)


def full_logits(model, ids, config=None):
    """Logits [len(ids), V] of one full forward of `ids` (zero-padded to FULL_LEN; the
    padding comes after every real token, so causality keeps it invisible)."""
    tokens = np.zeros((1, FULL_LEN), np.int32)
    tokens[0, : len(ids)] = ids
    return np.asarray(full_logits_fn(config or model.config)(model.params, tokens))[0, : len(ids)]


def naive_greedy(model, prompt_ids, max_new, eos=()):
    """Plain greedy decoding without any cache reuse: a full forward per token."""
    seq = list(prompt_ids)
    for _ in range(max_new):
        t = int(np.argmax(full_logits(model, seq)[-1]))
        seq.append(t)
        if t in eos:
            break
    return seq[len(prompt_ids):]


# ----------------------------------------------------------------------------- 1. greedy
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_naive_full_forward_loop(models, tok, family):
    model = models[family]
    ids = [tok.encode(p) for p in PROMPTS]
    want = [naive_greedy(model, x, MAX_NEW) for x in ids]
    assert len({tuple(w) for w in want}) == 3  # the model is not degenerate

    one = generate(model, tok, LONG, max_new_tokens=MAX_NEW)  # batch 1, longer than the window
    assert one.token_ids == [want[2]]
    assert one.rows[0].prompt_token_ids == ids[2]
    assert one.texts == [tok.decode(want[2])]

    batch = generate(model, tok, PROMPTS, max_new_tokens=MAX_NEW)  # right-padded, own lengths
    assert batch.token_ids == want
    assert [r.prompt_token_ids for r in batch.rows] == ids
    assert [r.finish_reason for r in batch.rows] == ["length"] * 3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generation_across_attention_windows(models, tok, family):
    """Decode steps attend over a window of the cache (`Engine.window`: 128, 512, ... slots
    where attention reads every slot of it; the whole cache where the CPU attention kernel
    runs the step), not all of it. A prompt of 120 tokens decoding 24 crosses the 128 -> 256
    (= S) boundary and still matches the naive full-forward loop, greedy and lookahead,
    batch 1 and 2; the steps compiled are at the windows `Engine.window` names."""
    model = models[family]
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] * 3 for n in (40, 27)]  # 120, 81 tokens
    want = [naive_greedy_long(model, x, 24) for x in prompts]
    compiled = engine_for(model).compiled
    before = len(compiled.compilations)
    for batch in ([prompts[0]], prompts):
        out = generate(model, tok, batch, max_new_tokens=24)
        assert out.token_ids == want[: len(batch)]
        assert out.stats["cache_len"] == 256
        la = generate(model, tok, batch, max_new_tokens=24, strategy="lookahead", decoding_length=7,
                      drafter=TrieDrafter(branch_length=4))
        assert la.token_ids == want[: len(batch)]
    windows = {m.group(1) for c in compiled.compilations[before:] if (m := re.search(r"window=(\d+)", c))}
    eng = engine_for(model)  # the prefill's own 128 slots; steps before and after slot 128
    assert windows == {"128"} | {str(eng.window(n, 256, t)) for n in (121, 129, 144) for t in (1, 8)}
    assert "256" in windows


def naive_greedy_long(model, prompt_ids, max_new):
    """naive_greedy for sequences up to 160 tokens (its own full forward length)."""
    seq = list(prompt_ids)
    fn = full_logits_fn(model.config)
    for _ in range(max_new):
        tokens = np.zeros((1, 160), np.int32)
        tokens[0, : len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(fn(model.params, tokens))[0, len(seq) - 1])))
    return seq[len(prompt_ids):]


def test_window_for():
    assert window_for(1, 1024) == 128 and window_for(128, 1024) == 128
    assert window_for(129, 1024) == 512 and window_for(513, 1024) == 1024  # each window 4x the last
    assert window_for(129, 8192) == 512 and window_for(513, 8192) == 2048 and window_for(2049, 8192) == 8192
    assert window_for(700, 768) == 768 and window_for(50, 64) == 64  # never past the cache
    with pytest.raises(ValueError, match="cache holds 512"):
        window_for(513, 512)


def test_narrow_mask_equals_full_mask(models):
    """A mask of W < S slots (attention reads slots < W only) gives the logits of the same
    mask padded with False to all S slots."""
    for family, model in models.items():
        cfg = model.config
        B, T, S, W, L = 2, 5, 64, 32, 20
        rng = np.random.default_rng(1)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
        positions = L + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cache = init_cache(cfg, B, S)
        cache = cache.replace(
            k=tuple(jnp.asarray(rng.normal(size=k.shape), k.dtype) for k in cache.k),
            v=tuple(jnp.asarray(rng.normal(size=v.shape), v.dtype) for v in cache.v),
            length=jnp.full((B,), L, jnp.int32))
        narrow = jnp.asarray(np.arange(W)[None, None, :] < L + 1 + np.arange(T)[None, :, None])
        narrow = jnp.broadcast_to(narrow, (B, T, W))
        full = jnp.concatenate([narrow, jnp.zeros((B, T, S - W), bool)], axis=-1)
        a, ca = forward(model.params, tokens, positions, cache, narrow, cfg)
        b, cb = forward(model.params, tokens, positions, cache, full, cfg)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=family)
        np.testing.assert_array_equal(np.asarray(ca.k[0]), np.asarray(cb.k[0]))
    with pytest.raises(ValueError, match="cache holds 64"):
        forward(model.params, tokens, positions, cache, jnp.ones((B, T, 65), bool), cfg)


def test_gemma3_window_matters(models, tok):
    """The gemma3 prompt is long enough that the sliding window changes the logits, so the
    test above really covers windowed attention."""
    model = models["gemma3"]
    ids = tok.encode(LONG)
    windowed = full_logits(model, ids)
    full = full_logits(model, ids, model.config.replace(sliding_window=FULL_LEN))  # no-op window
    np.testing.assert_allclose(windowed[:WINDOW], full[:WINDOW], atol=1e-5, rtol=1e-5)
    assert np.abs(windowed[WINDOW:] - full[WINDOW:]).max() > 1e-2


def test_greedy_respects_eos(models):
    """A row ends at EOS (kept as its last token) exactly where plain decoding would stop."""
    model = models["llama"]
    ids = ByteTokenizer().encode(PROMPTS[1])
    free = naive_greedy(model, ids, MAX_NEW)
    tok = ByteTokenizer()
    tok.eos_token_ids = {free[4]}
    want = naive_greedy(model, ids, MAX_NEW, eos=tok.eos_token_ids)
    # batch shapes as in the test above: nothing new to compile
    out = generate(model, tok, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], max_new_tokens=MAX_NEW)
    assert out.token_ids[0] == want and want[-1] == free[4] and len(want) <= 5
    assert out.rows[0].finish_reason == "eos"


# ----------------------------------------------------------------------------- 2. cache
@functools.lru_cache(maxsize=None)
def block_logits_fn(config):
    """jit: the logits the verify step computes for a block (same positions and mask)."""

    def run(params, cache, tokens, depth, anc):
        positions = cache.length[:, None] + depth  # [B,1+T]
        mask = tree_mask(cache.length, anc, cache.max_len)  # [B,1+T,S]
        return forward(params, tokens, positions, cache, mask, config)[0]

    return jax.jit(run)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_incremental_decoding_equals_full_forward(models, tok, family):
    """Prefill, 3 plain steps, a tree step (wrong branch first, so the accepted path sits at
    non-contiguous slots and must be compacted), then 3 more plain steps: every logit row
    matches the full forward of the final sequence, and every emitted token its argmax."""
    model = models[family]
    cfg, params = model.config, model.params
    prompt = tok.encode(LONG)
    n = len(prompt)
    seq = prompt + generate(model, tok, LONG, max_new_tokens=MAX_NEW).token_ids[0]
    full = full_logits(model, seq)  # full[p] predicts seq[p + 1]
    assert all(int(np.argmax(full[p])) == seq[p + 1] for p in range(n - 1, len(seq) - 1))

    S, P = 256, 64  # what generate picks for this prompt: its compiled steps are reused
    compiled = engine_for(model).compiled
    sp = SamplingParams()
    verify = jitted_verify_step(cfg, sp)
    blk_logits = block_logits_fn(cfg)
    seeds, rows = jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.int32)
    tokens = np.zeros((1, P), np.int32)
    tokens[0, :n] = prompt
    first, cache = compiled("prefill", jitted_extend(cfg), params, init_cache(cfg, 1, S),
                            StepInputs(jnp.asarray(tokens), seeds, rows, n_new=jnp.asarray([n], jnp.int32)),
                            mode=StepMode(window=P))
    assert int(first.tokens[0]) == seq[n]
    assert int(cache.length[0]) == n

    def step(draft, T, path):
        """One verify step. `path`: block indices of the root and of the nodes that continue
        the sequence; their logits must match the full forward's."""
        pos = int(cache.length[0])  # the root is seq[pos], at position pos
        blk = verify_block(np.array([seq[pos]], np.int32), [draft], T)
        logits = np.asarray(blk_logits(params, cache, blk.tokens, blk.depth, blk.mask))[0]
        for d, j in enumerate(path):  # node j sits at depth d, position pos + d
            assert blk.depth[0, j] == d and blk.tokens[0, j] == seq[pos + d]
            np.testing.assert_allclose(logits[j], full[pos + d], atol=1e-4, rtol=1e-4)
            assert int(np.argmax(logits[j])) == seq[pos + d + 1]
        out, new_cache = compiled("verify", verify, params, cache, StepInputs.tree(blk, np.ones(1, bool), seeds, rows),
                                  mode=StepMode())
        k = int(out.n[0])
        assert np.asarray(out.tokens)[0, :k].tolist() == seq[pos + 1: pos + 1 + k]
        assert int(new_cache.length[0]) == pos + k
        return new_cache, k

    for _ in range(3):
        cache, k = step(Draft([], []), 0, [0])
        assert k == 1
    pos = int(cache.length[0])
    truth = seq[pos + 1: pos + 4]
    wrong = (truth[0] + 1) % cfg.vocab_size
    # nodes: [wrong, t1, t2, t3], parents [-1, -1, 1, 2]; block indices 1..4
    cache, k = step(Draft([wrong] + truth, [-1, -1, 1, 2]), 4, [0, 2, 3, 4])
    assert k == 4  # three drafts + the bonus token
    for _ in range(3):
        cache, k = step(Draft([], []), 0, [0])
        assert k == 1


# ----------------------------------------------------------------------------- 3. errors
def test_prompt_errors(models, tok):
    m = models["llama"]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(m, tok, "", max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(m, tok, " \n\t ", max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(m, tok, ["ok", "   "], max_new_tokens=4)
    with pytest.raises(ValueError, match="no prompts"):
        generate(m, tok, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 is empty or not a str"):
        generate(m, tok, [None], max_new_tokens=4)
    # chat messages are checked before the template sees them
    with pytest.raises(ValueError, match=r"prompt 0, message 0 \(user\): 'content' must be a string"):
        generate(m, tok, [{"role": "user"}], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1, message 1: 'role' must be one of system, user"):
        generate(m, tok, [[{"role": "user", "content": "a"}],
                          [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0, message 0: no 'role' field"):
        generate(m, tok, [[{"content": "a"}]], max_new_tokens=4)
    from lookahead_jax.prompts import check_messages

    with pytest.raises(ValueError, match="got an empty list"):
        check_messages([], "prompt 0")


def test_prompt_longer_than_cache(models, tok):
    m = models["llama"]
    with pytest.raises(ValueError, match=r"prompt 1 has 24 tokens.*cache holds 32.*max_cache_len"):
        generate(m, tok, ["a", "x" * 23], max_new_tokens=8, max_cache_len=32)
    # the default cache, capped by the model's context: no --max-cache-len advice that cannot help
    with pytest.raises(ValueError, match=r"positions\. Shorten the prompt or lower max_new_tokens \(--max-new-tokens\)\.$"):
        generate(m, tok, ["x" * (m.config.max_position - 4)], max_new_tokens=8)


def test_prompt_longer_than_model_context(tok):
    m = tiny_model("llama", max_position=48)
    with pytest.raises(ValueError, match=r"prompt 0 has 41 tokens.*context is 48 positions"):
        generate(m, tok, LONG, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"context is 48 positions"):
        generate(m, tok, "hi", max_new_tokens=100_000)


def test_prompt_longer_than_largest_prompt_bucket(models, tok):
    """A prompt beyond every prompt bucket gets the same clear message as any prompt that
    does not fit, not an internal one about tree buckets."""
    m = models["llama"]  # context 4096
    with pytest.raises(ValueError, match=r"prompt 0 has 40001 tokens.*context is 4096"):
        generate(m, tok, "x" * 40_000, max_new_tokens=4)


def test_prompt_token_ids_outside_vocab(models, tok):
    """Token ids the embedding table does not have are rejected, not silently decoded."""
    m = models["llama"]  # vocab 259
    for bad in ([1, 5000, 7], [1, -5, 7]):
        with pytest.raises(ValueError, match="vocab"):
            generate(m, tok, [bad], max_new_tokens=4, max_cache_len=256)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", None])
def test_bad_max_new_tokens(models, tok, bad):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        generate(models["llama"], tok, "hi", max_new_tokens=bad)


def test_unknown_strategy(models, tok):
    with pytest.raises(ValueError, match=r"unknown strategy 'beam'.*greedy.*lookahead"):
        generate(models["llama"], tok, "hi", max_new_tokens=4, strategy="beam")


@pytest.mark.parametrize("bad", [1000, 129, -1, "big", 2.5])
def test_bad_decoding_length(models, tok, bad):
    with pytest.raises(ValueError, match=r"decoding_length must be 'auto' or an integer in \[0, 128\]"):
        generate(models["llama"], tok, "hi", max_new_tokens=4, strategy="lookahead",
                 decoding_length=bad)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
])
def test_bad_sampling_params(models, tok, kw, msg):
    with pytest.raises(ValueError, match=msg):
        generate(models["llama"], tok, "hi", max_new_tokens=4, **kw)


def test_bad_lookahead_options(models, tok):
    m = models["llama"]
    with pytest.raises(ValueError, match=r"lookahead mode must be one of .*'bogus'"):
        generate(m, tok, "hi", max_new_tokens=4, strategy="lookahead", mode="bogus")
    with pytest.raises(ValueError, match=r"branch_length must be (>= 1|in)"):
        generate(m, tok, "hi", max_new_tokens=4, strategy="lookahead", branch_length=0)
    with pytest.raises(ValueError, match="references: got 2 lists for 3 prompts"):
        generate(m, tok, PROMPTS, max_new_tokens=4, strategy="lookahead",
                 references=[["a"], ["b"]])
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        generate(m, tok, "hi", max_new_tokens=4, stop=["x", ""])


def test_parse_dtype():
    assert parse_dtype("float32") == jnp.float32 and parse_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ValueError, match=r"unknown dtype 'float16'.*bfloat16.*float32"):
        parse_dtype("float16")
    with pytest.raises(ValueError, match="unsupported dtype.*float32 or bfloat16"):
        parse_dtype(jnp.float16)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'") as e:
        load("no-such-model")
    for name in presets.PRESETS:  # the message lists every preset
        assert name in str(e.value)
    text = tmp_path / "weights.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load(str(text))
    with pytest.raises(ValueError, match="neither a lookahead_jax checkpoint.*nor an HF model"):
        load(str(tmp_path))
    with pytest.raises(ValueError, match="empty model name"):
        load("  ")
    with pytest.raises(ValueError, match="unknown dtype"):
        load("smollm2-135m", dtype="float16")


# ----------------------------------------------------------------------------- 4. stats
def test_greedy_stats_and_compilations(tok):
    m = tiny_model("llama", seed=5)  # fresh: nothing compiled yet
    t0 = time.perf_counter()
    out = generate(m, tok, "Hello there", max_new_tokens=8)
    elapsed = time.perf_counter() - t0
    s = out.stats
    assert s["forward_steps"] == 8 and s["new_tokens"] == 8 and s["batch"] == 1
    assert out.rows[0].forward_steps == 8 and out.rows[0].new_tokens == 8
    assert s["mean_accepted_tokens"] == 1.0 and out.rows[0].mean_accepted_tokens == 1.0
    # the prefill's forward gives the first token, 7 decode steps one token each
    r = out.rows[0]
    assert (s["prefill_steps"], r.prefill_steps, r.prefill_tokens, r.decode_steps, r.tokens_per_decode_step) == \
        (1, 1, 1, 7, 1.0)
    # one prefill + one decode step, compile time reported apart from decode time
    assert s["compilations"] == 2 and len(engine_for(m).compiled.compilations) == 2
    assert [c.split("(")[0] for c in engine_for(m).compiled.compilations] == ["prefill", "verify"]
    assert s["compile_s"] > 0 and s["wall_s"] > 0
    assert s["wall_s"] + s["compile_s"] <= elapsed
    assert s["compile_s"] == pytest.approx(engine_for(m).compiled.compile_s)
    assert s["tokens_per_s"] == pytest.approx(8 / s["wall_s"])
    assert 0 < s["prefill_s"] < s["wall_s"]  # time to the first token, part of the wall time
    # time to the first token, and the rate after it: the 7 later tokens over the rest of the time
    assert s["ttft_s"] == s["prefill_s"]
    assert s["decode_tokens_per_s"] == pytest.approx(7 / (s["wall_s"] - s["ttft_s"]))

    # same shapes (other prompts of the same bucket): no compilation at all
    for prompt in ("Hi", "Another prompt."):
        again = generate(m, tok, prompt, max_new_tokens=8)
        assert again.stats["compile_s"] == 0.0
        assert again.stats["compilations"] == 2
    # a longer prompt bucket needs one more prefill, the decode step is reused
    longer = generate(m, tok, LONG, max_new_tokens=8)
    assert longer.stats["compilations"] == 3 and engine_for(m).compiled.compilations[-1].startswith("prefill")

    # a batch of 3 different lengths: every row decodes 8 tokens in 8 forward steps
    b = generate(m, tok, PROMPTS, max_new_tokens=8)
    assert b.stats["forward_steps"] == 8 and b.stats["new_tokens"] == 24
    assert [r.forward_steps for r in b.rows] == [8, 8, 8]
    assert b.stats["mean_accepted_tokens"] == 1.0
    assert 0 < b.stats["ttft_s"] < b.stats["wall_s"]  # the batch's rows get their first tokens together
    assert b.stats["decode_tokens_per_s"] == pytest.approx(21 / (b.stats["wall_s"] - b.stats["ttft_s"]))
    n = b.stats["compilations"]
    generate(m, tok, PROMPTS[::-1], max_new_tokens=8)
    assert engine_for(m).compiled.compilations.__len__() == n


def test_lookahead_stats(models, tok):
    """With references holding the continuation, lookahead takes fewer forward steps than
    tokens; compilations stay within the tree buckets it can use."""
    m = tiny_model("llama", seed=3)
    want = generate(models["llama"], tok, PROMPTS[1], max_new_tokens=24).token_ids[0]
    passage = PROMPTS[1] + tok.decode(want)
    before = len(engine_for(m).compiled.compilations)
    out = generate(m, tok, PROMPTS[1], max_new_tokens=24, strategy="lookahead",
                   decoding_length=8, references=[passage])
    assert out.token_ids == [want]
    s = out.stats
    assert s["forward_steps"] == out.rows[0].forward_steps < 24
    assert s["mean_accepted_tokens"] == pytest.approx(24 / s["forward_steps"]) and s["mean_accepted_tokens"] > 1
    # prefill + verify for tree sizes in buckets_up_to(8) = {0, 1, 3, 7, 8}
    assert 2 <= s["compilations"] - before <= 6
    assert s["compile_s"] > 0 and s["wall_s"] > 0 and s["mean_tree_size"] > 0


def test_auto_budget_compile_time_is_reported(tok):
    """decoding_length="auto" with calibrate=True compiles (and times) every tree bucket
    before decoding; that compilation must show up in stats["compile_s"], not vanish from
    both wall and compile. Without calibration a step compiles only when used: a fresh
    model's first request (no acceptance evidence yet: plain steps) compiles prefill and
    the plain step only, the executables greedy uses."""
    m = tiny_model("llama", seed=6)  # fresh: every compilation happens in this call
    out = generate(m, tok, "Hello there", max_new_tokens=4, strategy="lookahead",
                   decoding_length="auto", calibrate=True, drafter=TrieDrafter(max_nodes=4))
    assert out.stats["compilations"] == 4  # prefill + verify for T in 0, 1, 3 (<= max_nodes)
    assert out.stats["calibrate_s"] > 0
    assert out.stats["compile_s"] == pytest.approx(engine_for(m).compiled.compile_s)
    m = tiny_model("llama", seed=7)
    out = generate(m, tok, "Hello there", max_new_tokens=4, strategy="lookahead",
                   decoding_length="auto", drafter=TrieDrafter(max_nodes=4))
    assert out.stats["compilations"] == 2 and out.stats["calibrate_s"] == 0
    assert [c.split("(")[0] for c in engine_for(m).compiled.compilations] == ["prefill", "verify"]


# ----------------------------------------------------------------------------- 5. streaming
@pytest.fixture(scope="module")
def streaming_setup(models, tok):
    m = models["llama"]
    prompts = PROMPTS  # the batch shape the greedy tests compiled
    ref = generate(m, tok, prompts, max_new_tokens=24)
    text = ref.texts[0]
    # a 2-char stop string from the middle of row 0 that holds no replacement character
    i = next(i for i in range(8, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop_hit = text[i:i + 2]
    # a stop string that never completes but whose first char occurs: it is held back
    stop_never = text[i] + "\U0001F600"
    refs = [p + t for p, t in zip(prompts, ref.texts)]
    return m, prompts, ref, refs, stop_hit, stop_never


@pytest.mark.parametrize("strategy", ["greedy", "lookahead"])
@pytest.mark.parametrize("stops", ["none", "hit", "never"])
def test_streaming_deltas_concatenate_to_text(tok, streaming_setup, strategy, stops):
    m, prompts, ref, refs, stop_hit, stop_never = streaming_setup
    stop = {"none": None, "hit": [stop_hit], "never": [stop_never, stop_hit + "\U0001F600"]}[stops]
    deltas = {i: [] for i in range(len(prompts))}
    kw = dict(strategy="lookahead", decoding_length=8, references=refs) if strategy == "lookahead" else {}
    out = generate(m, tok, prompts, max_new_tokens=24, stop=stop,
                   on_text=lambda i, d: deltas[i].append(d), **kw)
    for r in out.rows:
        assert "".join(deltas[r.prompt_index]) == r.text
        assert all(deltas[r.prompt_index])  # no empty deltas
    if stops == "hit":
        assert out.rows[0].finish_reason == "stop"
        assert out.rows[0].text == ref.texts[0][: ref.texts[0].index(stop_hit)]
        assert out.token_ids[0] == ref.token_ids[0][: len(out.token_ids[0])]
    else:
        assert out.token_ids == ref.token_ids and out.texts == ref.texts
    if strategy == "greedy":  # text arrives as it is decoded, not all at the end
        assert len(deltas[1]) > 1


# ----------------------------------------------------------------------------- 6. chat
def test_chat_uses_the_chat_template(models, tok):
    m = models["llama"]
    p = "What is 2+2?"
    templated = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
        add_special_tokens=False,
    )
    chat = generate(m, tok, p, max_new_tokens=6, chat=True)
    assert chat.rows[0].prompt_token_ids == templated
    plain = generate(m, tok, p, max_new_tokens=6)
    assert plain.rows[0].prompt_token_ids == tok.encode(p)
    # chat messages and the templated token ids give the same tokens
    msgs = generate(m, tok, [[{"role": "user", "content": p}]], max_new_tokens=6)
    ids = generate(m, tok, [templated], max_new_tokens=6)
    assert msgs.rows[0].prompt_token_ids == templated
    assert chat.token_ids == msgs.token_ids == ids.token_ids
