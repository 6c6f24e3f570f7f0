"""Tree packing: literal matrices for depth, ancestor mask, padding, verify block, buckets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_jax.core.tree import (
    PAD_PARENT,
    PAD_TOKEN,
    ROOT,
    PackedTree,
    BUCKETS,
    bucket_for,
    buckets_up_to,
    pack,
    verify_block_mask,
    with_root,
)
from lookahead_jax.drafters.ngram_trie import Draft, NgramTrie


def test_constants():
    assert (ROOT, PAD_PARENT, PAD_TOKEN) == (-1, -2, 0)


def test_hierarchical_example_literal():
    #   root -> 10 -> 11 -> 13
    #             `-> 12
    d = Draft(tokens=[10, 11, 12, 13], parents=[-1, 0, 0, 1])
    p = pack([d], T=4)
    np.testing.assert_array_equal(p.tokens, [[10, 11, 12, 13]])
    np.testing.assert_array_equal(p.parents, [[-1, 0, 0, 1]])
    np.testing.assert_array_equal(p.depth, [[1, 2, 2, 3]])
    np.testing.assert_array_equal(p.valid, [[True, True, True, True]])
    anc = [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    np.testing.assert_array_equal(p.anc, np.array([anc], bool))
    assert p.tokens.dtype == p.parents.dtype == p.depth.dtype == np.int32
    assert p.anc.dtype == p.valid.dtype == bool
    np.testing.assert_array_equal(p.num_nodes, [4])


def test_parallel_example_is_block_diagonal():
    # two chains, 10-11-12 and 10-13: duplicated prefix, no shared nodes
    d = Draft(tokens=[10, 11, 12, 10, 13], parents=[-1, 0, 1, -1, 3])
    p = pack([d], T=5)
    np.testing.assert_array_equal(p.depth, [[1, 2, 3, 1, 2]])
    anc = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    np.testing.assert_array_equal(p.anc[0], np.array(anc, bool))


def test_padding_literal():
    drafts = [
        Draft([7, 8], [-1, 0]),
        Draft([], []),
        Draft([5, 6, 9], [-1, -1, 1]),
    ]
    p = pack(drafts, T=4)
    np.testing.assert_array_equal(p.tokens, [[7, 8, 0, 0], [0, 0, 0, 0], [5, 6, 9, 0]])
    np.testing.assert_array_equal(
        p.parents, [[-1, 0, -2, -2], [-2, -2, -2, -2], [-1, -1, 1, -2]]
    )
    np.testing.assert_array_equal(p.depth, [[1, 2, 0, 0], [0, 0, 0, 0], [1, 1, 2, 0]])
    np.testing.assert_array_equal(
        p.valid,
        [[True, True, False, False], [False] * 4, [True, True, True, False]],
    )
    np.testing.assert_array_equal(p.valid, p.parents != PAD_PARENT)
    anc0 = [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],  # padding sees only itself
        [0, 0, 0, 1],
    ]
    anc2 = [
        [1, 0, 0, 0],
        [0, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 0, 1],
    ]
    np.testing.assert_array_equal(p.anc[0], np.array(anc0, bool))
    np.testing.assert_array_equal(p.anc[1], np.eye(4, dtype=bool))
    np.testing.assert_array_equal(p.anc[2], np.array(anc2, bool))
    np.testing.assert_array_equal(p.num_nodes, [2, 0, 3])


def test_zero_nodes_and_empty_batch():
    p = pack([Draft([], [])], T=0)
    assert p.tokens.shape == (1, 0) and p.anc.shape == (1, 0, 0)
    p = pack([], T=4)
    assert p.tokens.shape == (0, 4) and p.anc.shape == (0, 4, 4)


def test_verify_block_mask_literal():
    anc = np.array(
        [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool
    )  # parents [-1, 0, 0, 1]
    mask = verify_block_mask(anc)
    expect = [
        [1, 0, 0, 0, 0],  # root: only itself
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    np.testing.assert_array_equal(mask, np.array([expect], bool))
    assert mask.dtype == bool
    # any leading shape; unbatched too
    np.testing.assert_array_equal(verify_block_mask(anc[0]), np.array(expect, bool))
    with pytest.raises(ValueError):
        verify_block_mask(np.zeros((1, 2, 3), bool))


def test_with_root_literal():
    p = pack([Draft([7, 8], [-1, 0]), Draft([5], [-1])], T=3)
    blk = with_root(p, np.array([42, 43]))
    np.testing.assert_array_equal(blk.tokens, [[42, 7, 8, 0], [43, 5, 0, 0]])
    np.testing.assert_array_equal(blk.depth, [[0, 1, 2, 0], [0, 1, 0, 0]])
    np.testing.assert_array_equal(blk.parents, [[-1, 0, 1, -2], [-1, 0, -2, -2]])
    np.testing.assert_array_equal(blk.valid, [[1, 1, 1, 0], [1, 1, 0, 0]])
    expect0 = [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 0, 0, 1],  # padding: root + itself
    ]
    np.testing.assert_array_equal(blk.mask[0], np.array(expect0, bool))
    np.testing.assert_array_equal(blk.mask, verify_block_mask(p.anc))
    assert blk.tokens.dtype == blk.depth.dtype == blk.parents.dtype == np.int32
    with pytest.raises(ValueError, match="rows"):
        with_root(p, [1, 2, 3])


def test_bucket_for():
    assert BUCKETS == (0, 1, 3, 7, 15, 31, 63, 127)  # verify blocks of 1+T = 2^k rows
    assert bucket_for(0) == 0
    assert bucket_for(1) == 1
    assert bucket_for(2) == 3
    assert bucket_for(4) == 7
    assert bucket_for(17) == 31
    assert bucket_for(127) == 127
    assert bucket_for(5, buckets=(16, 8)) == 8
    with pytest.raises(ValueError, match="largest bucket 127"):
        bucket_for(128)
    with pytest.raises(ValueError, match="largest bucket 8"):
        bucket_for(9, buckets=(4, 8))
    with pytest.raises(ValueError):
        bucket_for(-1)


def test_buckets_up_to_a_fixed_budget():
    assert buckets_up_to(0) == (0,)
    assert buckets_up_to(7) == (0, 1, 3, 7)
    assert buckets_up_to(8) == (0, 1, 3, 7, 8)  # never padded past the budget
    assert buckets_up_to(128) == BUCKETS + (128,)
    for bad in (-1, 129):
        with pytest.raises(ValueError, match=r"\[0, 128\]"):
            buckets_up_to(bad)


def test_too_long_is_an_error_unless_truncating():
    d = Draft([1, 2, 3, 4], [-1, 0, -1, 2])
    with pytest.raises(ValueError, match="4 nodes > T=3"):
        pack([d], T=3)
    p = pack([d], T=3, truncate=True)  # keeps the first 3: a prefix is closed
    np.testing.assert_array_equal(p.tokens, [[1, 2, 3]])
    np.testing.assert_array_equal(p.parents, [[-1, 0, -1]])
    np.testing.assert_array_equal(p.depth, [[1, 2, 1]])


@pytest.mark.parametrize(
    "parents",
    [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 5]],
)
def test_non_topological_parents_are_an_error(parents):
    with pytest.raises(ValueError, match="parents"):
        pack([Draft(list(range(len(parents))), parents)], T=8)


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="parents"):
        pack([Draft([1, 2], [-1])], T=4)
    with pytest.raises(ValueError):
        pack([Draft([], [])], T=-1)


@st.composite
def drafts_st(draw, max_nodes=10):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(1, 99), min_size=n, max_size=n))
    return Draft(tokens, parents)


@settings(max_examples=80, deadline=None)
@given(drafts=st.lists(drafts_st(), min_size=1, max_size=4), extra=st.integers(0, 3))
def test_pack_matches_path_walk(drafts, extra):
    """anc/depth agree with walking parents; padding is isolated; masks are consistent."""
    T = max(len(d) for d in drafts) + extra
    p = pack(drafts, T)
    assert isinstance(p, PackedTree)
    for b, d in enumerate(drafts):
        for i in range(T):
            if i >= len(d):
                assert not p.valid[b, i] and p.parents[b, i] == PAD_PARENT
                assert p.tokens[b, i] == PAD_TOKEN and p.depth[b, i] == 0
                np.testing.assert_array_equal(p.anc[b, i], np.arange(T) == i)
                assert not p.anc[b, : len(d), i].any()  # no valid node sees padding
                continue
            path, j = [], i
            while j != ROOT:
                path.append(j)
                j = d.parents[j]
            assert p.depth[b, i] == len(path) == p.anc[b, i].sum()
            np.testing.assert_array_equal(np.flatnonzero(p.anc[b, i]), sorted(path))
    blk = with_root(p, np.zeros(len(drafts), np.int32))
    assert blk.mask.shape == (len(drafts), T + 1, T + 1)
    assert blk.mask[:, :, 0].all() and not blk.mask[:, 0, 1:].any()
    np.testing.assert_array_equal(blk.depth[:, 1:], p.depth)


def test_packs_trie_drafts():
    trie = NgramTrie(branch_length=3)
    trie.insert_input([1, 2, 3, 4, 1, 2, 5])
    drafts = [trie.retrieve([9, 1], 8, mode=m) for m in ("hierarchical", "parallel", "single")]
    T = bucket_for(max(len(d) for d in drafts), buckets_up_to(8))
    assert T == 7  # the longest draft has 5 nodes: padded to the 8-row block, not to 8
    p = pack(drafts, T)
    expect = [[1, 2, 3, 2, 0], [1, 2, 3, 1, 2], [1, 2, 3, 0, 0]]
    np.testing.assert_array_equal(p.depth[:, :5], expect)
