"""What drafters hand the decode loop: one token tree per row (host, numpy; no jax).

A `Draft` is a token tree proposed after a row's root (its last emitted token, the one
not yet in the KV cache), nodes in topological order:

    tokens  [5, 7, 6]     node tokens
    parents [-1, 0, -1]   parent node index, -1 = a child of the root (parents[i] < i)

A `DraftBatch` is one Draft per batch row (empty for rows without a draft or finished
rows), plus optional per-node draft probabilities for acceptance rules that need them
(speculative sampling); `None` means the drafts are deterministic (one-hot).

Drafters return nodes best-first, so the first n nodes are the best tree of n nodes: a
budget truncates a draft by keeping a prefix, which stays a tree (a prefix of a
topological order is closed under parents).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Draft:
    """A token tree after a row's root (module docstring).

    key: the draft's class for the acceptance statistics of `budget.AutoBudget` (drafts of
    one class are accepted about equally often); a drafter sets what it knows, e.g. the
    trie's (match length, dominance of the top continuation). None: unclassified.

    accept_probs: optional, per node the drafter's own estimate of the probability that
    the node is accepted (e.g. the suffix drafter's path probability); `AutoBudget`
    calibrates it per class against what drafts of the class really had accepted and then
    prices every tree size from this draft's own estimates, not only the class's mean.
    None: the class's mean alone.
    """

    tokens: list[int]
    parents: list[int]
    key: Hashable = None
    accept_probs: Optional[Sequence[float]] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Draft":
        """Its first n nodes (a tree: parents come first)."""
        return self if len(self.tokens) <= n else dataclasses.replace(
            self, tokens=self.tokens[:n], parents=self.parents[:n],
            accept_probs=None if self.accept_probs is None else self.accept_probs[:n])

    @functools.cached_property
    def depths(self) -> list:
        """`depths(parents)`, computed once per draft (the budget replays a draft against
        the row's tokens after every step until its outcome is known)."""
        return depths(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)


EMPTY = Draft([], [])


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One Draft per batch row; `probs` optional draft distributions [B, 1+N, V] in block
    order (row i: the distribution the children of block node i were drawn from; block
    node 0 is the root, node j of a draft is block node j+1; all-zero rows: deterministic
    children), a host or device array (a draft model keeps it on device). None:
    deterministic drafts, as the n-gram trie's."""

    drafts: tuple
    probs: Optional[tuple] = None

    @classmethod
    def empty(cls, batch: int) -> "DraftBatch":
        return cls((EMPTY,) * batch)

    def __len__(self) -> int:
        return len(self.drafts)

    def __getitem__(self, row: int) -> Draft:
        return self.drafts[row]

    @property
    def max_nodes(self) -> int:
        return max((len(d) for d in self.drafts), default=0)

    def truncated(self, n: int) -> "DraftBatch":
        return dataclasses.replace(self, drafts=tuple(d.truncated(n) for d in self.drafts))


def depths(parents: Sequence[int]) -> list:
    """Depth of every node (a root child is 1); the one place this recurrence lives.

    # parents [-1, 0, 0, 1, -1] -> depths [1, 2, 2, 3, 1]
    """
    out = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p} is not in [-1, {i}) (parents must come first)")
        out.append(1 if p < 0 else out[p] + 1)
    return out


class SkipRows:
    """A drafter whose drafts for `rows` are dropped (plain-decoding requests among drafting
    ones); everything else goes to `inner`."""

    def __init__(self, inner, rows):
        self.inner, self.rows = inner, rows
        self.max_nodes = inner.max_nodes
        self.defer_update = getattr(inner, "defer_update", False)

    def propose(self, state, budget: int) -> DraftBatch:
        out = self.inner.propose(state, budget)
        return dataclasses.replace(out, drafts=tuple(EMPTY if b in self.rows else d for b, d in enumerate(out.drafts)))

    def update(self, state, step) -> None:
        self.inner.update(state, step)
