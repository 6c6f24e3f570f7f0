"""Merge-based trees (SpecInfer): several drafters' token trees verified as one tree.

Each step every drafter proposes its own tree; the trees are merged per row, a shared
prefix once: the first drafter's nodes keep their order, then every other drafter's nodes
that are new (same parent, same token = the same node) are appended in their order. The
result is topological, so a budget that keeps a prefix still keeps a tree.

    draft model: [5, 7, 9]     parents [-1, 0, 1]     (a chain 5 -> 7 -> 9)
    trie:        [5, 7, 4, 8]  parents [-1, 0, 1, -1]
    merged:      [5, 7, 9, 4, 8]  parents [-1, 0, 1, 1, -1]

After the verify step each drafter is told the accepted path in its own node indices:
the longest prefix of the path its own tree holds (a draft model commits its K/V along
that prefix and catches up on the rest as context). Merged trees are verified by
`TokenMatch` (greedy, or position-keyed sampling): the children of a merged node come from
different proposals, so there is no one draft distribution for speculative sampling.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.drafts import EMPTY, Draft, DraftBatch


def merge(drafts) -> tuple:
    """(merged Draft, per input draft the merged index of each of its nodes)."""
    tokens, parents, index = [], [], {}
    maps = []
    for d in drafts:
        own = []
        for t, p in zip(d.tokens, d.parents):
            key = (own[p] if p >= 0 else -1, int(t))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(t))
                parents.append(key[0])
            own.append(index[key])
        maps.append(own)
    return Draft(tokens, parents, key=drafts[0].key if drafts else None), maps


class MergedDrafter:
    """Several drafters as one (`drafters.base.Drafter`): their trees merged per row."""

    def __init__(self, *drafters, max_nodes: int | None = None):
        if len(drafters) < 2:
            raise ValueError("MergedDrafter needs at least two drafters")
        self.drafters = drafters
        self.max_nodes = max_nodes if max_nodes is not None else sum(d.max_nodes for d in drafters)
        self._maps: list = []

    def begin(self, state, references=None, rows=None) -> None:
        for d in self.drafters:
            d.begin(state, references, rows)

    def propose(self, state, budget: int) -> DraftBatch:
        batches = [d.propose(state, d.max_nodes) for d in self.drafters]
        if any(b.probs is not None for b in batches):
            raise ValueError("merged trees are verified by matching tokens: use temperature 0 or "
                             "sampler='invariant' (a draft model sampling with 'mss' cannot merge)")
        drafts, self._maps = [], []
        for b in range(state.batch):
            tree, maps = merge([batch[b] for batch in batches])
            drafts.append(tree.truncated(budget) if len(tree) else EMPTY)
            self._maps.append(maps)
        return DraftBatch(tuple(drafts))

    def update(self, state, step) -> None:
        B = state.batch
        for k, d in enumerate(self.drafters):
            path = np.zeros_like(step.path)
            n_emit = np.array(step.n_emit, copy=True)
            for b in range(B):
                if step.n_emit[b] <= 0:
                    continue
                inverse = {m: i for i, m in enumerate(self._maps[b][k])}
                own = []
                for blk in step.path[b, 1:int(step.n_emit[b])]:
                    i = inverse.get(int(blk) - 1)
                    if i is None:
                        break
                    own.append(i + 1)
                path[b, 1:1 + len(own)] = own
                n_emit[b] = len(own) + 1  # the rest of the emitted tokens: context to catch up on
            d.update(state, dataclasses.replace(step, path=path, n_emit=n_emit))

    def rollback(self, rows, length) -> None:
        for d in self.drafters:
            d.rollback(rows, length)

    def end(self, rows=None) -> None:
        for d in self.drafters:
            d.end(rows)

    def summary(self) -> dict:
        out = {}
        for d in self.drafters:
            out.update(d.summary())
        return out
