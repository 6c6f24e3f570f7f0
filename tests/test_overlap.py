"""The overlapped loop (`generate(overlap=True)`, `Slots(overlap=True)`): a drafting step's
budget scoring runs while the next step's forward computes (`core.decode.step`). Token for
token the plain loop and greedy / plain sampling (f32 tiny model, batch > 1): lookahead
with trie and suffix drafts, SpecInfer, sampling, EOS mid-batch and stop strings, slots
inserted and freed between steps; every state edit runs the deferred work first."""

from __future__ import annotations

import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.generate import generate
from lookahead_jax.prompts import encode_prompts
from lookahead_jax.strategies import Lookahead, SpecInfer
from tiny import ByteTokenizer, drive_slots, load_prompts, pin_verify_costs, tiny_model

MAX_NEW = 24
CACHE = 1280
TEXTS = [p["prompt"] for p in load_prompts(2)][:6]


@pytest.fixture(scope="module")
def greedy(model, tok):
    return generate(model, tok, TEXTS, max_new_tokens=MAX_NEW, max_cache_len=CACHE).token_ids


@pytest.mark.parametrize("drafts", ["suffix", "trie"])
def test_lookahead_overlap_is_greedy(model, tok, greedy, drafts, monkeypatch):
    # trees priced as cheap as a plain step, whatever this host's load makes real steps
    # measure (auto chose plain all along once, with a busy host's step times): trees
    # are verified as soon as the drafts have earned it, so the drafting loop runs
    pin_verify_costs(monkeypatch, lambda T: 1.0)
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy="lookahead", drafts=drafts)
    on = generate(model, tok, TEXTS, overlap=True, **kw)
    off = generate(model, tok, TEXTS, overlap=False, **kw)
    assert on.token_ids == off.token_ids == greedy
    assert on.stats["mean_tree_size"] > 0  # drafts were verified: a drafting loop ran


def test_sampling_overlap_is_plain_sampling(model, tok):
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE, temperature=0.8, seed=3)
    ref = generate(model, tok, TEXTS, **kw)
    out = generate(model, tok, TEXTS, strategy="lookahead", overlap=True, **kw)
    assert out.token_ids == ref.token_ids


def test_specinfer_overlap_eos_mid_batch_and_stop(model, greedy):
    draft = tiny_model("llama", seed=2)
    tok = ByteTokenizer()
    tok.eos_token_ids = {greedy[1][10]}
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    ref = generate(model, tok, TEXTS[:4], **kw)
    assert "eos" in [r.finish_reason for r in ref.rows] and len({len(t) for t in ref.token_ids}) > 1
    for strat in (dict(strategy="specinfer", draft_model=draft, budget="fixed"), dict(strategy="lookahead")):
        out = generate(model, tok, TEXTS[:4], overlap=True, **strat, **kw)
        assert out.token_ids == ref.token_ids
        assert [r.finish_reason for r in out.rows] == [r.finish_reason for r in ref.rows]
    tok = ByteTokenizer()
    stop = tok.decode(greedy[4])[12:14]
    ref = generate(model, tok, TEXTS[4:6], stop=[stop], **kw)
    out = generate(model, tok, TEXTS[4:6], stop=[stop], strategy="lookahead", overlap=True, **kw)
    assert ref.rows[0].finish_reason == "stop"
    assert out.token_ids == ref.token_ids and out.texts == ref.texts


def test_slots_insert_free_between_steps(model, tok, greedy):
    """Server-style: requests enter and leave mid-decode; each is its greedy decoding, and
    the deferred scoring ran before every edit (none is left once the slots are done)."""
    ids = encode_prompts(tok, TEXTS, chat=False)
    slots = Slots(engine_for(model), tok, 3, CACHE, Lookahead(), overlap=True)
    got = drive_slots(slots, [Request(x, GenerationParams(max_new_tokens=MAX_NEW), sampling_row=i) for i, x in enumerate(ids)], every=2)
    assert [row.ids for row, _ in got] == greedy
    assert [toks for _, toks in got] == greedy
    assert slots.state.deferred is None  # the last free ran it


def test_edits_flush_the_deferred_scoring(model, tok):
    ids = encode_prompts(tok, TEXTS[:2], chat=False)
    slots = Slots(engine_for(model), tok, 2, CACHE, Lookahead(), overlap=True)
    slots.insert([0, 1], [Request(x, GenerationParams(max_new_tokens=MAX_NEW), sampling_row=i) for i, x in enumerate(ids)])
    slots.step()
    assert slots.state.deferred is not None  # left for the next step's forward
    pending = len(slots.budget._pending)
    slots.step()  # ran while this step computed
    assert slots.state.deferred is not None
    slots.free(0)
    assert slots.state.deferred is None and len(slots.budget._pending) <= pending + 2


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("drafts", ["suffix", "trie", "draft model"])
def test_store_update_runs_during_the_next_forward(model, tok, drafts, overlap, monkeypatch):
    """Under overlap the suffix / trie drafter's update of step t (`Drafter.defer_update`)
    runs after step t+1's forward was dispatched; without overlap, before it; a draft
    model's update never waits (its next proposal needs it). The tokens are greedy's
    either way (the tests above)."""
    pin_verify_costs(monkeypatch, lambda T: 1.0)
    strategy = SpecInfer(draft_model=tiny_model("llama", seed=2), budget="fixed") if drafts == "draft model" \
        else Lookahead(drafts=drafts)
    engine = engine_for(model)
    slots = Slots(engine, tok, 2, CACHE, strategy, overlap=overlap)
    deferred = overlap and drafts != "draft model"
    assert getattr(slots.drafter, "defer_update", False) == (drafts != "draft model")
    events, verify, update = [], engine.verify, slots.drafter.update

    def spy_verify(*a, **kw):
        if kw.get("ahead") is None:  # not a look-ahead (other tree sizes' executables loaded meanwhile)
            events.append("verify")
        return verify(*a, **kw)

    def spy_update(state, result):
        events.append("update")
        return update(state, result)

    monkeypatch.setattr(engine, "verify", spy_verify)
    monkeypatch.setattr(slots.drafter, "update", spy_update)
    ids = encode_prompts(tok, TEXTS[:2], chat=False)
    # 3 steps of at most 1 + 32 tokens never finish a request of 128 (earlier tests' outputs
    # of these prompts are in the engine's stores: drafts may be long)
    slots.insert([0, 1], [Request(x, GenerationParams(max_new_tokens=128), sampling_row=i) for i, x in enumerate(ids)])
    events.clear()  # the prefill
    for _ in range(3):
        slots.step()
    assert events == (["verify", "verify", "update", "verify", "update"] if deferred else ["verify", "update"] * 3)
    slots.free(0)  # the last step's deferred update runs first
    assert events[-1] == "update" and events.count("update") == 3 and slots.state.deferred is None
