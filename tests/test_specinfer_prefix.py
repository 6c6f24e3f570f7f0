"""SpecInfer's draft model under the prefix cache (`drafters.draft_prefix`): with
`Slots(prefill_chunk=C, prefix_cache=)` the draft's prompt K/V are cached too, keyed by
tokens and shared across requests, so a prompt beginning with a cached passage has the
draft forward only the rest.

* Tokens: requests sharing a long passage, inserted one after another while others
  decode and two in one insert, greedy and sampled ("mss": the tokens depend on the
  draft's probabilities), every step drafting (budget "fixed") or an auto budget's
  plain and drafted steps mixed (rows whose draft is behind by decoded tokens): token for
  token the same requests on Slots without the prefix cache (whose draft forwards in the
  same blocks) and on Slots whose cache holds nothing; the draft's cache served units.
* Exactness by construction, checked: a request that took the draft's cached units holds,
  over its whole prompt, the draft K/V bit for bit of the same request forwarded with no
  unit cached, and its draft forwarded as many fewer blocks as it took.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core.engine import Engine
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.prefix_cache import PrefixCache
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.drafters.draft_prefix import DraftPrefixCache
from lookahead_jax.strategies import SpecInfer
from test_specinfer import perturbed
from tiny import ByteTokenizer, drive_slots, load_prompts, tiny_model

C = 16
U = C - 1
CACHE = 512
BUDGET = 64 << 20
# a cache that holds nothing: every prompt forwarded whole, in the same blocks
NOTHING = 1
PASSAGE = load_prompts()[0]["prompt"][:150]  # 151 tokens with BOS
QUESTIONS = [" Who wrote it?", " What is it about?", " When?"]
TEXTS = [PASSAGE + q for q in QUESTIONS] + [load_prompts(1)[1]["prompt"][-60:], PASSAGE + QUESTIONS[0]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model)


@pytest.fixture(scope="module")
def strat(model):
    return SpecInfer(draft_model=perturbed(model, 0.3), expansion=(1, 1, 2), budget="fixed")


def slots_for(engine, tok, strat, budget, n=2) -> Slots:
    """Slots with chunked prefill, the cache on (`budget` bytes) or off (None); both
    prefix caches empty."""
    engine.stores.clear(PrefixCache)
    slots = Slots(engine, tok, n, CACHE, strat, prefill_chunk=C, prefix_cache=budget)
    slots.drafter.engine.stores.clear(DraftPrefixCache)  # (the drafter takes its store at the first insert)
    return slots


def requests(tok, sampled: bool, texts=TEXTS) -> list:
    kw = dict(temperature=0.8, top_p=0.95) if sampled else {}
    return [Request(tok.encode(t), GenerationParams(max_new_tokens=14 + 3 * (i % 3), seed=11 + i, **kw),
                    sampling_row=i) for i, t in enumerate(texts)]


def through(engine, tok, strat, budget, sampled: bool) -> tuple:
    """TEXTS one after another (a request enters while others decode), then two sharing
    the passage in one insert: each request's ids, and the drafter's summary."""
    slots = slots_for(engine, tok, strat, budget)
    try:
        got = [row.ids for row, _ in drive_slots(slots, requests(tok, sampled), every=3)]
        pair = requests(tok, sampled, [PASSAGE + QUESTIONS[2], PASSAGE + QUESTIONS[1]])
        slots.insert([0, 1], pair)
        done = {}
        while slots.busy:
            for ev in slots.step():
                if ev.finish:
                    done[ev.slot] = slots.free(ev.slot).ids
        return got + [done[0], done[1]], slots.drafter.summary()
    finally:
        slots.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_tokens_equal_those_without_the_cache(engine, tok, strat, sampled):
    """With the prefix cache, without it, and with one that holds nothing: the same tokens,
    sampled ones too (with chunked prefill the draft forwards in the same blocks either way:
    the "mss" sampler's draws follow the draft's probabilities, so its rounding counts)."""
    want, off = through(engine, tok, strat, None, sampled)
    none_held, none = through(engine, tok, strat, NOTHING, sampled)
    got, summary = through(engine, tok, strat, BUDGET, sampled)
    assert got == want == none_held
    assert none["draft_prefix_cache_hits"] == 0 and "draft_prefix_cache_hits" not in off  # (no store when off)
    # the passage's units came from the draft's cache: every request with it but the first
    n = len(TEXTS) + 2
    assert summary["draft_prefix_cache_lookups"] == n
    assert summary["draft_prefix_cache_hit_requests"] == n - 2  # (not the first, nor the unrelated prompt)
    assert summary["draft_prefix_cache_hit_blocks"] >= (n - 2) * (len(PASSAGE) // U)


def test_auto_budget_behind_rows(engine, tok, model, monkeypatch):
    """An auto budget's plain steps leave rows behind by decoded tokens: their draft
    catches up over prompt and decoded tokens in blocks, taking the cached units (a fixed
    pattern of drafted and plain steps); greedy, so the tokens are plain greedy decoding's
    with and without the cache. (Sampled tokens under "mss" follow which steps drafted,
    and the target's cached blocks move a request's first decode step: not compared.)"""
    from lookahead_jax.drafters.draft_prefix import DraftPrefix
    from lookahead_jax.strategies.specinfer import DraftBudget

    seq = [True, False, False, False, False, False, True, True]
    calls, caught = [], []

    def choose(self):  # (no probes: every decoding row drafts at a drafted step)
        self.probing = False
        calls.append(1)
        return seq[len(calls) % len(seq)]

    catch_up = DraftPrefix.catch_up

    def spy(self, cache, context, n, *a):
        caught.append(int(n))
        return catch_up(self, cache, context, n, *a)

    monkeypatch.setattr(DraftBudget, "choose", choose)
    monkeypatch.setattr(DraftPrefix, "catch_up", spy)
    strat = SpecInfer(draft_model=perturbed(model, 0.3), expansion=(1, 1, 2), budget="auto")
    runs = []
    for budget in (None, BUDGET):  # (both catch up in blocks: `caught` keeps the cached run's)
        caught.clear()
        slots = slots_for(engine, tok, strat, budget)
        try:
            runs.append(([row.ids for row, _ in drive_slots(slots, requests(tok, False), every=3)],
                         slots.drafter.summary()))
        finally:
            slots.close()
    assert runs[1][0] == runs[0][0]
    assert runs[1][1]["draft_prefix_cache_hit_blocks"] > 0
    lags = [n - len(tok.encode(t)) for n, t in zip(caught, TEXTS)]  # (the requests catch up in order)
    assert len(caught) == len(TEXTS) and max(lags) >= 3  # a row behind by decoded tokens


def _draft_kv(slots, row: int, n: int) -> list:
    """The draft cache's K and V of row `row`, slots 0..n-1, every layer, as host arrays."""
    cache = slots.drafter.cache
    return [np.asarray(x[row, :, :n]) for x in cache.k + cache.v]


def _step_counting(slots) -> int:
    """One step; returns the draft's prefill forwards in it (its catch-up blocks)."""
    e, calls = slots.drafter.engine, []
    extend = e.extend
    e.extend = lambda *a, **k: (calls.append(k.get("ahead")), extend(*a, **k))[1]
    try:
        slots.step()
    finally:
        del e.extend
    return sum(a is None for a in calls)


def test_cached_draft_units_are_bit_exact(engine, tok, strat):
    """Request a (the passage) stores the draft's units; request b (another question)
    takes them into another row: b's draft K/V over its whole prompt are bit for bit
    those of b forwarded with no unit cached, and its draft forwards as many fewer blocks
    as it took. Then both decode the same tokens."""
    a, b = tok.encode(PASSAGE + QUESTIONS[0]), tok.encode(PASSAGE + QUESTIONS[2])
    p = GenerationParams(max_new_tokens=8)

    cold = slots_for(engine, tok, strat, BUDGET)
    cold.insert(0, Request(b, p))  # nothing decoding: every block at insert
    n_cold = _step_counting(cold)  # the draft's catch-up: none cached
    want = _draft_kv(cold, 0, len(b))
    assert n_cold == -(-len(b) // U) and cold.drafter.prefix.cache.hits == 0

    warm = slots_for(engine, tok, strat, BUDGET)
    warm.insert(1, Request(a, p))
    warm.step()  # a's draft catch-up stores its units (from row 1)
    stored = warm.drafter.prefix.cache.stored
    assert stored == len(a) // U
    while warm.busy:
        for ev in warm.step():
            if ev.finish:
                warm.free(ev.slot)
    warm.insert(0, Request(b, p))
    n_warm = _step_counting(warm)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    hit = warm.drafter.prefix.cache.hit_blocks
    assert hit == min(common // U, len(b) // U) >= 8
    assert n_warm == n_cold - hit
    for layer, (g, w) in enumerate(zip(_draft_kv(warm, 0, len(b)), want)):
        assert g.tobytes() == w.tobytes(), layer
    for s in (cold, warm):
        while s.busy:
            s.step()
    assert warm.row(0).ids == cold.row(0).ids
    cold.close()
    warm.close()
