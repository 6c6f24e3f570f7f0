"""The step programs a configuration runs (`core/programs.py`), and steps that never wait
for one they can do without.

* A lookahead server's configuration (8 slots, 2,048-slot cache, chunks of 64) runs a
  small, listed set of programs, the minimum set (plain decoding, the widest prefill
  block) first; greedy, sampled and min_new_tokens requests add none.
* `Engine.window`: the whole cache where the CPU attention kernel runs a step, the
  coarse ladder of `verify.window_for` where XLA's attention does.
* Fallback slots (`Slots(fallback=True)`, the server's): while no tree size is compiled the
  steps decode plainly and queue the trees' compilation in the background, nothing
  compiles on the request path, and the tokens are greedy's; once compiled, trees verify.
  A draft model's programs (SpecInfer) the same: no drafts until they are compiled.
* `warm_up(wait="minimum")` returns with the minimum set compiled, the rest queued.
"""

from __future__ import annotations

import time

import pytest

from lookahead_jax.core import programs as programs_lib
from lookahead_jax.core.compile import CompiledFunctions
from lookahead_jax.core.engine import Engine
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.core.verify import window_for
from lookahead_jax.generate import generate
from lookahead_jax.models import cpu_kernels
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, load_prompts, tiny_model

PROMPTS = [p["prompt"] for p in load_prompts()]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def kernel_attention(model) -> bool:
    return cpu_kernels.attention_applies(16, model.config.head_dim)


def test_a_lookahead_server_runs_a_small_listed_set(model, tok):
    slots = Slots(Engine(model), tok, 8, 2048, Lookahead(), prefill_chunk=64, logprobs=True,
                  eos_ids=tok.eos_token_ids, fallback=True)
    progs = slots.programs()
    assert progs == slots.programs()  # one answer, in one order
    assert len(set(progs)) == len(progs)
    minimum = [p for p in progs if p.minimum]
    assert progs[:len(minimum)] == minimum  # the minimum set first
    kinds = {(p.kind, p.tokens) for p in minimum}
    assert ("verify", 1) in kinds and ("prefill", 64) in kinds  # plain decoding, a prefill block
    assert max(p.window for p in progs if p.kind == "prefill") in {p.window for p in minimum if p.kind == "prefill"}
    trees = sorted({p.tokens - 1 for p in progs if p.kind == "verify"})
    assert trees == list(slots.budget.buckets)
    assert all(p.rows == 1 for p in progs if p.kind == "prefill") and all(p.rows == 8 for p in progs
                                                                           if p.kind == "verify")
    if kernel_attention(model):  # one window per tree size up to the kernel's 16 tokens
        assert {p.window for p in progs if p.kind == "verify" and p.tokens <= 16} == {2048}
        assert len(progs) <= 16, "\n".join(map(str, progs))


def test_engine_window_follows_the_attention_path(model):
    eng = Engine(model)
    for needed in (1, 100, 129, 600, 1500):
        assert eng.window(needed, 2048, 64) == window_for(needed, 2048)  # 64 tokens: XLA's attention
        want = 2048 if kernel_attention(model) else window_for(needed, 2048)
        assert eng.window(needed, 2048, 8) == want
    with pytest.raises(ValueError, match="cache holds 2048"):
        eng.window(2049, 2048, 1)


def test_sampling_and_min_new_tokens_add_no_program(model, tok):
    """Requests with every sampling mode and min_new_tokens, through slots warmed up with
    their inventory, compile nothing more."""
    eng = Engine(model)
    slots = Slots(eng, tok, 3, 512, Lookahead(decoding_length=3), prefill_chunk=32, logprobs=True,
                  eos_ids=tok.eos_token_ids)
    slots.warm_up(wait="all")
    before = list(eng.compiled.compilations)
    reqs = [Request(tok.encode(PROMPTS[0][:50]), GenerationParams(max_new_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=1)),
            Request(tok.encode(PROMPTS[1][:90]), GenerationParams(max_new_tokens=12, min_new_tokens=6)),
            Request(tok.encode(PROMPTS[2][:20]), GenerationParams(max_new_tokens=12, temperature=1.0, seed=2))]
    slots.insert([0, 1, 2], reqs)
    while slots.busy:
        for ev in slots.step():
            if ev.finish:
                slots.free(ev.slot)
    assert eng.compiled.compilations == before


def test_fallback_decodes_plainly_until_a_tree_size_is_compiled(model, tok, monkeypatch):
    """While no tree size is compiled (`ready` says so), fallback slots verify no tree and
    queue the trees' compilation in the background; nothing compiles on the request
    path but plain decoding, and the tokens are greedy's. Once the trees are compiled the
    steps verify them, still greedy's tokens."""
    eng = Engine(model)
    prompt = tok.encode(PROMPTS[3][:60] * 3)
    want = generate(model, tok, [prompt], max_new_tokens=40).token_ids[0]
    queued = []
    real_ready, real_prefetch = CompiledFunctions.ready, CompiledFunctions.prefetch

    def not_yet(self, name, jitted, *args, **static):  # no verify step of a tree is compiled
        if name == "verify" and args[2].tokens.shape[1] > 1:
            return False
        return real_ready(self, name, jitted, *args, **static)

    def record(self, name, jitted, *args, compile=False, later=False, **static):
        queued.append((name, args[2].tokens.shape[1] - 1, compile))
        return False  # nothing actually queued: the tree stays uncompiled

    monkeypatch.setattr(CompiledFunctions, "ready", not_yet)
    monkeypatch.setattr(CompiledFunctions, "prefetch", record)
    slots = Slots(eng, tok, 1, 1024, Lookahead(decoding_length=7), fallback=True)

    def decode():  # the request alone in the slots: (its tokens, each step's tree size)
        slots.insert(0, Request(prompt, GenerationParams(max_new_tokens=40)))
        sizes = []
        while slots.busy:
            slots.step()
            sizes.append(slots.last_step.T)
        return slots.free(0).ids, sizes

    got, sizes = decode()
    assert got == want
    assert set(sizes) == {0}  # no tree verified
    assert any(name == "verify" and T > 0 and full for name, T, full in queued)  # trees queued to compile
    inline = [c for c in eng.compiled.compilations if c.startswith("verify(") and not c.startswith("verify(1x1,")]
    assert inline == []  # no tree compiled on the request path

    monkeypatch.setattr(CompiledFunctions, "ready", real_ready)  # the real table from here on
    monkeypatch.setattr(CompiledFunctions, "prefetch", real_prefetch)
    for attempt in range(2):  # the first queues the trees it wants, compiled before the second
        got, sizes = decode()
        assert got == want
        eng.compiled.settle()
    assert max(sizes) > 0  # the trees compiled in the background are verified
    assert [c for c in eng.compiled.compilations if c.startswith("verify(")
            and not c.startswith("verify(1x1,")] == []  # ... never compiled on the request path


def test_a_draft_model_never_compiles_on_the_request_path(model, tok, monkeypatch):
    """SpecInfer on fallback slots with a fresh draft model: while the draft's programs
    (its catch-up prefill, its tree step) are not compiled, steps draft nothing and queue
    them in the background; the draft compiles nothing on the request path, the tokens are
    greedy's, and once they are compiled the draft's trees are verified."""
    from lookahead_jax.strategies import SpecInfer

    eng = Engine(model)
    prompt = tok.encode(PROMPTS[3][:60] * 3)
    want = generate(model, tok, [prompt], max_new_tokens=40).token_ids[0]
    strat = SpecInfer(draft_model=tiny_model("llama", seed=7), expansion=(1, 1, 2), budget="fixed")
    slots = Slots(eng, tok, 1, 1024, strat, fallback=True)
    draft = slots.drafter.engine

    def decode():  # the request alone in the slots: (its tokens, the draft nodes verified)
        slots.insert(0, Request(prompt, GenerationParams(max_new_tokens=40)))
        drafted = 0
        while slots.busy:
            slots.step()
            drafted += int(slots.last_step.drafted.sum())
        return slots.free(0).ids, drafted

    queued = []
    real_prefetch = CompiledFunctions.prefetch

    def record(self, name, jitted, *args, compile=False, later=False, **static):
        if self is draft.compiled:  # the draft's programs stay uncompiled for this first request
            queued.append(name)
            return False
        return real_prefetch(self, name, jitted, *args, compile=compile, later=later, **static)

    monkeypatch.setattr(CompiledFunctions, "prefetch", record)
    got, drafted = decode()
    assert got == want and drafted == 0
    assert "draft" in queued and draft.compiled.compilations == []  # asked for, not compiled in place
    monkeypatch.setattr(CompiledFunctions, "prefetch", real_prefetch)  # the background compiles them now
    for attempt in range(3):  # each round compiles what the one before queued
        draft.compiled.settle()
        eng.compiled.settle()
        got, drafted = decode()
        assert got == want
    assert drafted > 0  # the draft's trees, compiled in the background, are verified
    assert draft.compiled.compilations == []


def test_warm_up_minimum_returns_with_the_minimum_set(model, tok):
    eng = Engine(tiny_model("llama", seed=5))  # a fresh model: nothing compiled for it
    slots = Slots(eng, tok, 2, 512, Lookahead(), prefill_chunk=32, fallback=True)
    ticks = []
    slots.warm_up(wait="minimum", progress=lambda done, total: ticks.append((done, total)))
    warm = slots.warm
    assert warm.minimum_s is not None and warm.ready >= warm.minimum == len([p for p in warm.programs if p.minimum])
    assert ticks and ticks[-1] == (warm.ready, warm.total)
    assert eng.compiled.compilations == []  # all of it in the background, none in place
    deadline = time.perf_counter() + 300
    while programs_lib.track(slots, warm) < warm.total and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert warm.ready == warm.total and warm.done_s is not None
    assert eng.compiled.background_s > 0
