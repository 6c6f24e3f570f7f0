"""Repetition / presence / frequency penalties: right in plain decoding, exact under speculation.

* `path_counts` on a literal tree (what each node's own path adds to the row's counts).
* Plain greedy with penalties == an independent loop: one full causal forward per token,
  HF's `RepetitionPenaltyLogitsProcessor` (torch) and vLLM's presence/frequency formula
  (numpy), argmax; also after tokens a plug-in forced into the output (`Slots` with a
  test-only `Run`: rollback + accept).
* Lookahead (budgets 1/8/32 with a warm trie giving deep paths and with a cold one; batch
  1 and 4; drafts forcing partial and zero acceptance) and SpecInfer greedy give plain greedy's tokens with penalties on; lookahead
  and SpecInfer's "invariant" sampler give plain sampling's; a plug-in's rollback with penalties.
* Penalized output differs from unpenalized output (else nothing here could fail).
* Bad values are ValueErrors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.decode import rollback
from lookahead_jax.generate import generate
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.sampling import Penalties
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.drafters.ngram_trie import NgramTrie
from lookahead_jax.core.verify import path_counts
from test_lossless import OracleDrafter
from lookahead_jax.strategies import Lookahead
from tiny import EditRun, force_token, load_prompts

MAX_NEW = 32
CACHE = 1280
PROMPTS = load_prompts(2)
TEXTS = [p["prompt"] for p in PROMPTS][:4]
REFS = [[p["reference"]] for p in PROMPTS][:4]
REP = dict(repetition_penalty=1.3)
PF = dict(presence_penalty=0.4, frequency_penalty=0.6)
ALL = dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.0)


def _request(ids, max_new_tokens, **kw) -> Request:
    """Every request of this file (one place for `Request`'s fields)."""
    fields = {k: kw.pop(k) for k in ("strategy", "sampling_row", "references", "on_text") if k in kw}
    return Request(ids, GenerationParams(max_new_tokens=max_new_tokens, **kw), **fields)


def drafts_accepted(out) -> bool:
    """Some step emitted more than one token (fewer forwards than tokens, over the rows)."""
    return sum(r.forward_steps for r in out.rows) < sum(len(t) for t in out.token_ids)


def test_path_counts_literal():
    # block: root r=9, a=5 (child of r), b=7 (child of r), c=5 (child of a), pad=0 (padding)
    tokens = jnp.array([[9, 5, 7, 5, 0]])
    parents = [-1, 0, 0, 1, -2]
    anc = np.eye(5, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    anc[4, 0] = True  # padding sees the root and itself
    got = np.asarray(path_counts(tokens, jnp.asarray(anc)[None], 10))[0]  # [1+T,V]
    want = np.zeros((5, 10), np.int32)
    want[1, 5] = 1  # a: itself
    want[2, 7] = 1  # b: itself
    want[3, 5] = 2  # c: a and itself (both token 5); never the root's 9
    want[4, 0] = 1  # padding: itself only
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- reference
@functools.lru_cache(maxsize=None)
def _full_forward(config, L):
    from lookahead_jax.models import forward, init_cache

    @jax.jit
    def f(params, ids):  # ids [1,L] -> logits [L,V] of one causal forward from slot 0
        pos = jnp.arange(L)[None]
        mask = pos[:, :, None] >= jnp.arange(L)[None, None, :]
        logits, _ = forward(params, ids, pos, init_cache(config, 1, L), mask, config)
        return logits[0]

    return f


def reference_greedy(model, prompt, n, pen: dict, generated=()):
    """Plain greedy with penalties, written out: per token one full forward of prompt +
    generated (padded to a fixed length; causal, so the padding changes nothing before
    it), HF's RepetitionPenaltyLogitsProcessor over prompt + generated, then vLLM's
    presence/frequency over the generated ids, argmax."""
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rep = RepetitionPenaltyLogitsProcessor(pen.get("repetition_penalty", 1.0))
    pres, freq = pen.get("presence_penalty", 0.0), pen.get("frequency_penalty", 0.0)
    gen = list(generated)
    L = -(-(len(prompt) + len(gen) + n) // 256) * 256
    f = _full_forward(model.config, L)
    out = []
    for _ in range(n):
        ctx = list(prompt) + gen
        ids = np.zeros((1, L), np.int32)
        ids[0, :len(ctx)] = ctx
        logits = np.asarray(f(model.params, jnp.asarray(ids)))[len(ctx) - 1].astype(np.float32)
        scores = rep(torch.tensor([ctx]), torch.tensor(logits)[None])[0].numpy()
        counts = np.bincount(np.asarray(gen, np.int64), minlength=len(logits))
        scores = scores - freq * counts - pres * (counts > 0)
        t = int(np.argmax(scores))
        out.append(t)
        gen.append(t)
    return out


@pytest.fixture(scope="module")
def plain(model, tok):
    """Plain greedy (batch 4) per penalty setting (None: no penalties)."""
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    return {name: generate(model, tok, TEXTS, **kw, **pen).token_ids
            for name, pen in (("none", {}), ("rep", REP), ("pf", PF), ("all", ALL))}


@pytest.mark.parametrize("name,pen", [("rep", REP), ("pf", PF), ("all", ALL)])
def test_plain_greedy_equals_the_reference(model, tok, plain, name, pen):
    assert plain[name] != plain["none"]  # the penalties change the output
    for p, got in zip(TEXTS, plain[name]):
        assert got == reference_greedy(model, tok.encode(p), MAX_NEW, pen)
    one = generate(model, tok, TEXTS[1], max_new_tokens=MAX_NEW, max_cache_len=CACHE, **pen)
    assert one.token_ids[0] == plain[name][1]  # rows are independent


def test_forced_output_tokens_count_as_generated(model, tok):
    """Tokens a plug-in puts in the output (`tiny.force_token`: the step's pick taken back
    and replaced, as knnlm corrects) are generated ids (presence/frequency count them):
    decoding on equals the reference loop with them as generated."""
    prompt = tok.encode(TEXTS[2][:50])
    forced = tok.encode(" forced forced", add_special_tokens=False)
    run = EditRun()
    slots = Slots(engine_for(model), tok, 1, 256, run=run, penalties=Penalties(**{
        "repetition": ALL["repetition_penalty"], "presence": ALL["presence_penalty"],
        "frequency": ALL["frequency_penalty"]}))
    slots.insert(0, _request(prompt, 64, **ALL))  # a run's requests bring the slots' penalties
    first = slots.row(0).ids[0]
    assert first == reference_greedy(model, prompt, 1, ALL)[0]
    run.edits += [force_token(0, t) for t in forced]
    while len(slots.row(0).ids) < 1 + len(forced) + 9:
        slots.step()
    assert slots.row(0).ids[:1 + len(forced)] == [first] + forced
    want = reference_greedy(model, prompt, 9, ALL, generated=[first] + forced)
    assert slots.row(0).ids[1 + len(forced):][:9] == want


# ----------------------------------------------------------------------------- lossless
# one combination in the default run, all of them in CI's (`slow`)
@pytest.mark.parametrize("name,pen,budget", [
    pytest.param(n, p, b, marks=() if (n, b) == ("all", 8) else pytest.mark.slow)
    for b in (1, 8, 32) for n, p in (("rep", REP), ("pf", PF), ("all", ALL))])
def test_lookahead_equals_greedy(model, tok, plain, name, pen, budget):
    """A trie warmed with the penalized output and the unpenalized one (which parts from it:
    trees with wrong branches and partial acceptance) drafts deep accepted paths, where a
    node's penalty depends on the drafted tokens above it (ignoring those fails here)."""
    trie = NgramTrie(branch_length=12)
    for i, ids in enumerate(plain[name] + plain["none"]):
        trie.insert_output(ids, req=i)
        trie.end_request(i)
    out = generate(model, tok, TEXTS, max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy="lookahead",
                     decoding_length=budget, drafter=TrieDrafter(max_nodes=budget, trie=trie), **pen)
    assert out.token_ids == plain[name]
    assert drafts_accepted(out)
    if name != "all":
        return
    cold = generate(model, tok, TEXTS, max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy="lookahead",
                      decoding_length=budget, references=REFS, drafter=TrieDrafter(max_nodes=budget), **pen)
    assert cold.token_ids == plain[name]


def test_lookahead_batch1_equals_greedy(model, tok, plain):
    for i in (0, 3):
        out = generate(model, tok, TEXTS[i], max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy="lookahead",
                         decoding_length=16, references=REFS[i], **ALL)
        assert out.token_ids[0] == plain["all"][i]


@pytest.mark.parametrize("cut", [0, 1, 3, 8])
def test_forced_partial_and_zero_acceptance(model, tok, plain, cut):
    """Drafts = the penalized truth, wrong at depth `cut`: exactly `cut` drafts accepted per
    step, so every accepted node's logits were penalized by its own path."""
    truth = plain["all"]
    out = generate(model, tok, TEXTS, max_new_tokens=MAX_NEW, strategy="lookahead", drafter=OracleDrafter(truth, cut),
                     decoding_length=16, max_cache_len=CACHE, **ALL)
    assert out.token_ids == truth
    for r in out.rows:
        assert r.forward_steps == 1 + -(-(MAX_NEW - 1) // (cut + 1))


def test_specinfer_greedy_equals_greedy(model, tok, plain):
    for name, pen in (("rep", REP), ("all", ALL)):
        out = generate(model, tok, TEXTS, max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy="specinfer",
                         draft_model=model, draft_weights="float32", expansion=(2, 2, 1), budget="fixed", **pen)
        assert out.token_ids == plain[name], name
        assert drafts_accepted(out)


@pytest.mark.slow  # CI's full run (the default run keeps its siblings)
def test_sampling_equals_plain_sampling(model, tok):
    """Lookahead and SpecInfer's drafter-invariant sampler draw plain sampling's tokens."""
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, temperature=0.8, top_k=40, seed=11)
    ref = generate(model, tok, TEXTS, **kw, **ALL).token_ids
    assert ref != generate(model, tok, TEXTS, **kw).token_ids
    la = generate(model, tok, TEXTS, strategy="lookahead", decoding_length=16, references=REFS, **kw, **ALL)
    assert la.token_ids == ref and drafts_accepted(la)
    si = generate(model, tok, TEXTS, strategy="specinfer", draft_model=model, draft_weights="float32",
                    sampler="invariant", expansion=(2, 2, 1), budget="fixed", **kw, **ALL)
    assert si.token_ids == ref and drafts_accepted(si)


def test_rollback_recounts(model, tok, plain):
    """Rolled back rows are penalized by their context as it now stands: decoding on after
    a plug-in's rollback (`decode.rollback`, the drafter told) repeats the tokens it rolled
    back (lookahead, 4 slots)."""
    pen = Penalties(ALL["repetition_penalty"], ALL["presence_penalty"], ALL["frequency_penalty"])
    run = EditRun()
    slots = Slots(engine_for(model), tok, 4, CACHE, Lookahead(decoding_length=16, drafts="trie"),
                  drafter=TrieDrafter(max_nodes=16), run=run, penalties=pen)
    slots.insert([0, 1, 2, 3], [_request(tok.encode(p), MAX_NEW, **ALL, references=[tok.encode(r, add_special_tokens=False)
                                                                            for r in refs])
                                for p, refs in zip(TEXTS, REFS)])
    while min(len(r.ids) for r in slots.state.rows) < 20:
        slots.step()

    def back(engine, state, drafter, *_):
        for b in (0, 2):
            rollback(state, [b], len(state.rows[b].prompt_ids) + 4, drafter)
            assert len(state.rows[b].ids) == 5

    run.edits.append(back)
    while slots.busy:
        slots.step()
    assert not run.edits  # the rollback ran
    assert [slots.free(b).ids for b in range(4)] == plain["all"]
    slots.close()


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw,msg", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty="1.2"), "repetition_penalty must be a number"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(presence_penalty=True), "presence_penalty must be a number"),
])
def test_bad_values(model, tok, kw, msg):
    with pytest.raises(ValueError, match=msg):
        generate(model, tok, TEXTS[0], max_new_tokens=2, **kw)


def test_off_is_the_plain_executable(model, tok):
    """Defaults pass no extra arrays: the same compiled executables as without the options."""
    engine = engine_for(model)
    kw = dict(max_new_tokens=4, max_cache_len=CACHE, strategy="lookahead", decoding_length=8)
    # a cold trie each call: the same drafts, so the same tree sizes (a warm shared trie
    # could pick a tree size the first call did not compile)
    generate(model, tok, TEXTS[0], drafter=TrieDrafter(max_nodes=8), **kw)
    n = len(engine.compiled.compilations)
    generate(model, tok, TEXTS[0], repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0.0,
               drafter=TrieDrafter(max_nodes=8), **kw)
    assert len(engine.compiled.compilations) == n
