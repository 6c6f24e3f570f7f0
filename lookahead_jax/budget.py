"""Choosing the draft budget T (tree nodes per verify step) from measured costs.

Model: a step that verifies T draft nodes costs t(T) seconds (measured once per model,
batch and cache length by timing the compiled verify step) and emits 1 + a(T) tokens per
row, where a(T) is the number of accepted drafts. Expected throughput is

    tokens/s(T) = E[1 + a(T)] / t(T),

and `AutoBudget` picks the bucket T that maximises it.

a(T) is estimated without trying every T: drafters return nodes in best-first,
topological order, so the tree of budget T' < T is the first T' nodes of the full draft.
Since decoding is lossless, the tokens eventually generated are the ground truth, so for
every step we can compute, once enough later tokens are known, how many drafts *any*
budget would have had accepted (`accepted_length`). A running window of those counts
gives a(T) for all buckets at once.
"""

from __future__ import annotations

import collections
from typing import Sequence


def accepted_length(tokens: Sequence[int], parents: Sequence[int], actual: Sequence[int], budget: int) -> int:
    """Drafts a tree of the first `budget` nodes would have accepted, given the true
    continuation `actual` (tokens after the root).

    # tokens [5, 7, 6], parents [-1, 0, -1], actual [5, 7, 9] -> node0 ok (depth 1),
    # node1 ok (depth 2), node2 wrong -> 2 accepted
    """
    depth = [0] * budget
    ok = [False] * budget
    best = 0
    for i in range(min(budget, len(tokens))):
        p = parents[i]
        d = 1 if p < 0 else depth[p] + 1
        depth[i] = d
        if (p < 0 or ok[p]) and d <= len(actual) and tokens[i] == actual[d - 1]:
            ok[i] = True
            best = max(best, d)
    return best


class AutoBudget:
    """Running estimate of a(T) per bucket and the argmax of E[1 + a(T)] / t(T)."""

    def __init__(self, buckets: Sequence[int], cost: dict, window: int = 64, prior: float = 0.5):
        if not buckets:
            raise ValueError("AutoBudget needs at least one bucket")
        missing = [b for b in buckets if b not in cost]
        if missing:
            raise ValueError(f"no measured cost for buckets {missing}")
        self.buckets = tuple(sorted(buckets))
        self.cost = dict(cost)
        self.window = window
        self.prior = prior  # optimistic prior accepted drafts for an unexplored budget
        self.samples = collections.deque(maxlen=window)  # each: tuple of a(T) per bucket

    def observe(self, tokens, parents, actual) -> None:
        self.samples.append(tuple(accepted_length(tokens, parents, actual, b) for b in self.buckets))

    def expected_accepted(self) -> dict:
        if not self.samples:
            return {b: self.prior * min(b, 4) for b in self.buckets}
        n = len(self.samples)
        return {b: sum(s[i] for s in self.samples) / n for i, b in enumerate(self.buckets)}

    def choose(self) -> int:
        acc = self.expected_accepted()
        # max rate; ties go to the smaller tree
        return max(self.buckets, key=lambda b: ((1.0 + acc[b]) / self.cost[b], -b))
