"""The suffix drafter's host parts (drafters/suffix.py): matching, tree growth, the
cross-request cache (bounded, FIFO eviction, outputs only). Decoding through it is tested
with the other drafters in test_decode_core.py (conformance, lossless)."""

from __future__ import annotations

from types import SimpleNamespace

from lookahead_jax.drafters.suffix import SEP, SuffixCache, SuffixDrafter, TokenStore


def _state(prompts, outputs=None):
    rows = [SimpleNamespace(prompt_ids=list(p), ids=list(o)) for p, o in zip(prompts, outputs or [[] for _ in prompts])]
    return SimpleNamespace(batch=len(rows), rows=rows, active=[True] * len(rows),
                           context=lambda b: rows[b].prompt_ids + rows[b].ids)


def test_longest_match_wins():
    s = TokenStore()
    s.extend([1, 2, 3, 9, 8, 1, 2, 3, 4, 5, 7, 2, 3, 6])
    assert sorted((k, s.buf[p]) for k, p in s.match([1, 2, 3])) == [(2, 6), (3, 4), (3, 9)]
    assert [(k, s.buf[p]) for k, p in s.match([5, 7, 2, 3])] == [(4, 6)]  # the 4-token key: one
    assert sorted((k, s.buf[p]) for k, p in s.match([5, 7, 2, 3], backoff=True)) == [
        (2, 4), (2, 9), (4, 6)]  # and those found by the last token alone, extended back
    assert s.match([42]) == []


def test_matches_do_not_cross_segments():
    s = TokenStore()
    s.extend([1, 2])
    s.segment()
    s.extend([3, 4])
    assert SEP in s.buf
    assert [(k, s.buf[p]) for k, p in s.match([2, 3])] == [(1, 4)]  # "2 3" spans the separator


def test_draft_is_best_first_by_frequency_and_capped_by_match_length():
    prompt = [5, 6, 7, 1, 5, 6, 7, 1, 5, 6, 7, 2, 0]
    d = SuffixDrafter(max_nodes=16, alpha=1.0, offset=0.0, min_prob=0.2, backoff=0.0)
    state = _state([prompt + [5, 6]])
    d.begin(state)
    draft = d.propose(state, 16).drafts[0]
    # "5 6" matched 3 times (2 tokens: at most alpha * 2 = 2 nodes): 7 (p 1), then 1 (p 2/3)
    assert draft.tokens == [7, 1] and draft.parents == [-1, 0]
    d.alpha = 8.0
    draft = d.propose(state, 16).drafts[0]
    assert draft.tokens[:3] == [7, 1, 5] and draft.parents[:3] == [-1, 0, 1]  # p 1, 2/3, 2/3
    assert draft.parents[draft.tokens.index(2)] == 0  # the branch of p 1/3 >= 0.2 comes later
    assert len(d.propose(state, 2).drafts[0]) == 2  # the budget caps it


def test_cache_drafts_from_earlier_outputs_only():
    cache = SuffixCache()
    d = SuffixDrafter(cache=cache, alpha=8.0)
    state = _state([[1, 2, 3]], [[40]])
    d.begin(state)
    d.update(state, SimpleNamespace(kept=[[41, 42, 43, 44]]))
    d.end()
    assert list(cache.outputs) == [[40, 41, 42, 43, 44]]
    state = _state([[7, 8, 40, 41]])  # another request: drafts the earlier output
    d.begin(state)
    assert d.propose(state, 8).drafts[0].tokens[:3] == [42, 43, 44]
    state = _state([[9, 1, 2]])  # but never the earlier prompt
    d.begin(state)
    assert d.propose(state, 8).drafts[0].tokens == []
    d.end()
    private = SuffixDrafter(share_outputs=False)
    state = _state([[1, 2, 3]], [[40, 41, 42]])
    private.begin(state)
    private.end()
    assert not private.cache.outputs


def test_cache_is_bounded_with_fifo_eviction():
    cache = SuffixCache(max_tokens=1000)
    for r in range(10_000):
        cache.add([r % 50_000, 1, 2, 3, r])
        assert cache.tokens <= 1000 and cache.store.n <= 1000
        assert len(cache.store.buf) <= 2 * 1000 + 6  # the evicted prefix is cut as it grows
    # memory flat: the index holds an entry per live n-gram only
    assert sum(len(v) for ix in cache.store.index.values() for v in ix.values()) <= 3 * cache.tokens
    assert cache.outputs[-1][-1] == 9_999  # the newest stay, the oldest left first
    assert cache.outputs[0][-1] == 9_999 - len(cache.outputs) + 1


def test_cost_trim_keeps_the_prefix_worth_its_verify_time():
    prompt = [5, 6, 7, 1, 2, 3, 4, 8, 9, 0]
    state = _state([prompt + [5, 6]])
    free = SuffixDrafter(alpha=8.0, costs={0: 1.0, 1: 1.0, 3: 1.0, 7: 1.0, 15: 1.0})
    free.begin(state)
    assert free.propose(state, 16).drafts[0].tokens == [7, 1, 2, 3, 4, 8, 9, 0, 5, 6]  # uncut at no cost
    dear = SuffixDrafter(alpha=8.0, costs={0: 1.0, 1: 1.1, 3: 10.0, 7: 20.0, 15: 40.0})
    dear.begin(state)
    assert dear.propose(state, 16).drafts[0].tokens == [7]  # worth one node only
    dear.update(state, SimpleNamespace(kept=[[7, 1]]))  # calibration: 1 accepted of 1 predicted
    assert dear.calibration[("suffix", 2)] == [1.0, 1.0]


def test_rollback_forgets_the_tokens_cut_off():
    d = SuffixDrafter(alpha=8.0)
    state = _state([[1, 2, 3]], [[4]])
    d.begin(state)
    d.update(state, SimpleNamespace(kept=[[5, 6, 4, 5]]))
    state.rows[0].ids += [5, 6, 4, 5]
    assert d.propose(state, 8).drafts[0].tokens[:1] == [6]  # "4 5" was followed by 6
    d.rollback([0], 4)
    del state.rows[0].ids[1:]  # the state holds [4] again
    state.rows[0].ids += [5]
    assert d.propose(state, 8).drafts[0].tokens == []  # "4 5" never happened now


def test_a_replaced_prompt_is_drafted_from_after_the_rollback():
    """`decode.replace_prompt` (RaLM's new passage) sets the row's prompt and tells the
    drafter rollback(rows, 0): the row is rebuilt from the state's new prompt (and the
    request's references), so it drafts from the passage in effect, not the old one."""
    d = SuffixDrafter(alpha=8.0, backoff=0.0)
    old, new = [10, 11, 12, 13, 14], [10, 11, 22, 23, 24]
    state = _state([old + [1, 2]], [[3]])
    d.begin(state, references=[[[30, 31, 32]]])
    state.rows[0].ids += [10, 11]
    d.update(state, SimpleNamespace(kept=[[10, 11]]))
    assert d.propose(state, 8).drafts[0].tokens[:3] == [12, 13, 14]  # the old passage
    state.rows[0].prompt_ids = new + [1, 2]  # replace_prompt, keeping the 3 generated ids
    d.rollback([0], 0)
    assert d.propose(state, 8).drafts[0].tokens[:3] == [22, 23, 24]  # the new one only
    state.rows[0].ids += [30]
    d.update(state, SimpleNamespace(kept=[[30]]))
    assert d.propose(state, 8).drafts[0].tokens[:2] == [31, 32]  # the references stay


def test_eviction_is_incremental_and_matches_a_rebuilt_store():
    """Evicting the oldest outputs one by one leaves the same index and matches as a store
    built from the kept outputs alone (positions shifted by the evicted tokens)."""
    import random

    rng = random.Random(0)
    cache = SuffixCache(max_tokens=300)
    for _ in range(200):
        cache.add([rng.randrange(20) for _ in range(rng.randrange(1, 40))])
        fresh = TokenStore()
        for o in cache.outputs:
            fresh.segment()
            fresh.extend(o)
        live = cache.store.buf[cache.store.dead:]
        assert live == fresh.buf and cache.tokens <= 300
        assert len(cache.store.buf) <= 2 * 300 + 40  # the dead prefix is cut as it grows
        shift = cache.store.base + cache.store.dead
        for n in TokenStore.KEYS:
            assert {k: [p - shift for p in v] for k, v in cache.store.index[n].items()} == fresh.index[n]
        tail = [rng.randrange(20) for _ in range(6)]
        got = [(k, cache.store.buf[p:p + 3]) for k, p in cache.store.match(tail, True)]
        assert got == [(k, fresh.buf[p:p + 3]) for k, p in fresh.match(tail, True)]
    big = SuffixCache(max_tokens=10)
    big.add(list(range(50)))  # longer than the cache: not kept
    assert big.tokens == 0 and not big.outputs and big.store.n == 0


def test_cache_save_load_round_trip(tmp_path):
    cache = SuffixCache(max_tokens=1000)
    for r in range(300):
        cache.add([r % 7, 1, 2, 3, r])
    cache.save(tmp_path / "cache.npz")
    back = SuffixCache.load(tmp_path / "cache.npz")
    assert back.max_tokens == 1000 and list(back.outputs) == list(cache.outputs)
    assert back.tokens == cache.tokens
    d1, d2 = SuffixDrafter(cache=cache, alpha=8.0), SuffixDrafter(cache=back, alpha=8.0)
    state = _state([[9, 9, 5, 1, 2]])
    d1.begin(state)
    d2.begin(state)
    assert d1.propose(state, 8).drafts[0].tokens == d2.propose(state, 8).drafts[0].tokens != []
    small = SuffixCache.load(tmp_path / "cache.npz", max_tokens=60)  # the newest outputs only
    assert list(small.outputs) == list(cache.outputs)[-10:]
