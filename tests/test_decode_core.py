"""The decode core: drafter protocol, strategies, decode state (rollback / extend), streaming.

* Every drafter (the trie and a test-only prompt-lookup drafter written against the
  protocol alone) passes the same protocol-conformance checks, and the test-only drafter
  is lossless through the unchanged loop: adding a drafter needs no change to the loop.
* rollback + extend gives the K/V and the tokens of a fresh prefill of the same tokens.
* Strategy objects and the flat keyword forms are the same call.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core import decode as D
from lookahead_jax.core.inputs import StepInputs, StepMode
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.generate import generate
from lookahead_jax.drafters.base import Drafter, PerRowDrafter
from lookahead_jax.drafters.suffix import SuffixDrafter
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.core.drafts import Draft, DraftBatch
from lookahead_jax.core.engine import Engine, engine_for
from lookahead_jax.strategies import Greedy, Lookahead
from tiny import ByteTokenizer, load_prompts, tiny_model

MAX_NEW = 32
CACHE = 1280
PROMPTS = load_prompts(4)  # 12 prompts from RAG / code / math
TEXTS = [p["prompt"] for p in PROMPTS]


class PromptLookupDrafter(PerRowDrafter):
    """Test-only: find the latest earlier occurrence of the context's last `n` tokens and
    propose the tokens that followed it (a chain), like HF's prompt-lookup decoding."""

    def __init__(self, n=2, max_nodes=16):
        self.n, self.max_nodes = n, max_nodes

    def propose_row(self, row, context, budget):
        key = context[-self.n:]
        for s in range(len(context) - self.n - 1, -1, -1):
            if context[s:s + self.n] == key:
                follow = context[s + self.n: s + self.n + budget]
                return Draft(follow, list(range(-1, len(follow) - 1)))
        return Draft([], [])


class Recording:
    """Wraps a drafter and checks the protocol on every call."""

    def __init__(self, inner):
        self.inner, self.max_nodes = inner, inner.max_nodes
        self.calls = {"begin": 0, "propose": 0, "update": 0, "end": 0}

    def begin(self, state, references=None):
        self.calls["begin"] += 1
        assert all(len(r.ids) == 1 for r in state.rows)  # prefill's first token is there
        self.inner.begin(state, references)

    def propose(self, state, budget):
        self.calls["propose"] += 1
        out = self.inner.propose(state, budget)
        assert isinstance(out, DraftBatch) and len(out) == state.batch
        for b, d in enumerate(out.drafts):
            assert len(d.tokens) == len(d.parents) <= budget
            assert all(-1 <= p < i for i, p in enumerate(d.parents))
            if not state.active[b]:
                assert len(d) == 0  # finished rows get no draft
        self.last = out
        return out

    def update(self, state, step):
        self.calls["update"] += 1
        for b, kept in enumerate(step.kept):
            n = int(step.n_emit[b])
            assert kept == [int(t) for t in step.emitted[b, :len(kept)]] and len(kept) <= n
            if n:  # the path: root first, then nodes of increasing depth whose tokens were emitted
                path = step.path[b, :n]
                assert path[0] == 0
                drafted = self.last.drafts[b]
                for d, j in enumerate(path[1:]):
                    assert drafted.tokens[j - 1] == int(step.emitted[b, d])
        self.inner.update(state, step)

    def rollback(self, rows, length):
        self.inner.rollback(rows, length)

    def end(self):
        self.calls["end"] += 1
        self.inner.end()

    def summary(self):
        return self.inner.summary()


@pytest.fixture(scope="module")
def greedy(model, tok):
    return {b: sum((generate(model, tok, TEXTS[s:s + b], max_new_tokens=MAX_NEW, max_cache_len=CACHE).token_ids
                    for s in range(0, len(TEXTS), b)), []) for b in (1, 4)}


@pytest.mark.parametrize("make", [lambda: TrieDrafter(max_nodes=16), lambda: PromptLookupDrafter(),
                                  lambda: SuffixDrafter(max_nodes=16)],
                         ids=["trie", "prompt-lookup", "suffix"])
def test_protocol_conformance(model, tok, greedy, make):
    drafter = make()
    assert isinstance(drafter, Drafter)
    rec = Recording(drafter)
    out = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, strategy="lookahead", drafter=rec,
                     decoding_length=16, max_cache_len=CACHE, references=[[t] for t in TEXTS[:4]])
    assert out.token_ids == greedy[4][:4]
    assert rec.calls["begin"] == rec.calls["end"] == 1
    assert rec.calls["propose"] == rec.calls["update"] == out.stats["forward_steps"] - 1


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("budget", [1, 3, 16])
def test_a_new_drafter_is_lossless_without_touching_the_loop(model, tok, greedy, batch, budget):
    ids, steps = [], 0
    for s in range(0, len(TEXTS), batch):
        out = generate(model, tok, TEXTS[s:s + batch], max_new_tokens=MAX_NEW, strategy="lookahead",
                         drafter=PromptLookupDrafter(max_nodes=budget), decoding_length=budget,
                         max_cache_len=CACHE)
        ids += out.token_ids
        steps += out.stats["forward_steps"]
    assert ids == greedy[batch]
    assert steps < sum(len(x) for x in ids)  # some drafts were accepted


@pytest.mark.parametrize("batch", [1, 4])
def test_suffix_drafter_is_lossless(model, tok, greedy, batch):
    """The suffix drafter (drafters/suffix.py) with its cache over earlier requests warm
    (one drafter for every call, as a process serves requests): greedy's tokens."""
    drafter = SuffixDrafter(max_nodes=16, alpha=4.0)
    ids, steps = [], 0
    for _ in range(2):  # the second pass drafts from the first pass's outputs as well
        ids, steps = [], 0
        for s in range(0, len(TEXTS), batch):
            out = generate(model, tok, TEXTS[s:s + batch], max_new_tokens=MAX_NEW, strategy="lookahead",
                           drafter=drafter, decoding_length=16, max_cache_len=CACHE,
                           references=[[t] for t in TEXTS[s:s + batch]])
            ids += out.token_ids
            steps += out.stats["forward_steps"]
        assert ids == greedy[batch]
    assert steps < sum(len(x) for x in ids)  # some drafts were accepted


@pytest.mark.parametrize("decoding_length", [7, "auto"])
def test_lookahead_drafts_suffix_is_lossless(model, tok, greedy, decoding_length):
    """Lookahead(drafts="suffix") through the strategy (the engine's shared cache of earlier
    outputs; a fixed budget and auto): greedy's tokens, batch 4."""
    out = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE,
                   strategy=Lookahead(decoding_length=decoding_length, drafts="suffix"),
                   references=[[t] for t in TEXTS[:4]])
    assert out.token_ids == greedy[4][:4]
    with pytest.raises(ValueError, match="drafts must be one of"):
        generate(model, tok, "x", strategy=Lookahead(drafts="suffixes"))


def test_strategy_objects_equal_the_flat_forms(model, tok, greedy):
    a = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE,
                   strategy=Lookahead(decoding_length=7, branch_length=4), drafter=TrieDrafter(branch_length=4))
    b = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE,
                   strategy="lookahead", decoding_length=7, branch_length=4, drafter=TrieDrafter(branch_length=4))
    assert a.token_ids == b.token_ids == greedy[4][:4]
    assert a.stats["forward_steps"] == b.stats["forward_steps"]
    c = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE, strategy=Greedy())
    assert c.token_ids == greedy[4][:4] and c.stats["strategy"] == "greedy"
    with pytest.raises(TypeError, match="unexpected keyword argument 'decoding_lenght'"):
        generate(model, tok, "x", strategy="lookahead", decoding_lenght=7)
    with pytest.raises(ValueError, match="decoding_length must be"):
        generate(model, tok, "x", strategy=Lookahead(decoding_length=-1))
    with pytest.raises(ValueError, match="strategy must be"):
        generate(model, tok, "x", strategy=object())


def test_engine_is_explicit_and_per_model(model, tok):
    e = engine_for(model)
    assert engine_for(model) is e and isinstance(e, Engine)
    assert "_compiled" not in vars(model) and "_runtime" not in vars(model)
    out = generate(e, tok, TEXTS[0], max_new_tokens=4, max_cache_len=CACHE)  # an Engine works too
    assert out.stats["compilations"] == len(e.compiled.compilations)
    other = tiny_model("llama", seed=1)
    assert engine_for(other) is not e


def test_the_engine_registry_does_not_keep_models_alive(tok):
    """engine_for's engine goes with its model (the registry holds both weakly)."""
    import gc
    import weakref

    from lookahead_jax.core import engine as E

    from lookahead_jax.loading import Model

    t = tiny_model("llama", seed=2)  # a SimpleNamespace (not weak-referenceable): stays registered
    m = Model(t.config, t.params, t.name, t.dtype)
    e = engine_for(m)
    generate(m, tok, TEXTS[0], max_new_tokens=2, max_cache_len=CACHE)
    n, alive = len(E._ENGINES), weakref.ref(m)
    del m
    gc.collect()
    assert alive() is None and len(E._ENGINES) == n - 1
    with pytest.raises(RuntimeError, match="garbage-collected"):
        e.params


def test_engines_of_models_without_weakrefs_die_with_them(tok):
    """A model object that takes no weak reference (tiny_model's SimpleNamespace) keeps its
    engine on itself: model, engine and the executables compiled for it go together (held
    by a registry instead, every such model's executables stayed alive; a test run in one
    process ran past the kernel's limit of memory mappings and XLA's compiler crashed)."""
    import gc
    import weakref

    from lookahead_jax.core import engine as E

    t = tiny_model("llama", seed=3)
    with pytest.raises(TypeError):
        weakref.ref(t)
    n = len(E._ENGINES)
    e = engine_for(t)
    assert engine_for(t) is e and len(E._ENGINES) == n
    generate(t, tok, TEXTS[0], max_new_tokens=2, max_cache_len=CACHE)
    exe = weakref.ref(e.compiled.executables("prefill")[0])
    e = weakref.ref(e)
    del t
    gc.collect()
    assert e() is None and exe() is None


def _state(model, tok, prompts, S=256):
    ids = [tok.encode(p) for p in prompts]
    return D.prefill(engine_for(model), ids, tok, max_len=S, max_new_tokens=64)


def test_rollback_then_extend_equals_a_fresh_prefill(model, tok):
    """Decode a few tokens, roll row 0 back to its prompt and extend it with new text: its
    committed K/V equal a fresh prefill of prompt + text (row 1, left alone, keeps
    decoding as before), and decoding on gives the fresh run's tokens."""
    engine = engine_for(model)
    a, b, more = TEXTS[0][:40], TEXTS[1][:30], " and then the next part"
    state = _state(model, tok, [a, b])
    D.decode(engine, state, until=lambda s: len(s.rows[0].ids) >= 6)
    row1_before = list(state.rows[1].ids)
    n_a = len(state.rows[0].prompt_ids)
    D.rollback(state, [0], n_a - 1)
    assert state.rows[0].ids == [] and int(np.asarray(state.cache.length)[0]) == n_a - 1
    new = tok.encode(more, add_special_tokens=False)
    D.extend(engine, state, [0], [new])
    fresh = _state(model, tok, [a + more, b])
    assert state.rows[0].prompt_ids == fresh.rows[0].prompt_ids
    assert state.rows[0].ids == fresh.rows[0].ids  # the same next token
    n = int(state.lengths[0])
    assert n == int(fresh.lengths[0]) == int(np.asarray(state.cache.length)[0])
    for x, y in zip(state.cache.k + state.cache.v, fresh.cache.k + fresh.cache.v):
        np.testing.assert_allclose(np.asarray(x)[0, :, :n], np.asarray(y)[0, :, :n], atol=1e-5, rtol=1e-5)
    assert state.rows[1].ids[:len(row1_before)] == row1_before
    D.decode(engine, state, until=lambda s: len(s.rows[0].ids) >= 12)
    D.decode(engine, fresh, until=lambda s: len(s.rows[0].ids) >= 12)
    assert state.rows[0].ids[:12] == fresh.rows[0].ids[:12]


def test_extend_and_rollback_errors(model, tok):
    engine = engine_for(model)
    state = _state(model, tok, ["Hello there"])
    with pytest.raises(ValueError, match="has generated tokens"):
        D.extend(engine, state, [0], [[5, 6]])
    with pytest.raises(ValueError, match="no tokens"):
        D.extend(engine, state, [0], [[]], as_output=True)
    with pytest.raises(ValueError, match="rollback of row 0"):
        D.rollback(state, [0], 0)
    state = _state(model, tok, ["Hello there"], S=256)
    D.rollback(state, [0], len(state.rows[0].prompt_ids) - 1)
    with pytest.raises(ValueError, match="cache slots"):
        D.extend(engine, state, [0], [[7] * 300])


def test_forced_output_tokens(model, tok):
    """extend(as_output=True) appends forced tokens to the output; decoding continues as
    plain decoding of that sequence would."""
    engine = engine_for(model)
    state = _state(model, tok, [TEXTS[2][:50]])
    forced = tok.encode(" forced", add_special_tokens=False)
    D.extend(engine, state, [0], [forced], as_output=True)
    D.decode(engine, state, until=lambda s: len(s.rows[0].ids) >= 1 + len(forced) + 5)
    ref = _state(model, tok, [TEXTS[2][:50]])
    seq = ref.rows[0].prompt_ids + ref.rows[0].ids + forced
    want = generate(model, tok, [seq], max_new_tokens=5, max_cache_len=256).token_ids[0]
    assert state.rows[0].ids[1 + len(forced):][:5] == want


def test_accept_after_rollback_replaces_a_token(model, tok):
    """rollback to a slot an earlier step wrote, then accept(cache=None) of another token
    (knnlm's correction): the row's token there is replaced, its length restored, no step
    counted, the other row untouched, and decoding on gives plain decoding's tokens of the
    edited sequence."""
    engine = engine_for(model)
    state = _state(model, tok, [TEXTS[2][:50], TEXTS[1][:30]])
    D.decode(engine, state, until=lambda s: len(s.rows[0].ids) >= 6)
    r0 = state.rows[0]
    n, steps, row1, keep = int(state.lengths[0]), state.steps, list(state.rows[1].ids), r0.ids[:-1]
    t = next(x for x in tok.encode("QR", add_special_tokens=False) if x != r0.ids[-1])
    D.rollback(state, [0], n - 1)
    assert D.accept(state, [0], [t]) == [[t]]
    assert r0.ids == keep + [t] and int(state.root[0]) == t and state.steps == steps
    assert int(state.lengths[0]) == n == int(np.asarray(state.cache.length)[0])
    assert state.rows[1].ids == row1
    with pytest.raises(ValueError, match="live rows"):
        D.accept(state, [0, 1], [t])
    D.decode(engine, state, until=lambda s: len(s.rows[0].ids) >= len(keep) + 6)
    want = generate(model, tok, [r0.prompt_ids + keep + [t]], max_new_tokens=5, max_cache_len=256).token_ids[0]
    assert r0.ids[len(keep) + 1:][:5] == want


def test_accept_steps_drops_what_a_row_ran_past_its_end(model, tok):
    """accept_steps (knnlm's round, committed after it ran): each row takes its tokens in
    order up to its finish; a row that met EOS mid-round keeps none after it and its cache
    length is set back to the slots it committed; a row that did not step is untouched;
    every step is counted; a finished row may not step."""
    eos = 2
    state = D.prefill(engine_for(model), [tok.encode(p) for p in (TEXTS[2][:40], TEXTS[1][:30], TEXTS[0][:20])],
                      tok, max_len=256, max_new_tokens=64, eos_ids=(eos,))
    L, steps, row_steps = state.lengths.copy(), state.steps, [r.steps for r in state.rows]
    ids = [list(r.ids) for r in state.rows]
    a, b, c = tok.encode("abc", add_special_tokens=False)
    active = np.array([[1, 1, 0]] * 3, bool)
    tokens = np.array([[a, b, 0], [eos, c, 0], [c, a, 0]])
    cache = state.cache.replace(length=state.cache.length + np.asarray(active.sum(axis=0), np.int32))
    D.accept_steps(state, active, tokens, np.zeros((3, 3)), cache)
    assert state.rows[0].ids == ids[0] + [a, eos] and state.rows[0].finish == "eos"
    assert state.rows[1].ids == ids[1] + [b, c, a] and not state.rows[1].finish
    assert state.rows[2].ids == ids[2] and int(state.root[1]) == a
    assert list(state.lengths) == [L[0] + 2, L[1] + 3, L[2]] == list(np.asarray(state.cache.length))
    assert state.steps == steps + 3
    assert [r.steps for r in state.rows] == [row_steps[0] + 2, row_steps[1] + 3, row_steps[2]]
    with pytest.raises(ValueError, match="finished row"):
        D.accept_steps(state, np.array([[1, 1, 0]], bool), np.array([[a, b, 0]]), None, state.cache)


class CountingTokenizer(ByteTokenizer):
    eos_token_ids = frozenset()

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=False):
        ids = list(ids)
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)

    def stream(self, prompt_len=0, skip_special_tokens=False):
        from lookahead_jax.convert.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self, prompt_len, skip_special_tokens)


def test_streaming_decodes_only_new_tokens(model):
    """Text streams through the incremental detokenizer: over N tokens, O(N) token
    decodes (a full re-decode every step would be ~N^2 / 2)."""
    tok = CountingTokenizer()
    deltas = []
    N = 96
    out = generate(model, tok, TEXTS[3], max_new_tokens=N, on_text=lambda i, d: deltas.append(d),
                     max_cache_len=CACHE)
    assert "".join(deltas) == out.texts[0] and len(deltas) > 1
    assert tok.decoded < 20 * N < N * N / 2


def test_prefill_groups_cut_rows_by_length():
    # rows of one bucket share a block; a long row goes apart from short ones
    assert D.prefill_groups({0: 10, 1: 12, 2: 15}, 1024) == [[0, 1, 2]]
    assert D.prefill_groups({0: 1504, 1: 20, 2: 18}, 4096) == [[2, 1], [0]]
    groups = D.prefill_groups({b: n for b, n in enumerate([300, 5, 290, 7, 40])}, 1024)
    assert sorted(sum(groups, [])) == [0, 1, 2, 3, 4] and len(groups) > 1
    assert {0, 2} <= set(next(g for g in groups if 0 in g))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 3}], ids=["greedy", "sampling"])
def test_mixed_length_batch_prefills_rows_apart_with_the_same_tokens(model, tok, sampling, monkeypatch):
    """A batch of one long and two short prompts prefills in two blocks (the long row
    alone, the short rows together) with the tokens, log-probabilities and min_new_tokens
    behaviour of one padded block for all rows (and, greedy, of each row alone); so does
    lookahead."""
    long = " ".join(TEXTS)[:900] + " In short:"
    texts = [TEXTS[0][:30], long, TEXTS[2][:25]]
    kw = dict(max_new_tokens=12, max_cache_len=CACHE, logprobs=True, min_new_tokens=3, **sampling)
    out = generate(model, tok, texts, **kw)
    lens = [len(r.prompt_token_ids) for r in out.rows]
    assert lens[1] > 4 * max(lens[0], lens[2])  # the rows really differ
    la = generate(model, tok, texts, strategy="lookahead", decoding_length=8, **kw)
    engine = Engine(model)  # a fresh one: its compilation log holds exactly this prefill's blocks
    state = D.prefill(engine, [r.prompt_token_ids for r in out.rows], tok, max_len=CACHE, max_new_tokens=4,
                      sampling=SamplingParams(**{k: v for k, v in sampling.items() if k != "seed"}),
                      seed=sampling.get("seed", 0))
    short = D.prompt_bucket(max(lens[0], lens[2]), CACHE)
    assert [c.split(",")[0] for c in engine.compiled.compilations] == [
        f"prefill(2x{short}", f"prefill(1x{D.prompt_bucket(lens[1], CACHE)}"]
    assert [r.ids[0] for r in state.rows] == [x[0] for x in out.token_ids]

    monkeypatch.setattr(D, "prefill_groups", lambda lengths, S: [sorted(lengths)])  # one block, as before
    one = generate(model, tok, texts, **kw)
    assert out.token_ids == one.token_ids == la.token_ids
    for r, o in zip(out.rows, one.rows):
        np.testing.assert_allclose(r.logprobs, o.logprobs, rtol=1e-5, atol=1e-5)
    if not sampling:  # rows alone (sampling is keyed by the row's index in its batch)
        assert out.token_ids == [generate(model, tok, [t], **kw).token_ids[0] for t in texts]


def test_top_logprobs_are_the_forward_top_k(model, tok):
    """`top_logprobs` (extend: after every forwarded token; verify: where each emitted
    token was chosen, drafted ones included) are the top-k log-probabilities of one
    teacher-forced forward over the same tokens, and the steps' tokens are unchanged."""
    import jax
    import jax.numpy as jnp

    from lookahead_jax.core.acceptance import TokenMatch
    from lookahead_jax.core.tree import verify_block
    from lookahead_jax.models import forward, init_cache

    engine, k, S = Engine(model), 5, 128
    prompt = tok.encode(TEXTS[1])[:30]
    ctx = prompt + generate(model, tok, [prompt], max_new_tokens=8, max_cache_len=S).token_ids[0]
    n = len(prompt)
    T = len(ctx)  # the reference: one causal forward over prompt + greedy continuation
    causal = jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]
    logits, _ = forward(model.params, jnp.asarray([ctx]), jnp.arange(T)[None], init_cache(model.config, 1, T),
                        causal, model.config)
    ref = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))  # [T,V]

    def check(v, i, positions):  # the k best of the reference, ids up to near-ties
        np.testing.assert_allclose(v, np.sort(ref[positions], axis=-1)[:, ::-1][:, :k], atol=1e-4)
        np.testing.assert_allclose(np.take_along_axis(ref[positions], i, axis=-1), v, atol=1e-4)
        assert list(i[:, 0]) == list(ref[positions].argmax(-1))

    P = D.prompt_bucket(n, S)
    seeds, rows = engine.put(np.zeros(1, np.uint32)), engine.put(np.zeros(1, np.int32))
    block = np.zeros((1, P), np.int32)
    block[0, :n] = prompt
    greedy = SamplingParams()
    x = StepInputs(block, seeds, rows, n_new=np.array([n], np.int32))
    outs = [engine.extend(engine.init_cache(1, S), x, StepMode(window=P, **kw)) for kw in ({}, {"top_logprobs": k})]
    out, _ = outs[1]
    nxt, v, i = out.tokens, out.top_logprobs, out.top_ids
    assert int(outs[0][0].tokens[0]) == int(nxt[0]) == ctx[n]
    check(np.asarray(v)[0, :n], np.asarray(i)[0, :n], np.arange(n))

    # a tree after the root ctx[n]: a wrong first token, then the next three (accepted: the
    # path is block nodes 0, 2, 3, 4, not the first ones)
    drafts = [Draft([(ctx[n + 1] + 1) % 200, ctx[n + 1], ctx[n + 2], ctx[n + 3]], [-1, -1, 1, 2])]
    res = []
    for kw in ({}, {"top_logprobs": k}):
        cache = engine.extend(engine.init_cache(1, S), x, StepMode(window=P))[-1]
        res.append(engine.verify(cache, StepInputs.tree(verify_block(np.array([ctx[n]]), drafts, 4), np.ones(1, bool),
                                                        seeds, rows), StepMode(window=S, **kw), rule=TokenMatch(greedy)))
    out, _ = res[1]
    emitted, n_emit, path, v, i = out.tokens, out.n, out.path, out.top_logprobs, out.top_ids
    assert int(n_emit[0]) == int(res[0][0].n[0]) == 4 and list(np.asarray(path)[0, :4]) == [0, 2, 3, 4]
    assert list(np.asarray(emitted)[0, :4]) == list(np.asarray(res[0][0].tokens)[0, :4]) == ctx[n + 1:n + 5]
    check(np.asarray(v)[0, :4], np.asarray(i)[0, :4], np.arange(n, n + 4))
    assert (np.asarray(i)[0, 4:] == -1).all() and (np.asarray(v)[0, 4:] == 0).all()
