"""The auto draft budget (`budget.py`): acceptance counting, per-class statistics, and the
choice of T that maximises expected tokens per second."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_jax.core.budget import (AcceptanceStats, AutoBudget, StepTimes, accepted_length, accepted_lengths,
                                  outcome_known, predicted_lengths)
from lookahead_jax.core.drafts import Draft
from lookahead_jax.drafters.trie import TrieDrafter
from lookahead_jax.core.tree import BUCKETS


def naive_accepted(tokens, parents, actual, budget):
    """Deepest node among the first `budget` whose whole root path equals actual's prefix."""
    best = 0
    for i in range(min(budget, len(tokens))):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        if path == list(actual[:len(path)]):
            best = max(best, len(path))
    return best


def test_accepted_lengths_worked_example():
    # root -> 5 -> 7, root -> 6; actual 5 7 9: node0 ok (depth 1), node1 ok (depth 2)
    assert accepted_lengths([5, 7, 6], [-1, 0, -1], [5, 7, 9], (0, 1, 2, 3)) == (0, 1, 2, 2)
    # the right branch comes later in best-first order: only budgets >= 3 reach it
    assert accepted_lengths([6, 5, 7], [-1, -1, 1], [5, 7], (1, 2, 3, 7)) == (0, 1, 2, 2)
    assert accepted_length([6, 5, 7], [-1, -1, 1], [5, 7], 2) == 1
    assert accepted_lengths([], [], [1, 2], BUCKETS) == (0,) * len(BUCKETS)


@st.composite
def trees(draw):
    n = draw(st.integers(0, 20))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, 3)) for _ in range(n)]
    actual = draw(st.lists(st.integers(0, 3), max_size=8))
    return tokens, parents, actual


@settings(max_examples=300, deadline=None)
@given(trees())
def test_accepted_lengths_equals_naive(t):
    tokens, parents, actual = t
    got = accepted_lengths(tokens, parents, actual, BUCKETS)
    assert got == tuple(naive_accepted(tokens, parents, actual, b) for b in BUCKETS)
    assert list(got) == sorted(got) and got[-1] <= len(actual)


@settings(max_examples=300, deadline=None)
@given(trees(), st.lists(st.integers(0, 3), max_size=8))
def test_outcome_known_means_final(t, more):
    """Once outcome_known says so, no continuation of `actual` changes the count."""
    tokens, parents, actual = t
    depth = 8
    if outcome_known(tokens, parents, actual, depth):
        assert accepted_lengths(tokens, parents, actual + more, BUCKETS) == \
            accepted_lengths(tokens, parents, actual, BUCKETS)


@settings(max_examples=300, deadline=None)
@given(trees(), st.integers(0, 8))
def test_outcome_known_is_the_full_replay(t, depth):
    """The early-exit replay (with the draft's cached depths or without) decides as the
    definition: actual reaches the depth, or the full tree's accepted length falls short."""
    tokens, parents, actual = t
    want = len(actual) >= depth or accepted_length(tokens, parents, actual, len(tokens)) < len(actual)
    assert outcome_known(tokens, parents, actual, depth) == want
    assert outcome_known(tokens, parents, actual, depth, Draft(tokens, parents).depths) == want
    assert accepted_lengths(tokens, parents, actual, BUCKETS, Draft(tokens, parents).depths) == \
        accepted_lengths(tokens, parents, actual, BUCKETS)


def test_outcome_known_examples():
    chain = ([5, 7, 9], [-1, 0, 1])
    assert not outcome_known(*chain, [5, 7], 3)  # still matching, depth 3 not reached
    assert outcome_known(*chain, [5, 7, 1], 3)
    assert outcome_known(*chain, [5, 8], 3)  # mismatch at depth 2: final
    assert outcome_known(*chain, [1], 3)


def test_acceptance_stats_per_class_and_window():
    s = AcceptanceStats(window=2)
    assert s.expected("a") is None and s.count("a") == 0
    s.observe([5, 7], [-1, 0], [5, 7], key="a")  # 2 accepted for budgets >= 2
    s.observe([5, 7], [-1, 0], [5, 1], key="a")  # 1
    s.observe([9], [-1], [5], key="b")  # 0
    a = s.expected("a")
    assert a[0] == 0 and a[1] == 1 and a[3] == 1.5 and a[127] == 1.5
    assert s.expected("b") == {b: 0.0 for b in BUCKETS}
    s.observe([9], [-1], [5], key="a")  # window 2: the first sample drops out
    assert s.count("a") == 2 and s.expected("a")[3] == 0.5
    with pytest.raises(ValueError, match="window"):
        AcceptanceStats(window=0)


COST = {0: 1.0, 1: 1.3, 3: 1.5, 7: 1.75, 15: 2.2}


def test_unseen_class_stays_plain():
    """No evidence: a tree is predicted to accept nothing, so the step is plain decoding."""
    b = AutoBudget(tuple(COST), COST)
    assert b.choose(["new"]) == 0 and b.choose([]) == 0 and b.choose([], rows=3) == 0
    assert b.expected_accepted("new") == {t: 0.0 for t in COST}


def test_choose_maximises_expected_rate():
    stats = AcceptanceStats()
    # class "good": trees of 1 / 3 / 7 / 15 nodes accept 1 / 3 / 4 / 4 drafts
    tree = [1, 2, 3, 9, 9, 9, 4, 9, 9, 9, 9, 9, 9, 9, 9]
    parents = [-1, 0, 1, -1, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1, -1]
    for _ in range(4):
        stats.observe(tree, parents, [1, 2, 3, 4], key="good")
    a = stats.expected("good")
    assert (a[1], a[3], a[7], a[15]) == (1, 3, 4, 4)
    b = AutoBudget(tuple(COST), COST, stats)
    # rates: T=0 1/1, T=1 2/1.3, T=3 4/1.5 = 2.67, T=7 5/1.75 = 2.86, T=15 5/2.2
    assert b.choose(["good"]) == 7
    # a batch of 4 rows, one of them with a "good" draft: (4 + a) / cost
    # T=0 4/1, T=1 5/1.3 = 3.85, T=3 7/1.5 = 4.67, T=7 8/1.75 = 4.57 -> 3
    assert b.choose(["good"], rows=4) == 3
    assert b.choose(["good", "unseen"]) == 7  # (2 + 4) / 1.75 = 3.43 beats (2 + 3) / 1.5
    with pytest.raises(ValueError, match="2 drafts for 1 rows"):
        b.choose(["good", "good"], rows=1)


def test_ties_go_to_the_smaller_tree():
    stats = AcceptanceStats()
    stats.observe([1], [-1], [1], key="k")  # a(T) = 1 for every T >= 1
    b = AutoBudget((0, 1, 3), {0: 1.0, 1: 1.5, 3: 1.5}, stats)
    assert b.choose(["k"]) == 1  # T=1 and T=3 both give 2 / 1.5: the smaller wins
    b = AutoBudget((0, 1, 3), {0: 1.0, 1: 2.0, 3: 2.0}, stats)
    assert b.choose(["k"]) == 0  # all give 1 token per unit of time


def test_a_tree_must_beat_plain_by_the_margin():
    stats = AcceptanceStats()
    for actual in ([1], [1], [1], [2]):  # a(1) = 0.75
        stats.observe([1], [-1], actual, key="k")
    cost = {0: 1.0, 1: 1.6}  # T=1: 1.75 / 1.6 = 1.094 tokens per unit, plain 1.0
    assert AutoBudget((0, 1), cost, stats).choose(["k"]) == 0  # < 10% better: stay plain
    assert AutoBudget((0, 1), cost, stats, margin=0.05).choose(["k"]) == 1
    assert AutoBudget((1, 3), {1: 1.6, 3: 1.7}, stats).choose(["k"]) == 1  # no plain bucket
    with pytest.raises(ValueError, match="margin"):
        AutoBudget((0,), {0: 1.0}, margin=-1)


def test_own_drafts_outweigh_shared_statistics_as_they_accumulate():
    """A class that earlier requests found good but that keeps failing in this request
    stops being drafted: this request's mean gets weight n / (n + prior)."""
    shared = AcceptanceStats()
    for _ in range(20):
        shared.observe([1, 2, 3], [-1, 0, 1], [1, 2, 3], key="k")  # a(3) = 3 elsewhere
    cost = {0: 1.0, 3: 1.5}
    b = AutoBudget((0, 3), cost, shared, prior=8)
    assert b.choose(["k"]) == 3  # (1 + 3) / 1.5 = 2.67 > 1
    for n in range(1, 25):
        b.observe([1, 2, 3], [-1, 0, 1], [7, 7, 7], key="k")  # fails here every time
        # shared now holds 20 hits and n misses (window 256); own mean 0
        shared_mean = 3 * 20 / (20 + n)
        want = (8 / (n + 8)) * shared_mean
        assert b.expected_accepted("k")[3] == pytest.approx(want)
    assert b.choose(["k"]) == 0
    # another request (a fresh AutoBudget over the same shared statistics) starts from them
    assert AutoBudget((0, 3), cost, shared).expected_accepted("k")[3] == pytest.approx(60 / 44)
    with pytest.raises(ValueError, match="prior"):
        AutoBudget((0,), {0: 1.0}, prior=-1)


def test_autobudget_argument_errors():
    with pytest.raises(ValueError, match="at least one bucket"):
        AutoBudget((), {})
    with pytest.raises(ValueError, match=r"no measured cost for buckets \[3\]"):
        AutoBudget((0, 3), {0: 1.0})
    with pytest.raises(ValueError, match="not tree buckets"):
        AutoBudget((0, 5), {0: 1.0, 5: 1.0})


def test_shared_drafters_share_acceptance_per_geometry():
    """TrieDrafter.shared keeps one AcceptanceStats per engine and drafter geometry, so a
    new request starts from what earlier requests measured (like the global trie)."""
    from lookahead_jax.core.engine import Engine
    from tiny import tiny_model

    m = Engine(tiny_model("llama"))
    a, b = TrieDrafter.shared(m), TrieDrafter.shared(m)
    assert a.acceptance is b.acceptance and a.trie is b.trie
    c = TrieDrafter.shared(m, mode="parallel")
    assert c.acceptance is not a.acceptance and c.trie is a.trie
    assert TrieDrafter().acceptance is not TrieDrafter().acceptance
    assert TrieDrafter.shared(Engine(m.model)).trie is not a.trie  # per engine


def test_random_classes_are_consistent():
    """The estimate of a class equals the plain mean of its last `window` samples, for
    every bucket, independent of other classes, after any number of evictions (the
    running sums behind the O(1) estimate)."""
    rng = random.Random(0)
    s = AcceptanceStats(window=5)
    seen = {}
    for _ in range(300):
        k = rng.choice("xyz")
        n = rng.randint(0, 9)
        tokens = [rng.randint(0, 2) for _ in range(n)]
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        actual = [rng.randint(0, 2) for _ in range(6)]
        s.observe(tokens, parents, actual, key=k)
        seen.setdefault(k, []).append([naive_accepted(tokens, parents, actual, b) for b in BUCKETS])
        last = seen[k][-5:]
        assert s.expected(k) == {b: sum(r[i] for r in last) / len(last) for i, b in enumerate(BUCKETS)}
    assert sorted(seen) == ["x", "y", "z"] and all(s.count(k) == 5 for k in seen)


def test_step_times_are_ratios_to_fresh_plain_steps_at_the_same_window():
    t = StepTimes(window=4, max_age=3, alpha=0.5)
    t.record(1, 128, 0.030)  # no plain step at this window yet: no sample
    assert t.ratio(1) == (None, 0)
    t.record(0, 128, 0.020)
    t.record(1, 128, 0.030)
    t.record(1, 256, 0.050)  # another window: no base there
    assert t.ratio(1) == (1.5, 1)
    t.record(0, 128, 0.030)  # moving average: 0.025
    t.record(3, 128, 0.050)
    assert t.ratio(3) == (2.0, 1)
    for _ in range(3):
        t.record(7, 128, 0.050)  # the third is 3 steps after the last plain one, then stale
    assert t.ratio(7) == (2.0, 2)
    for r in (1.0, 5.0, 1.2, 1.1, 1.3):  # median of the last `window` samples
        t.record(0, 512, 0.01)
        t.record(15, 512, 0.01 * r)
    assert t.ratio(15)[1] == 4 and t.ratio(15)[0] == pytest.approx((1.2 + 1.3) / 2)
    with pytest.raises(ValueError):
        StepTimes(alpha=0)


def test_observed_step_times_correct_the_calibrated_costs():
    """A tree the calibration priced too cheaply is dropped once real steps show its cost."""
    stats = AcceptanceStats()
    for _ in range(20):  # drafts of class "k" accept 0.3 drafts at T=1
        stats.observe([5], [-1], [5] if random.Random(_).random() < 0.3 else [6], "k")
    a1 = stats.expected("k")[1]
    cost = {0: 1.0, 1: 1.1}
    b = AutoBudget((0, 1), cost, stats, margin=0.0, cost_prior=4.0)
    assert (1 + a1) / 1.1 > 1.0 and b.choose(["k"]) == 1  # calibrated: the tree pays
    assert b.cost_ratios() == {0: 1.0, 1: pytest.approx(1.1)}
    for _ in range(12):  # real steps: T=1 costs 1.6x plain
        b.record(0, 128, 0.020)
        b.record(1, 128, 0.032)
    r = b.cost_ratios()[1]
    assert r == pytest.approx((12 * 1.6 + 4 * 1.1) / 16)
    assert (1 + a1) / r < 1.0 and b.choose(["k"]) == 0  # observed: plain decoding is faster
    # ratios stay monotone in T even if a bigger tree was observed cheaper
    c = AutoBudget((0, 1, 3), {0: 1.0, 1: 1.2, 3: 1.3}, stats, times=StepTimes())
    for _ in range(10):
        c.record(0, 128, 0.02)
        c.record(3, 128, 0.02)
    assert c.cost_ratios()[3] >= c.cost_ratios()[1]


def test_prior_costs_start_auto_without_calibration():
    """Without calibration `auto` starts from the platform's typical cost ratios: trees
    grow dearer with T on CPU; on accelerators small trees cost about the same; real
    steps then correct them like calibrated costs."""
    from lookahead_jax.core.budget import PRIOR_COST_RATIOS, prior_costs

    for table in PRIOR_COST_RATIOS.values():
        ts = sorted(table)
        assert ts == list(BUCKETS) and table[0] == 1.0
        assert all(table[a] <= table[b] for a, b in zip(ts, ts[1:]))
    cpu, gpu = prior_costs("cpu", BUCKETS), prior_costs("tpu", BUCKETS)
    assert cpu[63] > 2 * gpu[63] and gpu[15] / gpu[1] < 1.1
    b = AutoBudget(BUCKETS, cpu)
    assert b.choose(["unseen"]) == 0  # no evidence yet: plain decoding
    # any tree size has a prior (a draft chain of 4 is T = 4, not a bucket): the forward's
    from lookahead_jax.core.budget import forward_cost

    assert prior_costs("cpu", (0, 4), batch=8)[4] == pytest.approx(forward_cost("cpu", 40) / forward_cost("cpu", 8))
    with pytest.raises(ValueError, match="integers >= 0"):
        prior_costs("cpu", (0, -1))


def test_prior_costs_grow_with_the_batch():
    """Every row of the batch is in the verify block, so a tree costs more in a fuller
    batch: the prior is the cost of a forward of B x (1 + T) rows over one of B rows, and
    at batch 1 it is the measured per-tree table."""
    from lookahead_jax.core.budget import PRIOR_COST_RATIOS, forward_cost, prior_costs

    for platform in ("cpu", "gpu"):
        assert prior_costs(platform, BUCKETS, batch=1) == pytest.approx(PRIOR_COST_RATIOS[platform])
    # on the CPU a tree's cost grows with the batch (from 2 rows: the measured table is not
    # convex at 2-4 rows; the GPU's steps with tile sizes, so neither holds there)
    for T in BUCKETS[1:]:
        by_batch = [prior_costs("cpu", (0, T), batch=B)[T] for B in (2, 4, 8, 16, 32)]
        assert all(a <= b + 1e-9 for a, b in zip(by_batch, by_batch[1:])), (T, by_batch)
        assert by_batch[-1] >= PRIOR_COST_RATIOS["cpu"][T]
    assert forward_cost("cpu", 12) == pytest.approx(1.33 + (1.95 - 1.33) * 4 / 8)
    assert forward_cost("cpu", 256) == pytest.approx(11.3 + (11.3 - 6.4) * 2)  # linear past the table
    cpu8 = prior_costs("cpu", (0, 1, 15), batch=8)
    assert cpu8[1] == pytest.approx(1.95 / 1.33) and cpu8[15] == pytest.approx(11.3 / 1.33)
    with pytest.raises(ValueError, match="batch"):
        prior_costs("cpu", (0, 1), batch=0)
    with pytest.raises(ValueError, match="at least one row"):
        forward_cost("cpu", 0)


def test_auto_drafts_less_as_the_batch_fills():
    """The same drafts (a class that accepts 1.5 drafts at T=15, 1 at T=3, 0.6 at T=1) on
    every row: with batch-1 costs a tree pays; in a block of 8 rows the tree costs several
    plain steps and the choice shrinks, down to plain decoding (never slower)."""
    from lookahead_jax.core.budget import prior_costs

    stats = AcceptanceStats()
    for _ in range(10):
        stats.observe([5, 6, 7, 8], [-1, 0, 1, 2], [5, 6, 9], key="k")  # a(1) = 1, a(3) = 2
        stats.observe([5, 6, 7, 8], [-1, 0, 1, 2], [9], key="k")  # a = 0
    chosen = {}
    for B in (1, 2, 4, 8):
        b = AutoBudget((0, 1, 3, 7, 15), prior_costs("cpu", (0, 1, 3, 7, 15), batch=B), stats)
        chosen[B] = b.choose(["k"] * B)
    assert chosen[1] > 0 and chosen[8] == 0
    assert all(chosen[a] >= chosen[b] for a, b in zip((1, 2, 4), (2, 4, 8))), chosen


def test_own_statistics_are_per_row_and_restart_with_the_next_request():
    """On slots, each row's request has its own statistics: a request whose drafts keep
    failing stops counting for its row only, and the next request in that row starts from
    the shared statistics again."""
    from types import SimpleNamespace

    shared = AcceptanceStats()
    for _ in range(20):
        shared.observe([1, 2, 3], [-1, 0, 1], [1, 2, 3], key="k")  # a(3) = 3 elsewhere
    b = AutoBudget((0, 3), {0: 1.0, 3: 1.5}, shared, prior=8)
    req0, req1 = SimpleNamespace(), SimpleNamespace()
    b._own(0, req0, create=True)
    b._own(1, req1, create=True)
    for _ in range(40):
        b.observe([1, 2, 3], [-1, 0, 1], [7, 7, 7], key="k", b=0, row=req0)  # row 0's request fails
    assert b.expected_accepted("k", 0)[3] < 0.5 < b.expected_accepted("k", 1)[3]
    assert b.choose(["k"], owners=[0]) == 0 and b.choose(["k"], owners=[1]) == 3
    # a draft of a request that left row 0 does not count for the request now in it
    req2 = SimpleNamespace()
    b._own(0, req2, create=True)
    b.observe([1, 2, 3], [-1, 0, 1], [7, 7, 7], key="k", b=0, row=req0)
    assert b.local[0][1].count("k") == 0
    assert b.expected_accepted("k", 0)[3] == pytest.approx(shared.expected("k")[3])
    with pytest.raises(ValueError, match="owners"):
        b.choose(["k"], owners=[0, 1])


def test_drafts_with_their_own_estimates_are_priced_by_them():
    """A draft carrying its nodes' acceptance probabilities (Draft.accept_probs) is priced
    from them, times the class's accepted / predicted ratio (1/2 before any evidence):
    a class whose drafts keep failing stops drafting, one that keeps its promises drafts
    as deep as its estimates pay."""
    assert predicted_lengths([1.0, 0.5, 0.25])[:4] == (0, 1.0, 1.75, 1.75)
    cost = {0: 1.0, 1: 1.1, 3: 1.2, 7: 2.0}
    probs = (1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1)
    b = AutoBudget(tuple(cost), cost)
    # unseen: r = 1/2 -> a(1) = 0.5, a(3) = 1.5, a(7) = 1.7: T=3 gives 2.5 / 1.2
    assert b.expected_accepted("k", accept_probs=probs)[3] == pytest.approx(1.5)
    assert b.choose(["k"], accept_probs=[probs]) == 3
    for _ in range(10):  # the class's drafts are never accepted
        b.observe([5, 6, 7], [-1, 0, 1], [9], "k", accept_probs=(1.0, 1.0, 1.0))
    assert b.calibrated_ratios("k")[3] < 0.1
    assert b.choose(["k"], accept_probs=[probs]) == 0
    good = AutoBudget(tuple(cost), cost)
    for _ in range(10):  # always accepted as far as predicted
        good.observe([5, 6, 7], [-1, 0, 1], [5, 6, 7, 8], "k", accept_probs=(1.0, 1.0, 1.0))
    assert good.calibrated_ratios("k")[3] > 0.9
    assert good.choose(["k"], accept_probs=[probs]) == 3  # the 0.1 nodes are not worth T=7
    assert good.choose(["k"], accept_probs=[(1.0,) * 7]) == 7


def _thin_state(rows: int, batch: int = 16):
    """A decode state's view for `AutoBudget.plan` / `propose_nodes`: `rows` of `batch` active."""
    from types import SimpleNamespace

    import numpy as np

    active = np.arange(batch) < rows
    return SimpleNamespace(active=active, rows=[SimpleNamespace(ids=[], finish=None) for _ in range(batch)])


def _thin_step(b, state):
    """One step as `decode.step` drives the budget: (nodes asked of the drafter, T)."""
    n = b.propose_nodes(state)
    drafts = [Draft([1, 2, 3], [-1, 0, 1], key="unseen") if n and a else Draft([], []) for a in state.active]
    return n, b.plan(drafts, state)


def test_proposals_thin_out_while_trees_do_not_pay():
    """At >= THIN_ROWS rows, after THIN_AFTER plain choices in a row the drafter is asked
    only on probe steps, 1, 2, 4, ... THIN_MAX_GAP skipped steps apart; fewer active rows
    end the run (trees get cheaper per token), and below THIN_ROWS nothing is skipped."""
    from lookahead_jax.core.budget import THIN_AFTER, THIN_MAX_GAP, THIN_ROWS

    b = AutoBudget((0, 3), {0: 1.0, 3: 1.5})  # an unseen class: plain every time
    state = _thin_state(THIN_ROWS + 4)
    asked = [_thin_step(b, state)[0] > 0 for _ in range(200)]
    assert all(asked[:THIN_AFTER]) and not asked[THIN_AFTER]
    probes = [i for i, a in enumerate(asked) if a]
    gaps = [j - i - 1 for i, j in zip(probes[THIN_AFTER - 1:], probes[THIN_AFTER:])]
    assert gaps[:6] == [1, 2, 4, 8, 16, 16][:6] and set(gaps[4:]) == {THIN_MAX_GAP}
    assert b.skipped == asked.count(False) and b.summary()["proposals_skipped"] == b.skipped
    # one row fewer: asked at once, and every step until a new run of plain choices
    fewer = _thin_state(THIN_ROWS + 3)
    assert [_thin_step(b, fewer)[0] > 0 for _ in range(THIN_AFTER + 1)] == [True] * THIN_AFTER + [False]
    # below THIN_ROWS rows: every step
    small = AutoBudget((0, 3), {0: 1.0, 3: 1.5})
    assert all(_thin_step(small, _thin_state(THIN_ROWS - 1))[0] for _ in range(50)) and small.skipped == 0


def test_a_probe_that_picks_a_tree_ends_the_thinning():
    """Once the class turns out to pay, the next probe picks a tree and every later step
    proposes again."""
    from lookahead_jax.core.budget import THIN_AFTER, THIN_ROWS

    b = AutoBudget((0, 3), {0: 1.0, 3: 1.05})
    state = _thin_state(THIN_ROWS)
    for _ in range(THIN_AFTER + 3):
        _thin_step(b, state)
    assert b.skipped > 0
    for _ in range(20):  # the class now accepts 3 of 3
        b.stats.observe([1, 2, 3], [-1, 0, 1], [1, 2, 3], key="unseen")
    steps = [_thin_step(b, state) for _ in range(40)]
    first = next(i for i, (n, T) in enumerate(steps) if n)
    assert steps[first][1] == 3 and all(n == 3 and T == 3 for n, T in steps[first:])
