"""The step cache (core/compile.py): a warm process compiles its steps from their stored
programs without tracing them, and they compute what the traced steps compute."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
import pytest

from lookahead_jax.core import compile as C
from lookahead_jax.core.engine import engine_for
from lookahead_jax.generate import generate
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, load_prompts, tiny_model

PROMPTS = [p["prompt"][:120] for p in load_prompts(1)][:3]
tok = ByteTokenizer()


def _run(model):
    """Greedy and lookahead (fixed trees of two sizes, batch 3), with log-probs."""
    out = []
    for strategy in ("greedy", Lookahead(decoding_length=7), Lookahead(decoding_length=3)):
        g = generate(engine_for(model), tok, PROMPTS, max_new_tokens=24, strategy=strategy, logprobs=True,
                     max_cache_len=256)
        out += [(r.token_ids, np.asarray(r.logprobs)) for r in g.rows]
    return out


@pytest.fixture
def step_cache(tmp_path):
    before = C.step_cache_dir()
    C.enable_step_cache(tmp_path / "steps")
    yield tmp_path / "steps"
    C.enable_step_cache(before)


@pytest.fixture
def traced(monkeypatch):
    """Names of the steps the step cache traced (exported) from now on."""
    calls = []
    real = jax.export.export

    def export(fn, *a, **k):
        calls.append(fn)
        return real(fn, *a, **k)

    monkeypatch.setattr(jax.export, "export", export)
    return calls


def _same(a, b):
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_a_warm_process_compiles_stored_steps_without_tracing(step_cache, traced):
    """Steps stored by one engine are compiled by a fresh one (as in a new process: a new
    model object, new engine, new tables) without tracing any step, and both give the
    tokens and log-probs (bitwise) of steps traced and compiled without the cache."""
    C.enable_step_cache(None)
    want = _run(tiny_model("llama", seed=5))
    C.enable_step_cache(step_cache)
    first = _run(tiny_model("llama", seed=5))
    stored = sorted(p.name for p in step_cache.iterdir())
    assert traced and len(stored) == len(traced)
    assert {n.split("-")[0] for n in stored} == {"prefill", "verify"}
    traced.clear()
    second = _run(tiny_model("llama", seed=5))
    assert traced == []  # every step came from its stored program
    assert sorted(p.name for p in step_cache.iterdir()) == stored
    _same(first, want)
    _same(second, want)


def test_a_damaged_entry_is_traced_again_and_rewritten(step_cache, traced, caplog):
    model = tiny_model("qwen2", seed=2)
    want = _run(model)
    n = len(traced)
    victim = sorted(step_cache.iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])
    traced.clear()
    with caplog.at_level(logging.INFO, logger="lookahead_jax"):
        again = _run(tiny_model("qwen2", seed=2))
    assert len(traced) == 1 and n > 1
    assert any("unreadable" in r.message and victim.name in r.message for r in caplog.records)
    _same(again, want)
    traced.clear()
    _run(tiny_model("qwen2", seed=2))  # rewritten whole
    assert traced == []


def test_what_the_key_covers(step_cache, traced):
    """Another model configuration is another program (stored apart); a function with a
    closure, or a bound option whose repr holds an address, is never cached."""
    _run(tiny_model("llama", seed=5))
    n = len(list(step_cache.iterdir()))
    traced.clear()
    _run(tiny_model("llama", seed=5, d_ff=192))
    assert len(traced) == len(list(step_cache.iterdir())) - n > 0

    x = jax.numpy.ones(3)
    k = 2.0
    assert C._step_key("f", jax.jit(lambda a: a * k), (x,), {}) is None
    key = C._step_key("f", jax.jit(_scale), (x,), {})
    assert key is not None and key == C._step_key("f", jax.jit(_scale), (x,), {})
    assert key != C._step_key("f", jax.jit(_scale), (x[:2],), {})
    assert key != C._step_key("f", jax.jit(functools.partial(_scale, by=3.0)), (x,), {})

    class Opaque:
        pass

    assert C._step_key("f", jax.jit(functools.partial(_scale, by=Opaque())), (x,), {}) is None


def _scale(a, by=2.0):
    return a * by


def test_a_warm_process_loads_the_other_tree_sizes_in_the_background(step_cache, traced):
    """With the steps stored, a fresh engine's first lookahead step queues the budget's
    other tree sizes (loaded in background threads while it runs); the steps it takes from
    them compute what traced steps compute, and no step is compiled twice."""
    want = _run(tiny_model("llama", seed=5))
    traced.clear()
    model = tiny_model("llama", seed=5)
    again = _run(model)
    compiled = engine_for(model).compiled
    assert traced == []
    assert compiled.prefetched and {name for name, _ in compiled.prefetched} == {"verify"}
    assert len(set(compiled.compilations)) == len(compiled.compilations)
    _same(again, want)


def test_prefetch_loads_only_stored_steps_and_hands_them_to_the_call(step_cache, monkeypatch):
    x, y = jax.numpy.arange(3.0), jax.numpy.arange(5.0)
    C.CompiledFunctions()("f", jax.jit(_scale), x)  # stored: shape [3] only
    cf = C.CompiledFunctions()
    assert cf.prefetch("f", jax.jit(_scale), y) is False  # never compiled here: left to its call
    jitted = jax.jit(_scale)
    assert cf.prefetch("f", jitted, x) is True
    assert cf.prefetch("f", jitted, x) is False  # already queued
    cf.settle()
    np.testing.assert_array_equal(cf("f", jitted, x), 2.0 * np.arange(3.0))
    assert cf.compilations == [] and [n for n, _ in cf.prefetched] == ["f"]
    assert len(cf.executables("f")) == 1

    def failing(name, fn, args, static):  # a load that fails is compiled again by the call
        raise RuntimeError("broken load")

    cf = C.CompiledFunctions()
    real = C._compile_cached
    monkeypatch.setattr(C, "_compile_cached", failing)
    assert cf.prefetch("f", jitted, x) is True
    monkeypatch.setattr(C, "_compile_cached", real)
    np.testing.assert_array_equal(cf("f", jitted, x), 2.0 * np.arange(3.0))
    assert len(cf.compilations) == 1
