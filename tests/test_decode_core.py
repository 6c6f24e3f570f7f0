"""The decode core, driven through `Slots` (insert / step / free) and its plug-in hooks:
drafter protocol, strategies, the decode state's edits (rollback, accept), streaming.

* Every drafter (the trie and a test-only prompt-lookup drafter written against the
  protocol alone) passes the same protocol-conformance checks, and the test-only drafter
  is lossless through the unchanged loop: adding a drafter needs no change to the loop.
* Rolled-back cache slots (drafts rejected by a step, a slot freed and refilled in
  chunks from its cached prefix) leave the K/V and the tokens of a fresh prefill of the
  same tokens; a plug-in `Run`'s edits (`tiny.EditRun`: rollback + accept, accept_steps)
  replace tokens and commit rounds as plain decoding of the edited sequence would.
* Strategy objects and the flat keyword forms are the same call.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core.buckets import prefill_groups, prompt_bucket
from lookahead_jax.core.decode import accept, accept_steps, rollback
from lookahead_jax.core.inputs import StepInputs, StepMode
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.generate import generate
from lookahead_jax.drafters.base import Drafter, PerRowDrafter
from lookahead_jax.drafters.suffix import SuffixDrafter
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.core.drafts import Draft, DraftBatch
from lookahead_jax.core.engine import Engine, engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.strategies import Greedy, Lookahead
from tiny import ByteTokenizer, EditRun, force_token, load_prompts, tiny_model

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


def _request(ids, max_new_tokens, **kw) -> Request:
    """Every request of this file (one place for `Request`'s fields)."""
    fields = {k: kw.pop(k) for k in ("strategy", "sampling_row", "references", "on_text") if k in kw}
    return Request(ids, GenerationParams(max_new_tokens=max_new_tokens, **kw), **fields)


def _slots(model, tok, prompts, S=256, max_new=32, **kw) -> Slots:
    """Slots of one row per prompt (text or ids), every prompt inserted at once."""
    ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    slots = Slots(engine_for(model), tok, len(ids), S, **kw)
    slots.insert(list(range(len(ids))), [_request(x, max_new) for x in ids])
    return slots


def _until(slots, done):
    """Step the slots until done(slots) (or nothing is busy)."""
    while slots.busy and not done(slots):
        slots.step()


def _kv(slots, b, n):
    """Row b's K/V of its first n cache slots, per layer (k then v)."""
    c = slots.state.cache
    return [np.asarray(x)[b, :, :n] for x in c.k + c.v]


def test_a_reused_slot_prefilled_in_chunks_equals_a_fresh_prefill(model, tok):
    """A slot freed mid-decode keeps its old K/V past the new request's length (its length
    is set back, nothing copied); the new prompt, longer, is forwarded in chunks while the
    other slot decodes, each chunk from the cached prefix (a prefill that does not start
    at 0) over those stale slots: its committed K/V equal a fresh whole prefill of the
    prompt, so do its first token and length (the cache's too), the other slot's tokens
    are untouched, and both decode on to the fresh run's tokens."""
    a, b, more = TEXTS[0][:40], TEXTS[1][:30], " and then the next part"
    slots = _slots(model, tok, [a, b], prefill_chunk=8)
    _until(slots, lambda s: len(s.row(0).ids) >= 6)
    row1_before = list(slots.row(1).ids)
    assert slots.free(0).finish == "abort"
    slots.insert(0, _request(tok.encode(a + more), 32))
    assert slots.prefilling == [0]  # slot 1 decodes: one chunk a step
    _until(slots, lambda s: not s.prefilling)
    fresh = _slots(model, tok, [a + more, b])
    r0, f0 = slots.row(0), fresh.row(0)
    assert r0.prompt_ids == f0.prompt_ids and len(r0.ids) == len(f0.ids) == 1
    assert r0.ids == f0.ids  # the same next token
    n = int(slots.state.lengths[0])
    assert n == int(fresh.state.lengths[0]) == int(np.asarray(slots.state.cache.length)[0]) == len(r0.prompt_ids)
    for x, y in zip(_kv(slots, 0, n), _kv(fresh, 0, n)):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    assert slots.row(1).ids[:len(row1_before)] == row1_before
    _until(slots, lambda s: False)
    _until(fresh, lambda s: False)
    assert slots.free(0).ids == fresh.free(0).ids and slots.free(1).ids == fresh.free(1).ids


def test_rejected_drafts_are_rolled_back(model, tok):
    """Drafts wrong at depth 2 (plus a wrong branch): every step writes the K/V of rejected
    nodes past each row's new length, which is simply not advanced over them (rollback).
    After every step each live row holds context[:length] with length = the cache's =
    len(context) - 1; the tokens are plain greedy's; and at the end each row's committed
    K/V equal a fresh prefill of its context, whose next token is the row's last."""
    from test_lossless import OracleDrafter

    texts = [TEXTS[2][:50], TEXTS[1][:30]]
    truth = generate(model, tok, texts, max_new_tokens=24, max_cache_len=256).token_ids
    slots = _slots(model, tok, texts, max_new=24, strategy=Lookahead(decoding_length=16, drafts="trie"),
                   drafter=OracleDrafter(truth, 2))
    st = slots.state
    while slots.busy:
        slots.step()
        res, live = slots.last_step, np.flatnonzero(st.active)
        assert (res.n_emit <= 3).all() and (res.drafted[live] > res.n_emit[live] - 1).all()
        for b in live:
            assert int(st.lengths[b]) == int(np.asarray(st.cache.length)[b]) == len(st.context(b)) - 1
    ctx = [st.context(b) for b in range(2)]
    assert [slots.row(b).ids for b in range(2)] == truth
    for b in range(2):
        fresh = _slots(model, tok, [ctx[b][:-1]], max_new=1)
        assert fresh.row(0).ids == [ctx[b][-1]]
        n = len(ctx[b]) - 1
        for x, y in zip(_kv(slots, b, n), _kv(fresh, 0, n)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_rollback_and_accept_errors(model, tok):
    """A plug-in's rollback must keep the prompt's last token as the root; a prompt that
    does not fit the cache is refused before anything changes."""
    run = EditRun()
    slots = _slots(model, tok, ["Hello there"], run=run)
    run.edits.append(lambda engine, state, *_: rollback(state, [0], 0))
    with pytest.raises(ValueError, match="rollback of row 0"):
        slots.step()
    assert slots.free(0).ids and slots.free_slots == [0]
    with pytest.raises(ValueError, match="cache slots"):
        slots.insert(0, _request([7] * 300, 4))
    assert slots.free_slots == [0]


def test_forced_output_tokens(model, tok):
    """Tokens a plug-in puts in the output (each turn: the step's pick taken back and
    replaced, `force_token`) are output tokens; decoding continues as plain decoding of
    that sequence would."""
    run = EditRun()
    slots = _slots(model, tok, [TEXTS[2][:50]], run=run, max_new=64)
    first = list(slots.row(0).ids)
    forced = tok.encode(" forced", add_special_tokens=False)
    run.edits += [force_token(0, t) for t in forced]
    _until(slots, lambda s: len(s.row(0).ids) >= 1 + len(forced) + 5)
    r0 = slots.row(0)
    assert len(first) == 1 and r0.ids[:1 + len(forced)] == first + forced
    want = generate(model, tok, [r0.prompt_ids + first + forced], max_new_tokens=5, max_cache_len=256).token_ids[0]
    assert r0.ids[1 + len(forced):][:5] == want


def test_accept_after_rollback_replaces_a_token(model, tok):
    """A plug-in's rollback to a slot an earlier step wrote, then accept(cache=None) of
    another token (knnlm's correction): the row's token there is replaced, its length
    restored, no step counted, the other row untouched, the replaced token never streamed,
    and decoding on gives plain decoding's tokens of the edited sequence."""
    run = EditRun()
    slots = _slots(model, tok, [TEXTS[2][:50], TEXTS[1][:30]], run=run, max_new=64)
    st, r0, events = slots.state, slots.row(0), []
    run.hold[0] = 5  # row 0's sixth token is replaced: held from the events
    while len(r0.ids) < 6:
        events += [e.tokens for e in slots.step() if e.slot == 0]
    n, steps, row1, keep = int(st.lengths[0]), st.steps, list(slots.row(1).ids), r0.ids[:-1]
    t = next(x for x in tok.encode("QR", add_special_tokens=False) if x != r0.ids[-1])
    kept = []

    def replace(engine, state, *_):
        rollback(state, [0], n - 1)
        kept.append(accept(state, [0], [t]))

    run.edits.append(replace)
    slots.step()
    assert kept == [[[t]]]
    assert r0.ids == keep + [t] and int(st.root[0]) == t and st.steps == steps
    assert int(st.lengths[0]) == n == int(np.asarray(st.cache.length)[0])
    assert slots.row(1).ids == row1
    run.edits.append(lambda engine, state, *_: accept(state, [0, 1], [t]))
    with pytest.raises(ValueError, match="live rows"):
        slots.step()
    del run.hold[0]
    while len(r0.ids) < len(keep) + 6:
        events += [e.tokens for e in slots.step() if e.slot == 0]
    want = generate(model, tok, [r0.prompt_ids + keep + [t]], max_new_tokens=5, max_cache_len=256).token_ids[0]
    assert r0.ids[len(keep) + 1:][:5] == want
    assert sum(events, [r0.ids[0]]) == r0.ids  # the events carried the final tokens only


def test_accept_steps_drops_what_a_row_ran_past_its_end(model, tok):
    """A plug-in's accept_steps (knnlm's round, committed after it ran): each row takes its
    tokens in order up to its finish; a row that met EOS mid-round keeps none after it and
    its cache length is set back to the slots it committed; a row that did not step is
    untouched; every step is counted; a finished row may not step."""
    eos = 2
    run = EditRun()
    slots = _slots(model, tok, [TEXTS[2][:40], TEXTS[1][:30], TEXTS[0][:20]], run=run, max_new=64, eos_ids=(eos,))
    st = slots.state
    L, steps, row_steps = st.lengths.copy(), st.steps, [r.steps for r in st.rows]
    ids = [list(r.ids) for r in st.rows]
    a, b, c = tok.encode("abc", add_special_tokens=False)
    active = np.array([[1, 1, 0]] * 3, bool)
    tokens = np.array([[a, b, 0], [eos, c, 0], [c, a, 0]])

    def round_(engine, state, *_):  # its own steps' cache: each row's length advanced per step it ran
        cache = state.cache.replace(length=state.cache.length + np.asarray(active.sum(axis=0), np.int32))
        accept_steps(state, active, tokens, np.zeros((3, 3)), cache)

    run.edits.append(round_)
    events = {e.slot: e for e in slots.step()}
    assert slots.row(0).ids == ids[0] + [a, eos] and slots.row(0).finish == "eos" == events[0].finish
    assert slots.row(1).ids == ids[1] + [b, c, a] and not slots.row(1).finish
    assert slots.row(2).ids == ids[2] and int(st.root[1]) == a
    assert list(st.lengths) == [L[0] + 2, L[1] + 3, L[2]] == list(np.asarray(st.cache.length))
    assert st.steps == steps + 3
    assert [r.steps for r in st.rows] == [row_steps[0] + 2, row_steps[1] + 3, row_steps[2]]
    run.edits.append(lambda engine, state, *_: accept_steps(state, np.array([[1, 1, 0]], bool),
                                                            np.array([[a, b, 0]]), None, state.cache))
    with pytest.raises(ValueError, match="finished row"):
        slots.step()


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
    assert prefill_groups({0: 10, 1: 12, 2: 15}, 1024) == [[0, 1, 2]]
    assert prefill_groups({0: 1504, 1: 20, 2: 18}, 4096) == [[2, 1], [0]]
    groups = prefill_groups({b: n for b, n in enumerate([300, 5, 290, 7, 40])}, 1024)
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
    engine = Engine(model)  # a fresh one: its compilation log holds exactly this insert's blocks
    slots = Slots(engine, tok, 3, CACHE, sampling=SamplingParams(**{k: v for k, v in sampling.items() if k != "seed"}))
    slots.insert([0, 1, 2], [_request(r.prompt_token_ids, 4, **sampling) for r in out.rows])
    short = prompt_bucket(max(lens[0], lens[2]), CACHE)
    assert [c.split(",")[0] for c in engine.compiled.compilations] == [
        f"prefill(2x{short}", f"prefill(1x{prompt_bucket(lens[1], CACHE)}"]
    assert [slots.row(b).ids[0] for b in range(3)] == [x[0] for x in out.token_ids]

    # one block, as before (the grouping the state's forward looks up)
    monkeypatch.setattr("lookahead_jax.core.decode.prefill_groups", lambda lengths, S: [sorted(lengths)])
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

    P = prompt_bucket(n, S)
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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("P,window", [(8, 128), (40, 128), (40, 512)])
def test_a_block_of_some_rows_works_on_them_in_place(family, P, window):
    """`verify.extend_step` with `sel` (a prefill block of a few of the server's rows)
    reads and writes those rows' slots in the whole cache: their K/V and picks are bitwise
    those of a cache holding only them, every other row is untouched, and only their
    lengths move. (8 tokens: the CPU attention kernel over rows; 40 at a 128 window: the
    jnp definition; 40 at 512: the kernel's prefill form. gemma3: sliding-window layers.)"""
    import jax
    import jax.numpy as jnp

    from lookahead_jax.core.verify import extend_step
    from lookahead_jax.models.cache import KVCache

    m = tiny_model(family)
    rng = np.random.default_rng(P + window)
    B, S, L = 4, 512, m.config.n_layers
    shape = (B, m.config.n_kv_heads, S, m.config.head_dim)
    full = KVCache(k=tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(L)),
                   v=tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(L)),
                   length=jnp.asarray([30, 7, 60, 12], jnp.int32))
    sel = np.array([2, 0], np.int32)
    tokens = rng.integers(3, 250, (2, P)).astype(np.int32)
    n_new = np.array([P, P - 3], np.int32)
    x = StepInputs(tokens, np.zeros(2, np.uint32), sel.copy(), n_new=n_new)
    mode = StepMode(window=window, emit=False)
    step = jax.jit(lambda c, x: extend_step(m.params, c, x, config=m.config, mode=mode))
    before = jax.tree.map(np.asarray, full)
    out, got = step(full, x._replace(sel=sel))
    alone = KVCache(k=tuple(jnp.asarray(b[sel]) for b in before.k), v=tuple(jnp.asarray(b[sel]) for b in before.v),
                    length=jnp.asarray(before.length[sel]))
    out1, want = step(alone, x)
    assert np.array_equal(np.asarray(out.tokens), np.asarray(out1.tokens))
    for g, w, b in zip(got.k + got.v, want.k + want.v, before.k + before.v):
        g, w = np.asarray(g), np.asarray(w)
        assert np.array_equal(g[sel], w)  # the block's rows: their own slots, as alone
        rest = [r for r in range(B) if r not in sel]
        assert np.array_equal(g[rest], b[rest])  # the others untouched
    want_len = before.length.copy()
    want_len[sel] += n_new - 1  # emit=False: the last forwarded token stays the root
    assert np.array_equal(np.asarray(got.length), want_len)
