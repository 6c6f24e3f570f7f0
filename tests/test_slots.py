"""The slot API (`core.slots.Slots`): requests inserted into and freed from a decode state
of fixed slots while the other slots decode.

* A request inserted mid-decode, into any slot, gives exactly the tokens it gives alone
  (greedy, lookahead, SpecInfer, sampling), and a freed slot is reused.
* Greedy and lookahead (or SpecInfer) requests share one batch.
* Retrieval strategies (ralm, ralmspec, knnlm) on Slots: tests/test_ralm.py,
  tests/test_knnlm.py (test_slots_*).
* What cannot share a batch is a clear error; every drafter, budget policy, strategy and
  run satisfies its protocol; the verify step's named results carry hidden states.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.acceptance import TokenMatch
from lookahead_jax.core.budget import AutoBudget, BudgetPolicy, FixedBudget
from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.drafters.base import Drafter, PerRowDrafter
from lookahead_jax.drafters.merge import MergedDrafter
from lookahead_jax.drafters.model import ModelDrafter
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.generate import generate
from lookahead_jax.models import hidden_states, init_cache
from lookahead_jax.strategies import REGISTRY, Greedy, Lookahead, RaLM, Run, SpecInfer, Strategy
from tiny import ByteTokenizer, load_prompts, tiny_model

MAX_NEW = 24
CACHE = 1024
TEXTS = [p["prompt"][:300] for p in load_prompts(2)]  # 6 prompts: RAG / code / math


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return [tok.encode(t) for t in TEXTS]


def _request(ids, max_new_tokens, **kw) -> Request:
    """The requests this file's newer tests build (one place for `Request`'s fields)."""
    fields = {k: kw.pop(k) for k in ("strategy", "sampling_row", "references", "on_text") if k in kw}
    return Request(ids, GenerationParams(max_new_tokens=max_new_tokens, **kw), **fields)


def alone(model, tok, i, **kw):
    """Prompt i decoded alone by generate (sampling row i, as in a batch of all prompts)."""
    return generate(model, tok, [TEXTS[i]], max_new_tokens=MAX_NEW, max_cache_len=CACHE, first_index=i,
                    **kw).token_ids[0]


def drive(slots, ids, order, max_new=MAX_NEW, seed=0, every=2, strategy=None, plain=(), sampling=None):
    """Insert the prompts `order` into the slots over time: one whenever a slot is free,
    after every `every` steps; a finished request is freed at once. Returns {prompt: ids}."""
    queue, out, holder, n = list(order), {}, {}, 0
    while queue or slots.busy:
        if queue and slots.free_slots and n % every == 0:
            i = queue.pop(0)
            s = slots.free_slots[-1]  # the highest free slot: prompts land in varied slots
            req = Request(ids[i], GenerationParams.of(sampling, max_new_tokens=max_new, seed=seed), sampling_row=i,
                          strategy=Greedy() if i in plain else strategy)
            holder[s] = i
            for ev in slots.insert(s, req):
                if ev.finish:
                    out[i] = slots.free(s).ids
        for ev in slots.step():
            if ev.finish:
                out[holder[ev.slot]] = slots.free(ev.slot).ids
        n += 1
    return out


@pytest.mark.parametrize("strategy", ["greedy", "lookahead", "lookahead-trie"])
def test_inserted_mid_decode_equals_alone(model, tok, ids, strategy):
    strat = {"greedy": None, "lookahead": Lookahead(decoding_length=7),  # the suffix drafter
             "lookahead-trie": Lookahead(decoding_length=7, drafts="trie")}[strategy]
    slots = Slots(engine_for(model), tok, 3, CACHE, strat)
    got = drive(slots, ids, [0, 1, 2, 3, 4, 5], strategy=strat)
    kw = {} if strat is None else dict(strategy="lookahead", decoding_length=7, drafts=strat.drafts)
    for i in range(len(TEXTS)):
        assert got[i] == alone(model, tok, i, **kw), f"prompt {i}"
    assert slots.free_slots == [0, 1, 2]  # every slot was freed, and 6 requests used 3 slots


def test_suffix_auto_inserted_mid_decode_equals_alone(model, tok, ids):
    """The suffix drafter under auto in the slot engine: requests enter and leave rows
    while others decode (its per-row stores begin and end by row, its outputs enter the
    engine's cache): each gets greedy's tokens alone."""
    strat = Lookahead(drafts="suffix")
    slots = Slots(engine_for(model), tok, 3, CACHE, strat)
    got = drive(slots, ids, [0, 1, 2, 3, 4, 5], strategy=strat)
    for i in range(len(TEXTS)):
        assert got[i] == alone(model, tok, i), f"prompt {i}"
    assert slots.free_slots == [0, 1, 2]


@pytest.mark.slow
def test_sampling_inserted_mid_decode_equals_alone(model, tok, ids):
    sp = SamplingParams(0.8, 0, 0.95)
    slots = Slots(engine_for(model), tok, 2, CACHE, Lookahead(decoding_length=7), sampling=sp)
    got = drive(slots, ids, [3, 0, 4], seed=5, strategy=Lookahead(decoding_length=7), every=3, sampling=sp)
    for i in (3, 0, 4):
        assert got[i] == alone(model, tok, i, temperature=0.8, top_p=0.95, seed=5)


@pytest.mark.slow
def test_specinfer_inserted_mid_decode_equals_alone(model, tok, ids):
    draft = tiny_model("llama", seed=2)
    strat = SpecInfer(draft_model=draft, expansion=(1, 1, 2), budget="fixed")
    slots = Slots(engine_for(model), tok, 2, CACHE, strat)
    got = drive(slots, ids, [2, 5, 1], strategy=strat)
    for i in (2, 5, 1):
        assert got[i] == alone(model, tok, i), f"prompt {i}"


@pytest.mark.parametrize("pattern", ["plain", "mixed"])
def test_specinfer_inserts_catch_the_draft_up_lazily(model, tok, ids, monkeypatch, pattern):
    """A request inserted into SpecInfer's slots is forwarded through the draft model only
    by the first step that drafts (`ModelDrafter.propose`): with an auto budget that keeps
    decoding plainly, no prompt runs through the draft at all (its cache stays empty); with
    drafted and plain steps mixed, the catch-up happens at the drafted ones. Same tokens as
    alone."""
    from lookahead_jax.strategies.specinfer import DraftBudget

    calls = []
    seq = [False] if pattern == "plain" else [True, False, False, True, False]
    monkeypatch.setattr(DraftBudget, "choose", lambda self: calls.append(1) or seq[len(calls) % len(seq)])
    from lookahead_jax.drafters.model import CATCH_UP, ModelDrafter

    lags, catch_up = [], ModelDrafter._catch_up

    def spy(self, state, upto):  # the rows a catch-up forwards, and how far behind each was
        lags.append([int(u - d) for u, d in zip(upto, self.dlen) if u > d])
        return catch_up(self, state, upto)

    monkeypatch.setattr(ModelDrafter, "_catch_up", spy)
    strat = SpecInfer(draft_model=tiny_model("llama", seed=2), expansion=(1, 1, 2), budget="auto")
    slots = Slots(engine_for(model), tok, 2, CACHE, strat)
    got = drive(slots, ids, [2, 5, 1], strategy=strat)
    # only rows further behind than a step's own catch-up are forwarded apart (a new prompt)
    assert all(n >= CATCH_UP for row in lags for n in row) and (pattern == "plain") == (not lags)
    for i in (2, 5, 1):
        assert got[i] == alone(model, tok, i), f"prompt {i}"
    # the first drafted step of each choose() pattern forwards what the draft lacks
    assert (slots.drafter.catch_up_s == 0.0) == (pattern == "plain")
    assert (int(slots.drafter.dlen.max()) == 0) == (pattern == "plain")


def test_specinfer_probes_draft_only_rows_that_lag_little(model, tok, ids, monkeypatch):
    """A probe of the auto budget (its first drafted steps, and one after a plain hold)
    drafts only the rows whose draft context lags by at most PROBE_LAG tokens, or the one
    that lags least, so it never forwards every slot's prompt through the draft; the gain
    it reads is that of the rows it drafted. Same tokens as alone."""
    from lookahead_jax.strategies.specinfer import DraftBudget

    monkeypatch.setattr(DraftBudget, "PROBE_LAG", 0)
    seq = [True, False, False, True, True]  # a probe, plain, plain, a probe, a drafted step

    def choose(self):
        k = self.drafted + self.plain
        self.probing = k % len(seq) in (0, 3)
        return seq[k % len(seq)]

    monkeypatch.setattr(DraftBudget, "choose", choose)
    lags, drafted, catch_up = [], [], ModelDrafter._catch_up
    propose = ModelDrafter.propose

    def spy(self, state, upto):
        lags.append([int(u - d) for u, d in zip(upto, self.dlen) if u > d])
        return catch_up(self, state, upto)

    def spy_propose(self, state, budget):
        probe, n = self.probe_lag is not None, len(lags)
        out = propose(self, state, budget)
        drafted.append((probe, int(state.active.sum()), int(self.drafted.sum()),
                        sum(len(d.tokens) > 0 for d in out.drafts), sum(len(r) for r in lags[n:])))
        return out

    monkeypatch.setattr(ModelDrafter, "_catch_up", spy)
    monkeypatch.setattr(ModelDrafter, "propose", spy_propose)
    strat = SpecInfer(draft_model=tiny_model("llama", seed=2), expansion=(1, 1, 2), budget="auto")
    slots = Slots(engine_for(model), tok, 2, CACHE, strat)
    got = drive(slots, ids, [2, 5, 1, 3], strategy=strat)
    for i in (2, 5, 1, 3):
        assert got[i] == alone(model, tok, i), f"prompt {i}"
    probes = [d for d in drafted if d[0]]
    full = [d for d in drafted if not d[0]]
    assert probes and full
    # a probe drafts (and catches up) fewer rows than are active whenever two rows lag
    assert any(n_draft < n_active for _, n_active, n_draft, _, _ in probes)
    assert all(n_draft >= 1 and n_drafts == n_draft for _, _, n_draft, n_drafts, _ in probes)
    assert all(n_draft == n_active for _, n_active, n_draft, _, _ in full)
    # a step's catch-up forwards only rows it drafts (a probe's skipped rows stay behind)
    assert all(n_fwd <= n_draft for _, _, n_draft, _, n_fwd in drafted)


def test_draft_budget_measures_outlive_the_batch(tok):
    """The auto budget's measurements (the draft's cost, the gains) are kept per engine,
    draft, rule and batch shape: the next generate call of the same shape starts from
    them (no probe), another batch size does not. (An engine of its own: the verify-cost
    ratio rho blends the prior with the step times the engine keeps per batch shape, and
    the module's engine holds whatever earlier tests in this process timed, so rho, and
    the choice below, would depend on which tests ran before and on the host's load.)"""
    from lookahead_jax.strategies.specinfer import DraftBudget

    engine = engine_for(tiny_model("llama"))
    strat = SpecInfer(draft_model=tiny_model("llama", seed=2), expansion=(1, 1, 2), budget="auto")
    drafter = strat.drafter(engine)

    from lookahead_jax.prompts import encode_prompts

    def setup(B):  # the budget of Slots of B rows, set up at their first insert
        slots = Slots(engine, tok, B, CACHE, strat, drafter=drafter)
        slots.insert(list(range(B)), [_request(x, 4) for x in encode_prompts(tok, TEXTS[:B], chat=False)])
        slots.close()
        return slots.budget

    a = setup(2)
    assert isinstance(a, DraftBudget) and a.delta is None and a.choose() and a.probing
    a.delta = 0.5
    a.gains.extend([0.1, 0.2])  # 1.15 tokens per drafted step against 1.03 (rho + 0.5): plain
    b = setup(2)
    assert b.measures is a.measures and b.delta == 0.5 and list(b.gains) == [0.1, 0.2]
    assert not b.choose() and not b.probing  # measured: plain from the first step, held
    # its summary reports its own drafted steps (none), not the gains carried from a's batch
    assert b.summary()["draft_budget"]["mean_tokens_per_drafted_step"] is None
    c = setup(1)
    assert c.measures is not a.measures and c.delta is None


def test_greedy_and_lookahead_share_a_batch(model, tok, ids):
    strat = Lookahead(decoding_length=7)
    slots = Slots(engine_for(model), tok, 3, CACHE, strat)
    got = drive(slots, ids, [0, 1, 2, 3], strategy=strat, plain={1, 2})
    for i in range(4):
        assert got[i] == alone(model, tok, i)


def test_free_mid_decode_and_reuse(model, tok, ids):
    slots = Slots(engine_for(model), tok, 2, CACHE)
    slots.insert([0, 1], [Request(ids[0], GenerationParams(max_new_tokens=MAX_NEW), sampling_row=0),
                          Request(ids[1], GenerationParams(max_new_tokens=MAX_NEW), sampling_row=1)])
    for _ in range(3):
        slots.step()
    row = slots.free(0)
    assert row.finish == "abort" and len(row.ids) == 4  # the first token + 3 steps
    assert slots.free_slots == [0] and slots.busy == [1]
    with pytest.raises(ValueError, match="already free"):
        slots.free(0)
    slots.insert(0, Request(ids[2], GenerationParams(max_new_tokens=MAX_NEW), sampling_row=2))  # the slot reused mid-decode
    out = {}
    while slots.busy:
        for ev in slots.step():
            if ev.finish:
                out[ev.slot] = slots.free(ev.slot).ids
    assert out[0] == alone(model, tok, 2) and out[1] == alone(model, tok, 1)


def test_slot_errors(model, tok, ids):
    eng = engine_for(model)
    slots = Slots(eng, tok, 2, 256, Lookahead(decoding_length=7))
    slots.insert(0, Request(ids[0][:50], GenerationParams(max_new_tokens=8)))
    with pytest.raises(ValueError, match="holds a request"):
        slots.insert(0, Request(ids[1][:50], GenerationParams(max_new_tokens=8)))
    with pytest.raises(ValueError, match="must be a GenerationParams"):  # the options come checked
        slots.insert(1, Request(ids[1][:50], dict(max_new_tokens=8, temperature=0.7)))
    with pytest.raises(ValueError, match="Slots of its own"):
        slots.insert(1, Request(ids[1][:50], GenerationParams(max_new_tokens=8),
                                strategy=SpecInfer(draft_model=model)))
    with pytest.raises(ValueError, match="cache slots"):
        slots.insert(1, Request(ids[1][:50], GenerationParams(max_new_tokens=250)))
    with pytest.raises(ValueError, match="not in"):
        slots.insert(2, Request(ids[1][:50], GenerationParams(max_new_tokens=8)))
    ralm = Slots(eng, tok, 2, 256, RaLM(retriever=_NoRetriever()))  # retrieval runs drive their slots
    with pytest.raises(ValueError, match="only its own requests"):
        ralm.insert(0, Request(ids[1][:50], GenerationParams(max_new_tokens=8), strategy=Greedy()))


class _NoRetriever:
    """Satisfies RaLM's checks; never asked anything in these tests."""

    def __init__(self):
        from lookahead_jax.retrieval.corpus import Corpus

        self.corpus = Corpus.from_passages(["a passage", "another passage"])

    def retrieve(self, queries, k=1):
        raise AssertionError("never called")

    def retrieve_from(self, query, ids, k=1):
        raise AssertionError("never called")


# ----------------------------------------------------------------------------- protocols
def test_protocol_conformance(model):
    eng = engine_for(model)
    trie = TrieDrafter()
    drafters = [trie, ModelDrafter(eng, (1, 1)), MergedDrafter(ModelDrafter(eng, (1,)), TrieDrafter(max_nodes=4)),
                PerRowDrafter()]
    for d in drafters:
        assert isinstance(d, Drafter), type(d).__name__
    for b in (FixedBudget(7), AutoBudget((0, 1, 3), {0: 1.0, 1: 1.1, 3: 1.2}, trie.acceptance)):
        assert isinstance(b, BudgetPolicy), type(b).__name__
    for cls in REGISTRY.values():
        assert isinstance(cls.__new__(cls), Strategy), cls.__name__
    from lookahead_jax.strategies.knnlm import KnnRun, KnnSpecRun

    assert isinstance(KnnRun.__new__(KnnRun), Run) and isinstance(KnnSpecRun.__new__(KnnSpecRun), Run)
    tok = ByteTokenizer()
    for strat in (RaLM(retriever=_NoRetriever()), REGISTRY["ralmspec"](retriever=_NoRetriever())):
        assert isinstance(strat.start(tok, 2, engine=eng), Run), strat.name


def test_verify_step_returns_hidden_states(model):
    """The named result of a verify step carries the final hidden state of every block
    node when asked: those of a plain forward of the same tokens."""
    eng = engine_for(model)
    cfg = model.config
    from lookahead_jax.core.tree import verify_block
    from lookahead_jax.core.drafts import Draft
    from lookahead_jax.core.inputs import StepInputs, StepMode

    cache = init_cache(cfg, 1, 256)
    prompt = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
    seed, row = jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32)
    first, cache = eng.extend(cache, StepInputs(prompt, seed, row, n_new=np.array([8], np.int32)),
                              StepMode(window=16, hidden=True))
    assert first.hidden.shape == (1, cfg.d_model) and first.logprobs is None
    blk = verify_block(np.asarray(first.tokens), [Draft([3, 4], [-1, 0])], 2)
    out, _ = eng.verify(cache, StepInputs.tree(blk, np.ones(1, bool), seed, row),
                        StepMode(window=128, hidden=True), rule=TokenMatch(SamplingParams()))
    seq = np.concatenate([prompt[0], np.asarray(first.tokens), [3, 4]])[None].astype(np.int32)
    L = seq.shape[1]
    h, _ = hidden_states(model.params, jnp.asarray(seq), jnp.arange(L)[None], init_cache(cfg, 1, 256),
                         jnp.tril(jnp.ones((1, L, 256), bool), k=0), cfg)
    np.testing.assert_allclose(np.asarray(first.hidden[0]), np.asarray(h[0, 7]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.hidden[0]), np.asarray(h[0, 8:11]), atol=1e-4)
    assert out.hidden.shape == (1, 3, cfg.d_model)


@pytest.mark.parametrize("strategy,sampled,chunk", [(None, True, None), (Lookahead(decoding_length=7), False, None),
                                                    (Lookahead(decoding_length=3), False, 24),
                                                    (Greedy(device_steps=4), True, None)])
def test_warm_up_compiles_every_step_before_requests(model, tok, ids, strategy, sampled, chunk):
    """After `warm_up`, requests of any prompt length decode (greedy, and sampled when
    warmed up for it) at every tree size the budget may pick and every attention window,
    without compiling anything more, and give the tokens they give on slots that were not
    warmed up (the warm-up leaves the slots empty)."""
    eng = engine_for(model)
    S = 512
    cold = Slots(eng, tok, 3, S, strategy)
    want = drive(cold, ids, range(len(ids)), seed=3)
    cold.close()
    warm = Slots(eng, tok, 3, S, strategy, prefill_chunk=chunk)
    n_steps = []
    compiled = warm.warm_up(sampled=sampled, progress=lambda done, total: n_steps.append((done, total)))
    assert n_steps[-1][0] == n_steps[-1][1] == len(n_steps) and compiled <= len(n_steps)
    assert warm.free_slots == [0, 1, 2] and not warm.busy and int(np.asarray(warm.state.cache.length).max()) == 0
    before = list(eng.compiled.compilations)
    assert drive(warm, ids, range(len(ids)), seed=3) == want
    # other prompt buckets, the last window (330 + 60 tokens > 256), a sampled row if warmed
    long_ids = [(ids[i] * 8)[:n] for i, n in ((0, 330), (1, 100), (2, 40))]
    for s, p in reversed(list(enumerate(long_ids))):  # the long ones while others decode (chunked)
        sp = SamplingParams(temperature=0.8, top_p=0.9) if sampled and s == 1 else None
        warm.insert(s, Request(p, GenerationParams.of(sp, max_new_tokens=60, seed=s)))
    while warm.busy:
        warm.step()
    assert eng.compiled.compilations == before, eng.compiled.compilations[len(before):]
    warm.close()
    busy = Slots(eng, tok, 2, S, strategy)
    busy.insert(0, Request(ids[0], GenerationParams(max_new_tokens=4)))
    with pytest.raises(RuntimeError, match="no request"):
        busy.warm_up()
