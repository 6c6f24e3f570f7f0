"""Host n-gram trie: insert, match, budget, depth, modes, squeeze, end_request, properties."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_jax.drafters.ngram_trie import INPUT_WEIGHT, Draft, NgramTrie, TrieDraft


# ----------------------------------------------------------------- helpers


def paths(d: Draft) -> list[tuple[int, ...]]:
    """Root-to-node token path of every draft node."""
    out: list[tuple[int, ...]] = []
    for i, p in enumerate(d.parents):
        out.append((out[p] if p >= 0 else ()) + (d.tokens[i],))
    return out


def depths(d: Draft) -> list[int]:
    return [len(p) for p in paths(d)]


def window_counts(seqs: list[list[int]], w: int) -> Counter:
    """Reference model: count of a path = number of stored windows it is a prefix of."""
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s) - 1):
            win = s[i : i + w]
            for k in range(1, len(win) + 1):
                c[tuple(win[:k])] += 1
    return c


def occurs(seqs: list[list[int]], pattern: tuple[int, ...]) -> bool:
    n = len(pattern)
    return any(tuple(s[i : i + n]) == pattern for s in seqs for i in range(len(s) - n + 1))


def check_draft_shape(d: Draft, decoding_length: int, branch_length: int) -> None:
    assert len(d.tokens) == len(d.parents) <= decoding_length
    assert all(-1 <= p < i for i, p in enumerate(d.parents)), d.parents  # topological
    assert all(depth <= branch_length for depth in depths(d))
    assert all(type(t) is int for t in d.tokens)
    assert (d.match_len == 0) == (len(d) == 0)


MODES = ["hierarchical", "parallel", "single"]


# ------------------------------------------------------------------ insert


def test_insert_stores_windows_of_branch_length_plus_one():
    trie = NgramTrie(branch_length=2)  # W = 3
    trie.insert_input([5, 6, 7, 8])  # windows [5,6,7], [6,7,8], [7,8]
    assert trie.counts([5]) == (1, 0)
    assert trie.counts([5, 6, 7]) == (1, 0)
    assert trie.counts([5, 6, 7, 8]) is None  # deeper than a window
    assert trie.counts([7, 8]) == (1, 0)
    assert trie.counts([8]) is None  # a one-token tail has no continuation: skipped
    assert trie.num_nodes == 3 + 3 + 2
    assert trie.num_output_nodes == 0 and trie.num_own_counters == 8
    trie.check_invariants()


def test_counts_accumulate_and_kinds_are_separate():
    trie = NgramTrie(branch_length=2)
    trie.insert_input([1, 2, 1, 2], req=0)  # [1,2,1] [2,1,2] [1,2]
    trie.insert_output([1, 2, 3], req=7)  # complete window [1,2,3]
    assert trie.counts([1, 2], req=0) == (2, 1)
    assert trie.counts([1, 2], req=7) == (0, 1)  # req 7 has no input counts
    assert trie.counts([1, 2, 3], req=0) == (0, 1)
    trie.check_invariants()


def test_numpy_tokens_are_accepted():
    trie = NgramTrie(branch_length=2)
    trie.insert_input(np.array([1, 2, 3], np.int32))
    d = trie.retrieve(np.array([0, 1]), 4)
    assert d.tokens == [2, 3] and all(type(t) is int for t in d.tokens)


def test_streaming_output_grows_windows_token_by_token():
    trie = NgramTrie(branch_length=2)  # W = 3
    trie.insert_output([5, 6], req=0)
    assert trie.counts([5, 6]) == (0, 1) and trie.num_nodes == 2  # visible at once
    assert trie.retrieve([5], 4).tokens == [6]
    trie.insert_output([7], req=0)  # [5,6] grows to [5,6,7]; new [6,7]
    assert trie.counts([5, 6, 7]) == (0, 1) and trie.counts([5, 6]) == (0, 1)
    assert trie.counts([6, 7]) == (0, 1) and trie.num_nodes == 5
    trie.insert_output([8, 9], req=0)  # [6,7,8] [7,8,9] [8,9]
    assert trie.counts([6, 7, 8]) == (0, 1) and trie.counts([7, 8, 9]) == (0, 1)
    assert trie.counts([8, 9]) == (0, 1) and trie.counts([9]) is None
    trie.end_request(0)  # nothing left to flush
    assert trie.num_nodes == 3 + 3 + 3 + 2
    trie.check_invariants()


def test_repetition_is_drafted_on_its_second_occurrence():
    trie = NgramTrie(branch_length=8)
    trie.insert_output([1, 2, 3, 4, 5, 1, 2], req=0)
    assert trie.retrieve([5, 1, 2], 8).tokens[:3] == [3, 4, 5]


def test_streaming_tails_are_per_request():
    trie = NgramTrie(branch_length=1)  # W = 2
    trie.insert_output([1], req=0)
    trie.insert_output([5], req=1)
    trie.insert_output([2], req=0)  # window [1,2], not [5,2] or [1,5]
    trie.insert_output([6], req=1)  # window [5,6]
    assert trie.counts([1, 2]) == (0, 1) and trie.counts([5, 6]) == (0, 1)
    assert trie.counts([1, 5]) is None and trie.counts([5, 2]) is None


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 4), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    branch_length=st.integers(1, 5),
)
def test_streaming_matches_reference_model(seq, cuts, branch_length):
    """Any chunking of an output stream == the windows of the whole sequence, once each;
    input insertion follows the same model."""
    w = branch_length + 1
    ref = window_counts([seq], w)
    trie = NgramTrie(branch_length=branch_length)
    bounds = [0, *sorted(c for c in cuts if c <= len(seq)), len(seq)]
    for a, b in zip(bounds, bounds[1:]):
        trie.insert_output(seq[a:b], req=3)
    trie.check_invariants()
    assert all(trie.own_counts(path, req=3) == (0, n) for path, n in ref.items())  # own tier too
    trie.end_request(3)
    trie.insert_input(seq, req=0)
    trie.check_invariants()
    assert trie.num_nodes == len(ref)
    for path, n in ref.items():
        assert trie.counts(path, req=0) == (n, n)


# ------------------------------------------------------------------- match


def test_retrieve_prefers_the_longest_suffix():
    trie = NgramTrie(branch_length=3)
    trie.insert_input([1, 2, 1, 2, 1, 2, 3, 1, 7])  # after [1]: 2 (x3), 7; after [3,1]: 7
    d = trie.retrieve([3, 1], 1)
    assert (d.tokens, d.match_len) == ([7], 2)
    d = trie.retrieve([3, 1], 1, max_match=1)
    assert (d.tokens, d.match_len) == ([2], 1)
    d = trie.retrieve([9, 1], 1)  # [9,1] never occurred: fall back to [1]
    assert (d.tokens, d.match_len) == ([2], 1)


def test_longer_suffix_without_continuation_falls_back():
    trie = NgramTrie(branch_length=3)
    trie.insert_input([4, 5])  # path 4-5 exists, but nothing follows it
    trie.insert_input([5, 6])
    d = trie.retrieve([4, 5], 8)
    assert (d.tokens, d.parents, d.match_len) == ([6], [-1], 1)


def test_no_match_gives_empty_draft():
    trie = NgramTrie(branch_length=3)
    assert trie.retrieve([1, 2], 8) == TrieDraft([], [])
    trie.insert_input([1, 2, 3])
    assert trie.retrieve([3], 8) == TrieDraft([], [])  # 3 has no continuation
    assert trie.retrieve([], 8) == TrieDraft([], [])
    assert trie.retrieve([1], 0) == TrieDraft([], [])
    assert trie.retrieve([1], 8, branch_length=0) == TrieDraft([], [])


def test_matched_tokens_are_not_returned():
    trie = NgramTrie(branch_length=4)
    trie.insert_input([1, 2, 3, 4, 5])
    d = trie.retrieve([1, 2], 8)
    assert d.tokens == [3, 4, 5] and d.match_len == 2


def test_match_length_limits_depth():
    trie = NgramTrie(branch_length=3)  # W = 4
    trie.insert_input([1, 2, 3, 4, 5, 6])
    assert trie.retrieve([1], 8).tokens == [2, 3, 4]  # 1 matched: 3 more
    assert trie.retrieve([1, 2], 8).tokens == [3, 4]  # 2 matched: 2 more
    assert trie.retrieve([1, 2], 8, branch_length=1).tokens == [3]


def test_input_counts_outweigh_output_counts_and_stay_per_request():
    trie = NgramTrie(branch_length=2)
    for _ in range(100):
        trie.insert_output([1, 3], req=9)
        trie.end_request(9)
    trie.insert_input([1, 2], req=0)
    assert trie.counts([1, 3]) == (0, 100)
    d = trie.retrieve([1], 8, req=0)
    assert d.tokens == [2, 3]  # input count 1 > output count 100
    assert trie.retrieve([1], 8, req=1).tokens == [3]  # req 0's input is invisible
    assert INPUT_WEIGHT == 1 << 32


def test_ties_break_by_token_id():
    trie = NgramTrie(branch_length=2)
    for s in ([1, 9], [1, 4], [1, 6]):
        trie.insert_input(s)
    assert trie.retrieve([1], 8).tokens == [4, 6, 9]
    assert trie.retrieve([1], 8, mode="single").tokens == [4]


# ------------------------------------------------------------------- modes


@pytest.fixture
def small_trie() -> NgramTrie:
    # windows of [1,2,3,4,1,2,5] with W=4: [1,2,3,4] [2,3,4,1] [3,4,1,2] [4,1,2,5] [1,2,5] [2,5]
    # after [1]:  2 (count 2) -> 3 (1) -> 4 (1)
    #                         -> 5 (1)
    trie = NgramTrie(branch_length=3)
    trie.insert_input([1, 2, 3, 4, 1, 2, 5])
    return trie


def test_hierarchical_literal(small_trie):
    d = small_trie.retrieve([9, 1], 10, mode="hierarchical")
    # root -> 2 -> 3 -> 4         ties at count 1: token 4 (depth 3) before token 5 (depth 2)
    #           `-> 5
    assert (d.tokens, d.parents, d.match_len) == ([2, 3, 4, 5], [-1, 0, 1, 0], 1)
    d = small_trie.retrieve([9, 1], 3, mode="hierarchical")
    assert (d.tokens, d.parents) == ([2, 3, 4], [-1, 0, 1])
    d = small_trie.retrieve([9, 1], 10, branch_length=2, mode="hierarchical")
    assert (d.tokens, d.parents) == ([2, 3, 5], [-1, 0, 0])


def test_parallel_literal(small_trie):
    d = small_trie.retrieve([9, 1], 10, mode="parallel")
    # chains 2-3-4 and 2-5, prefixes duplicated (block diagonal)
    assert (d.tokens, d.parents) == ([2, 3, 4, 2, 5], [-1, 0, 1, -1, 3])
    # budget 4: the second chain cut to [2] would repeat a prefix: dropped
    d = small_trie.retrieve([9, 1], 4, mode="parallel")
    assert (d.tokens, d.parents) == ([2, 3, 4], [-1, 0, 1])


def test_parallel_cut_keeps_a_new_node():
    trie = NgramTrie(branch_length=3)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 8], [1, 5, 6]):
        trie.insert_input(s)
    # after [1]: 2 (3) -> 3 (3) -> 4 (2)      hierarchical: [2, 3, 4, 5, 6, 8]
    #                            -> 8 (1)      chains (depth first, better child first):
    #            5 (1) -> 6 (1)                [2,3,4] [2,3,8] [5,6] = 8 tokens
    d = trie.retrieve([1], 7, mode="parallel")  # last chain cut to [5]: still new
    assert (d.tokens, d.parents) == ([2, 3, 4, 2, 3, 8, 5], [-1, 0, 1, -1, 3, 4, -1])
    d = trie.retrieve([1], 6, mode="parallel")
    assert (d.tokens, d.parents) == ([2, 3, 4, 2, 3, 8], [-1, 0, 1, -1, 3, 4])


def test_single_literal(small_trie):
    d = small_trie.retrieve([9, 1], 10, mode="single")
    assert (d.tokens, d.parents) == ([2, 3, 4], [-1, 0, 1])
    d = small_trie.retrieve([9, 1], 2, mode="single")
    assert (d.tokens, d.parents) == ([2, 3], [-1, 0])


def test_bad_mode_raises(small_trie):
    with pytest.raises(ValueError, match="mode"):
        small_trie.retrieve([1], 4, mode="beam")


def test_hierarchical_is_best_first():
    trie = NgramTrie(branch_length=3)
    # after [0]: 1 (x3) -> 2 (x3) -> 3 (x2), 4 (x1);  5 (x2) -> 6 (x2)
    for s in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 4], [0, 5, 6], [0, 5, 6]):
        trie.insert_input(s)
    d = trie.retrieve([0], 4)
    # scores: 1:3  2:3  5:2  6:2  3:2  4:1 -> best 4, ties by token: 1, 2, 3, 5
    assert (d.tokens, d.parents) == ([1, 2, 3, 5], [-1, 0, 1, -1])
    d = trie.retrieve([0], 5)
    assert (d.tokens, d.parents) == ([1, 2, 3, 5, 6], [-1, 0, 1, -1, 3])


# ------------------------------------------------------- squeeze & budgets


def _squeeze_example() -> NgramTrie:
    trie = NgramTrie(branch_length=2)  # W = 3
    trie.insert_output([1, 2, 3, 1, 2, 3, 1, 2, 4], req=0)
    trie.end_request(0)
    # windows [1,2,3] [2,3,1] [3,1,2] [1,2,3] [2,3,1] [3,1,2] [1,2,4] + tail [2,4]
    return trie


def test_squeeze_halves_output_counts_and_drops_counts_of_one():
    trie = _squeeze_example()
    before = {
        (1,): 3, (1, 2): 3, (1, 2, 3): 2, (1, 2, 4): 1,
        (2,): 3, (2, 3): 2, (2, 3, 1): 2, (2, 4): 1,
        (3,): 2, (3, 1): 2, (3, 1, 2): 2,
    }  # fmt: skip
    assert {p: trie.counts(p)[1] for p in before} == before
    assert trie.num_nodes == trie.num_output_nodes == 11
    trie.squeeze()  # out <= 1 -> dropped; else out // 2
    after = {p: n // 2 for p, n in before.items() if n >= 2}
    assert {p: trie.counts(p)[1] for p in after} == after
    assert trie.counts((1, 2, 4)) is None and trie.counts((2, 4)) is None
    assert trie.num_nodes == trie.num_output_nodes == 9
    trie.check_invariants()
    trie.squeeze()  # every count is now 1
    assert trie.num_nodes == 0 and trie.num_output_nodes == 0
    trie.check_invariants()


def test_squeeze_keeps_nodes_with_live_input_counts():
    trie = _squeeze_example()
    trie.insert_input([2, 4], req=5)
    trie.squeeze()
    assert trie.counts((2, 4), req=5) == (1, 0)  # output zeroed, kept for its input
    trie.squeeze()
    assert trie.num_nodes == 2 and trie.num_output_nodes == 0
    assert trie.retrieve([2], 4, req=5).tokens == [4]
    trie.end_request(5)
    assert trie.num_nodes == 0
    trie.check_invariants()


def test_output_budget_triggers_squeeze():
    trie = NgramTrie(branch_length=3, max_nodes=10_000, max_output_nodes=40)
    rng = np.random.default_rng(0)
    for r in range(30):
        trie.insert_output(rng.integers(0, 50, 40), req=r)
        assert trie.num_output_nodes <= 40
        trie.end_request(r)
        trie.check_invariants()
    assert 0 < trie.num_output_nodes <= 40


def test_frequent_output_survives_squeeze():
    trie = NgramTrie(branch_length=2, max_nodes=10_000, max_output_nodes=200)
    rng = np.random.default_rng(1)
    for r in range(40):  # ~60 noise nodes per request: a squeeze every ~3 requests
        trie.insert_output([7, 8, 9], req=r)  # repeated every request
        trie.insert_output(rng.integers(10, 100, 20), req=r)  # noise
        trie.end_request(r)
    assert trie.retrieve([7], 4).tokens[:2] == [8, 9]
    trie.check_invariants()


def test_max_nodes_cuts_input_when_full_and_end_request_frees():
    trie = NgramTrie(branch_length=3, max_nodes=50, max_output_nodes=50)
    trie.insert_input(list(range(100)), req=0)  # 100 fresh windows: far over budget
    assert trie.num_nodes == 50 and trie.num_own_counters == 50
    trie.check_invariants()
    trie.insert_output(list(range(200, 260)), req=1)  # nothing can be freed: cut too
    assert trie.num_nodes == 50
    trie.check_invariants()
    trie.end_request(0)
    trie.end_request(1)
    assert trie.num_nodes <= 50 and trie.num_own_counters == 0
    trie.insert_input([1, 2, 3], req=2)  # room again
    assert trie.retrieve([1], 4, req=2).tokens == [2, 3]
    trie.check_invariants()


def test_input_pressure_squeezes_output():
    trie = NgramTrie(branch_length=2, max_nodes=100, max_output_nodes=1000)
    trie.insert_output(list(range(100, 130)), req=1)
    trie.end_request(1)
    assert trie.num_nodes == trie.num_output_nodes == 29 + 29 + 28
    trie.insert_input(list(range(1, 11)), req=0)  # needs 8 * 3 + 2 = 26 nodes: squeeze
    assert trie.retrieve([1], 8).tokens == [2, 3]
    assert trie.num_nodes == 26 and trie.num_output_nodes == 0  # all output counts were 1
    trie.check_invariants()


def test_end_request_removes_only_its_input():
    trie = NgramTrie(branch_length=2)
    trie.insert_input([1, 2, 3], req=1)
    trie.insert_input([1, 2, 4], req=2)
    trie.insert_output([1, 5, 6], req=3)
    n = trie.num_nodes
    trie.end_request(1)
    assert trie.counts([1, 2, 3], req=1) is None  # only req 1 had it
    assert trie.counts([2, 3]) is None
    assert trie.counts([1, 2], req=2) == (1, 0)  # shared with req 2: kept
    assert trie.counts([1, 5, 6]) == (0, 1)  # output stays
    assert trie.num_nodes == n - 2  # 1-2-3 and 2-3
    assert trie.retrieve([1], 8, req=1).tokens == [5, 6]
    trie.end_request(2)
    assert trie.counts([1, 2]) is None
    assert trie.num_own_counters == 5  # req 3's own output: 1, 1-5, 1-5-6, 5, 5-6
    trie.end_request(3)
    assert trie.num_own_counters == 0 and trie.counts([1, 5, 6]) == (0, 1)  # shared stays
    trie.end_request(42)  # unknown request: no-op
    trie.check_invariants()


def test_constructor_validates():
    with pytest.raises(ValueError):
        NgramTrie(branch_length=0)
    with pytest.raises(ValueError):
        NgramTrie(max_nodes=0)
    with pytest.raises(ValueError, match="input_weight"):
        NgramTrie(input_weight=0)


# ----------------------------------------------------------------- properties

tokens_st = st.lists(st.integers(0, 5), max_size=25)


@settings(max_examples=150, deadline=None)
@given(
    inputs=st.lists(tokens_st, max_size=4),
    other=st.lists(tokens_st, max_size=2),
    outputs=st.lists(tokens_st, max_size=3),
    context=st.lists(st.integers(0, 5), max_size=6),
    branch_length=st.integers(1, 5),
    decoding_length=st.integers(1, 20),
    max_match=st.integers(1, 5),
)
def test_drafts_are_observed_continuations(
    inputs, other, outputs, context, branch_length, decoding_length, max_match
):
    """(a) every root-to-node path followed the matched suffix in data visible to the
    request; the suffix is the longest with a continuation; (d) topological parents;
    budget and depth respected; exhaustive and best-first hierarchical drafts."""
    w = branch_length + 1
    trie = NgramTrie(branch_length=branch_length)
    for s in inputs:
        trie.insert_input(s, req=0)
    for s in other:
        trie.insert_input(s, req=1)  # another request: must stay invisible to req 0
    for r, s in enumerate(outputs):
        trie.insert_output(s, req=10 + r)
        trie.end_request(10 + r)
    trie.check_invariants()
    visible = inputs + outputs
    kmax = min(max_match, len(context), w - 1)

    for mode in MODES:
        d = trie.retrieve(context, decoding_length, mode=mode, req=0, max_match=max_match)
        check_draft_shape(d, decoding_length, branch_length)
        k = d.match_len
        suffix = tuple(context[len(context) - k :]) if k else ()
        for p in paths(d):
            assert len(suffix) + len(p) <= w
            assert occurs(visible, suffix + p), (suffix, p)
        # own evidence first: the suffix is the longest with a continuation in the request's
        # own data (its inputs here), or, if none has one, in all visible data
        own_k = max((n for n in range(1, kmax + 1) if any(
            occurs(inputs, tuple(context[-n:]) + (x,)) for x in range(6))), default=0)
        assert k == own_k or own_k == 0
        for longer in range(k + 1, kmax + 1):
            suf = tuple(context[-longer:])
            assert not any(occurs(inputs if own_k else visible, suf + (x,)) for x in range(6))

    # exhaustive: with an unbounded budget the hierarchical draft is every continuation
    d = trie.retrieve(context, 10**6, req=0, max_match=max_match)
    if d.match_len:
        k = d.match_len
        suf = tuple(context[-k:])
        expect = {
            p[k:] for p in window_counts(visible, w) if len(p) > k and p[:k] == suf
        }
        assert set(paths(d)) == expect and len(paths(d)) == len(expect)

    # best-first: no left-out child of a taken node (or of the root) beats a taken node
    d = trie.retrieve(context, decoding_length, req=0, max_match=max_match)
    if d.match_len:
        suf = tuple(context[-d.match_len :])

        def score(p):  # own tier (input, then own output) above the shared output
            (inp, own_out), (_, out) = trie.own_counts(suf + p, req=0), trie.counts(suf + p, req=0)
            own = INPUT_WEIGHT * inp + own_out
            return (1, own) if own else (0, out)

        taken = set(paths(d))
        worst = min(score(p) for p in taken)
        for p in [()] + list(taken):
            for x in range(6):
                c = p + (x,)
                if c not in taken and trie.counts(suf + c, req=0) is not None:
                    assert len(suf + c) > w or score(c) <= worst or score(c) == (0, 0)


op_st = st.one_of(
    st.tuples(st.just("in"), st.integers(0, 3), st.lists(st.integers(0, 30), max_size=40)),
    st.tuples(st.just("out"), st.integers(0, 3), st.lists(st.integers(0, 30), max_size=40)),
    st.tuples(st.just("end"), st.integers(0, 3), st.just([])),
)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(op_st, max_size=40),
    max_nodes=st.integers(1, 80),
    max_output_nodes=st.integers(0, 60),
    branch_length=st.integers(1, 4),
)
def test_memory_is_bounded(ops, max_nodes, max_output_nodes, branch_length):
    """(b) under any sequence of inserts and request ends: nodes <= max_nodes, input
    counters <= max_nodes, output nodes <= max_output_nodes, invariants hold."""
    trie = NgramTrie(branch_length, max_nodes=max_nodes, max_output_nodes=max_output_nodes)
    for kind, req, toks in ops:
        if kind == "in":
            trie.insert_input(toks, req=req)
        elif kind == "out":
            trie.insert_output(toks, req=req)
        else:
            trie.end_request(req)
        assert trie.num_nodes <= max_nodes
        assert trie.num_own_counters <= max_nodes
        assert trie.num_output_nodes <= max_output_nodes
        trie.check_invariants()
        d = trie.retrieve(toks[-3:], 8, req=req, max_match=3)
        check_draft_shape(d, 8, branch_length)
    for req in range(4):
        trie.end_request(req)
    assert trie.num_own_counters == 0
    trie.check_invariants()


def test_memory_is_bounded_over_many_requests():
    rng = np.random.default_rng(0)
    trie = NgramTrie(branch_length=6, max_nodes=2_000, max_output_nodes=1_000)
    for req in range(300):
        trie.insert_input(rng.integers(0, 500, 60), req=req)
        for _ in range(5):
            trie.insert_output(rng.integers(0, 500, 4), req=req)
        trie.retrieve(rng.integers(0, 500, 4), 16, req=req)
        if req >= 4:
            trie.end_request(req - 4)  # up to 5 requests live at once
        assert trie.num_nodes <= 2_000 and trie.num_output_nodes <= 1_000
    trie.check_invariants()
    assert len(trie._trails) <= 5 and len(trie._tails) <= 5


@settings(max_examples=50, deadline=None)
@given(
    seqs=st.lists(tokens_st, max_size=5),
    outputs=st.lists(tokens_st, max_size=3),
    context=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    perm_seed=st.randoms(use_true_random=False),
    decoding_length=st.integers(1, 16),
)
def test_determinism(seqs, outputs, context, perm_seed, decoding_length):
    """(c) same inserts -> same draft; the order of whole sequences does not matter."""

    def build(order):
        trie = NgramTrie(branch_length=3)
        for i in order:
            trie.insert_input(seqs[i], req=0)
        for r, s in enumerate(outputs):
            trie.insert_output(s, req=5 + r)
            trie.end_request(5 + r)
        return trie

    order = list(range(len(seqs)))
    shuffled = order[:]
    perm_seed.shuffle(shuffled)
    a, b, c = build(order), build(order), build(shuffled)
    for mode in MODES:
        da = a.retrieve(context, decoding_length, mode=mode)
        assert da == b.retrieve(context, decoding_length, mode=mode)
        assert da == c.retrieve(context, decoding_length, mode=mode)


def test_draft_dominance_classes():
    """Draft.key = (match length, dominance): 2 for a single continuation, 1 when the top
    continuation holds at least half of the counts, 0 otherwise."""
    t = NgramTrie(branch_length=3)
    t.insert_input([1, 2, 3, 1, 2, 3], req=0)
    assert t.retrieve([1, 2], 4, req=0).key == (2, 2)  # "1 2" is always followed by 3
    t.insert_input([7, 1, 7, 2, 7, 3], req=0)
    assert t.retrieve([5, 7], 4, req=0).key == (1, 0)  # 7 -> 1, 2, 3 once each
    t.insert_input([7, 1], req=0)
    assert t.retrieve([5, 7], 4, req=0).key == (1, 1)  # 7 -> 1 twice of 4
    assert t.retrieve([5, 6], 4, req=0).key == (0, 0)  # no match: the empty draft


# ------------------------------------------- own trie first, reset, bounds


def test_own_output_ranks_before_other_requests_output():
    """Another request's frequent output neither outranks nor crowds out what the request's
    own output would draft (before: a shared count of 50 beat an own count of 1)."""
    trie = NgramTrie(branch_length=2)
    for r in range(50):
        trie.insert_output([1, 3, 4], req=100 + r)
        trie.end_request(100 + r)
    trie.insert_input([7, 8], req=0)
    trie.insert_output([1, 2, 5], req=0)  # its own output: 1 -> 2 -> 5
    assert trie.own_counts([1, 2], req=0) == (0, 1) and trie.counts([1, 2], req=0) == (0, 1)
    assert trie.counts([1, 3], req=0) == (0, 50) and trie.own_counts([1, 3], req=0) == (0, 0)
    d = trie.retrieve([9, 1], 2, req=0)
    assert (d.tokens, d.parents) == ([2, 5], [-1, 0])  # budget 2: all own, shared crowded out
    d = trie.retrieve([9, 1], 4, req=0)
    assert (d.tokens, d.parents) == ([2, 5, 3, 4], [-1, 0, -1, 2])  # shared fills the rest
    assert trie.retrieve([9, 1], 4, req=1).tokens == [3, 4, 2, 5]  # for others: by count
    assert trie.retrieve([9, 1], 8, req=0, mode="single").tokens == [2, 5]
    trie.end_request(0)
    assert trie.retrieve([9, 1], 4, req=0).tokens == [3, 4, 2, 5]  # own tier gone


def test_input_weight_weighs_input_against_own_output():
    for w, expect in ((INPUT_WEIGHT, [2, 3]), (1, [3, 2])):
        trie = NgramTrie(branch_length=1, input_weight=w)
        trie.insert_input([1, 2], req=0)  # own score of 2: w * 1
        trie.insert_output([1, 3, 1, 3], req=0)  # own score of 3: 2
        assert trie.retrieve([1], 4, req=0).tokens == expect


def test_own_match_is_not_displaced_by_a_longer_shared_match():
    trie = NgramTrie(branch_length=3)
    trie.insert_output([5, 1, 7, 7], req=9)  # shared only: after [5, 1] comes 7
    trie.end_request(9)
    trie.insert_input([1, 2, 3], req=0)  # own: after [1] comes 2
    d = trie.retrieve([5, 1], 8, req=0)
    assert (d.tokens, d.parents, d.match_len) == ([2, 3, 7, 7], [-1, 0, -1, 2], 1)
    d = trie.retrieve([5, 1], 8, req=1)  # no own evidence: the longest match
    assert (d.tokens, d.match_len) == ([7, 7], 2)


def test_parallel_emits_the_own_chains_first():
    trie = NgramTrie(branch_length=3)
    for r in range(3):
        trie.insert_output([1, 2, 9, 9], req=8 + r)
        trie.end_request(8 + r)
    trie.insert_output([1, 6, 6], req=7)
    trie.end_request(7)  # shared: 1 -> 2 -> 9 -> 9 (x3), 1 -> 6 -> 6 (x1)
    trie.insert_input([1, 2, 3], req=0)  # own: 1 -> 2 -> 3
    d = trie.retrieve([1], 20, req=0, mode="hierarchical")
    assert (d.tokens, d.parents) == ([2, 3, 9, 9, 6, 6], [-1, 0, 0, 2, -1, 4])
    d = trie.retrieve([1], 20, req=0, mode="parallel")  # own chain 2-3, then 2-9-9, 6-6
    assert (d.tokens, d.parents) == ([2, 3, 2, 9, 9, 6, 6], [-1, 0, -1, 2, 3, -1, 5])
    d = trie.retrieve([1], 3, req=0, mode="parallel")  # 2-9 cut to 2 adds nothing: dropped
    assert (d.tokens, d.parents) == ([2, 3], [-1, 0])
    d = trie.retrieve([1], 4, req=0, mode="parallel")  # cut to 2-9: a new node, kept
    assert (d.tokens, d.parents) == ([2, 3, 2, 9], [-1, 0, -1, 2])


slot_op_st = st.one_of(
    st.tuples(st.just("begin"), st.integers(0, 2), st.lists(st.integers(0, 4), max_size=16)),
    st.tuples(st.just("ref"), st.integers(0, 2), st.lists(st.integers(0, 4), max_size=10)),
    st.tuples(st.just("out"), st.integers(0, 2), st.lists(st.integers(0, 4), min_size=1, max_size=4)),
    st.tuples(st.just("restart"), st.integers(0, 2), st.just([])),
)


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(slot_op_st, max_size=30),
    probes=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=2),
    branch_length=st.integers(1, 4),
    max_output_nodes=st.integers(0, 40),
    max_match=st.integers(1, 3),
    input_weight=st.sampled_from([1, INPUT_WEIGHT]),
)
def test_shared_draft_begins_with_the_own_trie_draft(
    ops, probes, branch_length, max_output_nodes, max_match, input_weight
):
    """For random streams of requests over three slots (vocab of 5, so n-grams collide), at
    every step, for every live request, probe context, budget and mode: let P be the draft
    of a private NgramTrie fed only that request's inputs and outputs and S the shared
    trie's. If P is not empty, S has P's match length and S.tokens[:len(P)] == P.tokens,
    S.parents[:len(P)] == P.parents; in hierarchical and single mode the nodes after them
    have no own counts (the own tier is exhausted first). The shared trie squeezes its
    output (small max_output_nodes) and never has to cut a window (max_nodes is large)."""
    shared = NgramTrie(branch_length, max_output_nodes=max_output_nodes, input_weight=input_weight)
    private: dict[int, NgramTrie] = {}
    live: dict[int, int] = {}  # slot -> request id
    ctx: dict[int, list[int]] = {}
    ids = iter(range(10**6))
    for kind, slot, toks in ops:
        if kind == "begin" or slot not in live:  # a new request in the slot ends the old one
            if slot in live:
                shared.end_request(live[slot])
            req = live[slot] = next(ids)
            private[req] = NgramTrie(branch_length, input_weight=input_weight)
            ctx[slot] = list(toks) if kind == "begin" else []
            for t in (shared, private[req]):
                t.insert_input(ctx[slot], req)
            if kind == "begin":
                continue
        req = live[slot]
        for t in (shared, private[req]):
            if kind == "ref":
                t.insert_input(toks, req)
            elif kind == "out":
                t.insert_output(toks, req)
            else:
                t.restart_output(req)
        if kind == "out":
            ctx[slot] += toks
        shared.check_invariants()
        for s, req in live.items():
            for context in [ctx[s][-4:], *probes]:
                for mode in MODES:
                    for budget in (1, 2, 5, 40):
                        p = private[req].retrieve(context, budget, mode=mode, req=req, max_match=max_match)
                        d = shared.retrieve(context, budget, mode=mode, req=req, max_match=max_match)
                        check_draft_shape(d, budget, branch_length)
                        if not len(p):
                            continue
                        m = len(p)
                        assert d.match_len == p.match_len, (mode, budget, context)
                        assert (d.tokens[:m], d.parents[:m]) == (p.tokens, p.parents), (mode, budget)
                        if mode != "parallel":
                            suf = tuple(context[len(context) - d.match_len:])
                            for path in paths(d)[m:]:
                                assert shared.own_counts(suf + path, req) == (0, 0)


def _own_requests(trie: NgramTrie) -> set:
    """Every request id that holds an own counter somewhere in the trie."""
    found, stack = set(), list(trie._root.values())
    while stack:
        node = stack.pop()
        found.update(node.own or ())
        stack.extend(node.children.values())
    return found


def test_bounds_hold_and_ended_requests_leave_over_thousands_of_requests():
    """2,400 requests (up to 4 live) through a small trie: after every call nodes and own
    counters stay <= max_nodes and output nodes <= max_output_nodes; the own tiers hold
    exactly the live requests (nothing of an ended one), and once all end, no own counter."""
    rng = np.random.default_rng(0)
    max_nodes, max_output_nodes = 300, 120
    trie = NgramTrie(branch_length=4, max_nodes=max_nodes, max_output_nodes=max_output_nodes)

    def bounded():
        assert trie.num_nodes <= max_nodes and trie.num_own_counters <= max_nodes
        assert trie.num_output_nodes <= max_output_nodes

    live: list[int] = []
    full_seen = squeezed = 0
    for req in range(2400):
        trie.insert_input(rng.integers(0, 12, rng.integers(5, 40)), req)
        bounded()
        live.append(req)
        for _ in range(rng.integers(1, 8)):
            n_out = trie.num_output_nodes
            trie.insert_output(rng.integers(0, 12, rng.integers(1, 5)), req)
            bounded()
            squeezed += trie.num_output_nodes < n_out
            trie.retrieve(rng.integers(0, 12, 3), 8, req=req)
        full_seen += trie.num_own_counters == max_nodes
        if len(live) > 3:
            trie.end_request(live.pop(0))
            bounded()
        if req % 100 == 0:
            trie.check_invariants()
            assert _own_requests(trie) <= set(live)
    trie.check_invariants()
    assert _own_requests(trie) == set(live)
    for req in live:
        trie.end_request(req)
    assert trie.num_own_counters == 0 and _own_requests(trie) == set() and not trie._trails
    trie.check_invariants()
    assert full_seen and squeezed  # the bounds were reached (else the test shows nothing)


class _Row:
    def __init__(self, prompt_ids, ids=()):
        self.prompt_ids, self.ids = list(prompt_ids), list(ids)


class _State:
    """What TrieDrafter reads of a DecodeState: batch, rows, active, context(b)."""

    def __init__(self, *prompts):
        self.rows = [_Row(p) for p in prompts]
        self.batch = len(self.rows)
        self.active = [True] * self.batch

    def context(self, b):
        return self.rows[b].prompt_ids + self.rows[b].ids


def test_reused_slot_drafts_nothing_of_the_previous_request():
    """Slot reuse through TrieDrafter (end(rows) / begin(rows), as core.slots does): the new
    request sees neither the old one's prompt and references (input counts gone) nor any
    own output of it (its own tier starts empty); the old output stays in the shared tier."""
    from types import SimpleNamespace

    from lookahead_jax.drafters.trie import TrieDrafter

    drafter = TrieDrafter(branch_length=4, max_nodes=8)
    trie = drafter.trie
    state = _State([10, 11, 12, 13, 14], [20, 21, 22, 23])
    drafter.begin(state, [[[15, 16, 17]], []])  # row 0: prompt + a reference
    for kept in ([30, 31, 32], [33, 30, 31]):
        state.rows[0].ids += kept
        drafter.update(state, SimpleNamespace(kept=[kept, []]))
    # before the reuse, row 0 drafts from its prompt, its reference and its own output
    for context, expect in (([9, 11], [12, 13, 14]), ([9, 15], [16, 17]), ([9, 30], [31, 32, 33])):
        assert drafter.propose(_State(context, []), 8).drafts[0].tokens[:len(expect)] == expect
    row1 = drafter.propose(_State([], [7, 21]), 8).drafts[1]
    assert row1.tokens == [22, 23]

    drafter.end([0])  # the slot is freed ...
    state.rows[0] = _Row([40, 41, 42])
    drafter.begin(state, [[], []], rows=[0])  # ... and a new request takes it
    fresh = NgramTrie(branch_length=4)
    fresh.insert_input([20, 21, 22, 23], "row 1")
    fresh.insert_input([40, 41, 42], "row 0")
    assert trie.num_own_counters == fresh.num_own_counters  # only the two live prompts
    for context in ([9, 11], [12, 13], [9, 15], [16, 17]):  # the old prompt / reference
        assert drafter.propose(_State(context, []), 8).drafts[0].tokens == []
    for context in ([33, 30], [30, 31], [9, 32]):  # the old output: shared tier only
        d = drafter.propose(_State(context, []), 8).drafts[0]
        assert d.tokens and d == trie.retrieve(context, 8, 4, req="never seen")
    assert drafter.propose(_State([], [7, 21]), 8).drafts[1] == row1  # row 1 untouched
    assert drafter.propose(_State([40, 41], []), 8).drafts[0].tokens == [42]
    state.rows[1] = _Row([50, 51])
    drafter.begin(state, [[], []], rows=[1])  # begin alone also ends the slot's request
    assert drafter.propose(_State([], [7, 21]), 8).drafts[1].tokens == []
    assert drafter.propose(_State([], [7, 50]), 8).drafts[1].tokens == [51]
    drafter.end()
    assert trie.num_own_counters == 0 and not trie._trails
    trie.check_invariants()
