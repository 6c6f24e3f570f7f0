"""`decode.replace_prompt`, the edit RaLM's run makes when a row's passage changes: a new
prompt for rows, their first generated ids kept, the cache's shared prefix kept and the rest
re-prefilled. Driven on `Slots` through a test-only run (`tiny.EditRun`, a plug-in written
against the edits alone: each edit is a turn of its own), against a fresh prefill of each
new context: K/V, tokens, log-probabilities, a draft model's own cache, errors."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core.decode import replace_prompt, rollback
from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.strategies import SpecInfer
from tiny import EditRun, load_prompts

PROMPTS = [r["prompt"][:60] for r in load_prompts(3)]  # 9 prompts, 3 sources (test_ralm's)


def _request(ids, max_new_tokens, **kw) -> Request:
    """Every request of this file (one place for `Request`'s fields)."""
    fields = {k: kw.pop(k) for k in ("strategy", "sampling_row", "references", "on_text") if k in kw}
    return Request(ids, GenerationParams(max_new_tokens=max_new_tokens, **kw), **fields)


def _slots(engine, tok, prompts, strategy=None, drafter=None, **kw):
    """Slots of one row per prompt over an `EditRun` (returned too), every prompt inserted
    at once (max_new_tokens 32, a cache of 256)."""
    edit = EditRun()
    slots = Slots(engine, tok, len(prompts), 256, strategy, drafter=drafter, run=edit, **kw)
    slots.insert(list(range(len(prompts))), [_request(list(p), 32) for p in prompts])
    return slots, edit


def _fresh(engine, tok, contexts, strategy=None, drafter=None, **kw):
    """A fresh prefill of each context from slot 0, its last token left uncached as the
    root (where a re-prefill leaves a row): the contexts inserted, then each row rolled
    back to that slot (the drafter told), before any step."""
    slots, edit = _slots(engine, tok, contexts, strategy, drafter, **kw)
    edit.edits.append(lambda engine, state, drafter, *_: [
        rollback(state, [b], len(c) - 1, drafter) for b, c in enumerate(contexts)])
    slots.step()
    for b, c in enumerate(contexts):
        assert slots.row(b).ids == [] and int(slots.state.lengths[b]) == len(c) - 1
    return slots


def _replace(edit, *args, **kw):
    """Queue one `replace_prompt(engine, state, *args)` turn; returns the list its result lands in."""
    out = []
    edit.edits.append(lambda engine, state, drafter, *_: out.append(replace_prompt(engine, state, *args, **kw)))
    return out


def _until(slots, done):
    while slots.busy and not done(slots.state):
        slots.step()


def _kv(state, b, n):
    return [np.asarray(x)[b, :, :n] for x in state.cache.k + state.cache.v]


def test_replace_prompt_equals_a_fresh_prefill(model, tok):
    """Row 0 gets a new prompt and keeps 5 generated ids: its K/V and next tokens are those
    of a fresh prefill of new prompt + the 5 ids; row 1 decodes on untouched."""
    engine = engine_for(model)
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[4])
    slots, edit = _slots(engine, tok, [a, b])
    state = slots.state
    _until(slots, lambda s: len(s.rows[0].ids) >= 9)
    kept, row1 = state.rows[0].ids[:5], list(state.rows[1].ids)
    new = tok.encode("a passage put first\n\n") + a[1:]
    _replace(edit, [0], [new], [5])
    slots.step()
    assert not edit.edits
    fresh, _ = _slots(engine, tok, [new + kept, b])
    assert state.rows[0].prompt_ids == new and state.rows[0].ids == kept and state.rows[0].finish is None
    n = int(state.lengths[0])
    assert n == len(new) + 4 == int(np.asarray(state.cache.length)[0]) and state.root[0] == kept[-1]
    for x, y in zip(_kv(state, 0, n), _kv(fresh.state, 0, n)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    _until(slots, lambda s: len(s.rows[0].ids) >= 14)
    # row 0's forward made no token: both rows took the same 9 steps (+1 forward for row 0)
    assert len(state.rows[1].ids) == len(row1) + 9 and state.rows[0].steps == state.rows[1].steps + 1
    _until(fresh, lambda s: len(s.rows[0].ids) >= 9)
    assert state.rows[0].ids[5:14] == fresh.row(0).ids[:9]
    assert state.rows[1].ids[:len(row1)] == row1
    # errors leave the state as it was
    before = (list(state.rows[0].ids), state.lengths.copy())
    for args, msg in [(([0], [new], [len(state.rows[0].ids) + 1]), "can keep"), (([0], [new], [32]), "can keep"),
                      (([0], [[5] * 260], [0]), "cache slots"), (([0, 0], [new, new], [1, 1]), "distinct rows")]:
        _replace(edit, *args)
        with pytest.raises(ValueError, match=msg):
            slots.step()
    assert state.rows[0].ids == before[0] and (state.lengths == before[1]).all()


def test_replace_prompt_keeps_the_shared_prefix(model, tok):
    """Rows re-prefilled together keep different prefixes of their old context in the cache:
    none (another first token), the head before a passage, the whole new context but the
    root (the same prompt, fewer generated ids: no forward), a prompt reaching into the
    generated ids; each row's K/V, next tokens and their log-probabilities are those of a
    fresh prefill of its new context, and a row left out decodes on untouched."""
    engine = engine_for(model)
    texts = [PROMPTS[i] for i in (0, 2, 4, 6, 8)]
    old = [tok.encode(t) for t in texts]
    slots, edit = _slots(engine, tok, old, logprobs=True)
    state = slots.state
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 8)
    gen = [list(r.ids) for r in state.rows]
    row4 = list(gen[4])
    passage = tok.encode("a passage put first\n\n", add_special_tokens=False)
    prompts = [[7] + old[0][1:],  # another first token: nothing kept
               old[1][:12] + passage + old[1][12:],  # the head (12 tokens) kept
               old[2],  # the same prompt with 3 of its generated ids: all but the root kept
               old[3] + gen[3][:3] + [9]]  # into the generated ids, then another token
    keep = [5, 2, 3, 4]
    kept = _replace(edit, [0, 1, 2, 3], prompts, keep)
    slots.step()
    kept = kept[0]
    ctx = [p + gen[b][:g] for b, (p, g) in enumerate(zip(prompts, keep))]
    assert kept.tolist() == [0, 12, len(ctx[2]) - 1, len(old[3]) + 3]
    # a prefill from slot 0 of each new context (its last token left as the root)
    fresh = _fresh(engine, tok, ctx + [old[4]], logprobs=True)
    for b in range(4):
        n = int(state.lengths[b])
        assert state.rows[b].prompt_ids == prompts[b] and state.rows[b].ids == gen[b][:keep[b]]
        assert n == len(ctx[b]) - 1 == int(np.asarray(state.cache.length)[b]) and state.root[b] == ctx[b][-1]
        for x, y in zip(_kv(state, b, n), _kv(fresh.state, b, n)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    _until(slots, lambda s: min(len(r.ids) for r in s.rows[:4]) >= 14)
    _until(fresh, lambda s: min(len(r.ids) for r in s.rows[:4]) >= 14 - min(keep))
    for b in range(4):
        got, want = state.rows[b], fresh.row(b)
        m = min(len(got.ids) - keep[b], len(want.ids))
        assert got.ids[keep[b]:keep[b] + m] == want.ids[:m] and m >= 6
        np.testing.assert_allclose(got.logprobs[keep[b]:keep[b] + m], want.logprobs[:m], atol=1e-4)
    assert state.rows[4].ids[:len(row4)] == row4


def test_replace_prompt_tells_a_model_drafter_the_kept_length(model, tok):
    """The draft model's own cache is set back to each row's kept prefix (the target as its
    own draft): its next drafts are a fresh drafter's on a fresh prefill of the new
    contexts, and decoding on gives that prefill's tokens."""
    from lookahead_jax.drafters.model import ModelDrafter

    engine = engine_for(model)
    strategy = SpecInfer(draft_model=model, expansion=(1, 1, 1), budget="fixed")
    old = [tok.encode(PROMPTS[i]) for i in (1, 3, 5)]
    drafter = ModelDrafter(engine, (1, 1, 1))
    slots, edit = _slots(engine, tok, old, strategy, drafter)
    state = slots.state
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 8)
    gen = [list(r.ids) for r in state.rows]
    passage = tok.encode("another passage\n\n", add_special_tokens=False)
    prompts = [old[0][:10] + passage + old[0][10:], old[1], [7] + old[2][1:]]
    keep = [3, 2, 4]
    kept = _replace(edit, [0, 1, 2], prompts, keep, drafter=drafter)
    slots.step()
    kept = kept[0]
    ctx = [p + gen[b][:g] for b, (p, g) in enumerate(zip(prompts, keep))]
    assert kept.tolist() == [10, len(ctx[1]) - 1, 0] and drafter.dlen.tolist() == kept.tolist()
    other = ModelDrafter(engine, (1, 1, 1))
    fresh = _fresh(engine, tok, ctx, strategy, other)
    got, want = drafter.propose(state, 3), other.propose(fresh.state, 3)
    assert [d.tokens for d in got.drafts] == [d.tokens for d in want.drafts]
    n = drafter.dlen
    assert n.tolist() == other.dlen.tolist() == [len(c) for c in ctx]  # each context, root included
    for x, y in zip(drafter.cache.k + drafter.cache.v, other.cache.k + other.cache.v):
        for b in range(3):
            np.testing.assert_allclose(np.asarray(x)[b, :, :n[b]], np.asarray(y)[b, :, :n[b]], atol=1e-5, rtol=1e-5)
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 16)
    _until(fresh, lambda s: min(len(r.ids) for r in s.rows) >= 12)
    for b in range(3):
        m = min(len(state.rows[b].ids) - keep[b], len(fresh.row(b).ids))
        assert state.rows[b].ids[keep[b]:keep[b] + m] == fresh.row(b).ids[:m] and m >= 12


def test_replace_prompt_of_every_row_in_one_block(model, tok, monkeypatch):
    """Every row of the batch re-prefilled in one block (the whole-batch forward), from
    different kept lengths: a fresh prefill's K/V and tokens."""
    engine = engine_for(model)
    calls = []
    extend = engine.extend
    monkeypatch.setattr(engine, "extend", lambda *a, **k: calls.append(k.get("sel")) or extend(*a, **k))
    old = [tok.encode(PROMPTS[i]) for i in (0, 3)]
    slots, edit = _slots(engine, tok, old)
    state = slots.state
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 6)
    gen = [list(r.ids) for r in state.rows]
    passage = tok.encode("some passage\n\n", add_special_tokens=False)
    prompts = [old[0][:9] + passage + old[0][9:], [7] + old[1][1:]]
    kept = _replace(edit, [0, 1], prompts, [4, 4])
    calls.clear()
    slots.step()
    kept = kept[0]
    ctx = [p + g[:4] for p, g in zip(prompts, gen)]
    assert kept.tolist() == [9, 0] and calls == [None]  # one forward of the whole batch
    fresh = _fresh(engine, tok, ctx)
    for b in range(2):
        n = int(state.lengths[b])
        assert n == len(ctx[b]) - 1 == int(fresh.state.lengths[b]) and state.root[b] == ctx[b][-1]
        for x, y in zip(_kv(state, b, n), _kv(fresh.state, b, n)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 14)
    _until(fresh, lambda s: min(len(r.ids) for r in s.rows) >= 10)
    for b in range(2):
        assert state.rows[b].ids[4:14] == fresh.row(b).ids[:10]


def test_reprefill_with_a_prefix_cache_aligns_only_where_it_pays(model, tok):
    """With a prefix cache (chunk 16: units of 15 slots) a re-prefill keeps down to the unit
    boundary below its shared prefix where a cached unit follows (taking the cached run) or
    where that costs no extra block (the units it commits are stored); else it keeps the
    whole shared prefix and stores nothing. Each row's K/V is a fresh prefill's."""
    engine = engine_for(model)
    a, b = list(range(10, 50)), list(range(60, 100))  # 40 tokens each: units 0, 1 stored
    slots, edit = _slots(engine, tok, [a, b], prefill_chunk=16, prefix_cache=16 << 20)
    state, cache = slots.state, slots.prefix.cache
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 2)
    one = a[:20] + list(range(110, 126))  # 36 tokens: from 20, 16 left (1 block); from 15, 21 (2)
    two = a[:20] + list(range(130, 155))  # 45 tokens: from 20, 25 left; from 15, 30: 2 blocks each
    stored = cache.stored
    kept = _replace(edit, [0], [one], [0])
    slots.step()
    assert kept[0].tolist() == [20] and cache.stored == stored  # an extra block: not aligned
    kept = _replace(edit, [0], [two], [0])
    slots.step()
    assert kept[0].tolist() == [15] and cache.stored == stored + 1  # free: aligned, unit 1 stored
    kept = _replace(edit, [1], [two], [0])  # row 1 shares nothing with its old context...
    slots.step()
    assert kept[0].tolist() == [30]  # ...and takes both units of `two` from the cache
    fresh = _fresh(engine, tok, [two, two])
    for r in range(2):
        n = int(state.lengths[r])
        assert n == len(two) - 1 and state.root[r] == two[-1]
        for x, y in zip(_kv(state, r, n), _kv(fresh.state, r, n)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    _until(slots, lambda s: min(len(r.ids) for r in s.rows) >= 8)
    _until(fresh, lambda s: min(len(r.ids) for r in s.rows) >= 8)
    for r in range(2):
        assert state.rows[r].ids[:8] == fresh.row(r).ids[:8]
