"""The engine's stores (`core.engine.Stores`): one store per owning plug-in, of the plug-in's
own type, made on first use and kept (the same object) until cleared; the plug-ins'
shared drafters reach theirs through it. No model: the drafters' `shared` only read
`engine.stores`."""

from __future__ import annotations

import types

from lookahead_jax.core.budget import AcceptanceStats
from lookahead_jax.core.engine import Stores
from lookahead_jax.drafters.suffix import SuffixCache, SuffixDrafter, SuffixStore
from lookahead_jax.drafters.trie import TrieDrafter, TrieStore
from lookahead_jax.knnlm.search import KnnlmStore
from lookahead_jax.strategies.specinfer import DraftStore


def test_of_makes_once_and_keeps():
    stores = Stores()
    assert len(stores) == 0 and TrieStore not in stores and stores.peek(TrieStore) is None
    a = stores.of(TrieStore)
    assert isinstance(a, TrieStore) and stores.of(TrieStore) is a and stores.peek(TrieStore) is a
    assert TrieStore in stores and list(stores) == [TrieStore]
    made = []
    b = stores.get("mine", lambda: made.append(1) or {"x": 1})
    assert stores.get("mine", lambda: made.append(1) or {}) is b and made == [1]
    assert "TrieStore" in repr(stores)


def test_clear_one_or_all():
    stores = Stores()
    trie, draft = stores.of(TrieStore), stores.of(DraftStore)
    stores.clear(TrieStore)
    assert TrieStore not in stores and stores.of(DraftStore) is draft
    assert stores.of(TrieStore) is not trie  # a fresh one on next use
    stores.clear(KnnlmStore)  # never made: nothing to forget
    stores.clear()
    assert len(stores) == 0


def test_plugin_store_defaults():
    assert SuffixStore().cache is not SuffixStore().cache and isinstance(SuffixStore().cache, SuffixCache)
    assert TrieStore().tries == {} and TrieStore().acceptance == {}
    d = DraftStore()
    assert (d.engines, d.models, d.size_warned, d.budgets) == ({}, {}, set(), {})
    k = KnnlmStore()
    assert k.index is None and k.os3 == {}


def test_shared_drafters_share_the_engine_store():
    engine = types.SimpleNamespace(stores=Stores())
    a = TrieDrafter.shared(engine, branch_length=8)
    b = TrieDrafter.shared(engine, branch_length=8)
    store = engine.stores.of(TrieStore)
    assert a.trie is b.trie is store.tries[8] and a.acceptance is b.acceptance
    assert list(store.acceptance.values()) == [a.acceptance]
    assert TrieDrafter.shared(engine, branch_length=8, max_nodes=32).acceptance is not a.acceptance
    stats = AcceptanceStats()
    s1 = SuffixDrafter.shared(engine, acceptance=stats)
    s2 = SuffixDrafter.shared(engine)
    assert s1.cache is s2.cache is engine.stores.of(SuffixStore).cache and s1.acceptance is stats
    engine.stores.clear(SuffixStore)  # bench's cold_stores: the next drafter starts from an empty cache
    assert SuffixDrafter.shared(engine).cache is not s1.cache


def test_lookahead_keeps_its_statistics_in_the_plugin_stores():
    from lookahead_jax.strategies import Lookahead

    engine = types.SimpleNamespace(stores=Stores())
    d = Lookahead().drafter(engine)  # the suffix drafter (the default)
    assert Lookahead().drafter(engine).acceptance is d.acceptance
    assert list(engine.stores.of(SuffixStore).acceptance.values()) == [d.acceptance]
    t = Lookahead(drafts="trie").drafter(engine)
    assert t.trie is engine.stores.of(TrieStore).tries[t.branch_length] and t.acceptance is not d.acceptance
