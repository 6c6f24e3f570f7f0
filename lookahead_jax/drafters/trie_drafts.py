"""The n-gram trie's drafts (host, no jax): `TrieDraft`, and `parallel_chains`, which
turns a draft tree into independent chains, one per root-to-leaf path, prefixes
duplicated (the ancestor mask is block diagonal): the trie's ``"parallel"`` mode
(`ngram_trie`), its own-tier part first as the request's private trie would give it, then
the chains through shared-tier nodes."""

from __future__ import annotations

import dataclasses

from ..core.drafts import Draft


@dataclasses.dataclass(frozen=True)
class TrieDraft(Draft):
    """A trie draft (`drafts.Draft`) with how it was found: match_len, how many context
    tokens were matched (0 for the empty draft); dominance, 2 if the matched context has a
    single continuation, 1 if the top one holds at least half of the counts (input +
    output), else 0. Its `key` (the class for the acceptance statistics) is the pair."""

    match_len: int = 0
    dominance: int = 0

    def __post_init__(self):
        object.__setattr__(self, "key", (self.match_len, self.dominance))


def parallel_chains(tokens: list[int], parents: list[int], budget: int, n_own: int):
    """Hierarchical draft -> independent chains, one per root-to-leaf path: the chains of
    the own-tier part (its first ``n_own`` nodes, a tree by itself) first, then, if they
    all fit, the chains of the whole tree that reach a shared-tier node.

    # tokens [2, 3, 4, 5], parents [-1, 0, 1, 0]  (paths 2-3-4 and 2-5)
    #   -> tokens [2, 3, 4, 2, 5], parents [-1, 0, 1, -1, 3]
    """
    out_t: list[int] = []
    out_p: list[int] = []
    if _chains(tokens[:n_own], parents[:n_own], budget, n_own, out_t, out_p):
        _chains(tokens, parents, budget, n_own, out_t, out_p, shared=True)
    return out_t, out_p


def _chains(tokens, parents, budget, n_own, out_t, out_p, shared=False) -> bool:
    """Append the root-to-leaf paths of the tree (with ``shared``: only those that reach a
    node >= n_own) in depth-first order while the budget lasts. False if a cut chain was
    dropped for adding no node not already emitted."""
    kids: list[list[int]] = [[] for _ in tokens]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else kids[p]).append(i)
    prev: list[int] = []  # previous emitted path (draft indices)
    stack = [[r] for r in reversed(roots)]
    while stack and len(out_t) < budget:
        path = stack.pop()
        if kids[path[-1]]:
            stack.extend(path + [c] for c in reversed(kids[path[-1]]))
            continue
        # an index grows along a path: the first shared node, if any, is where it starts
        first_new = next((j for j, i in enumerate(path) if i >= n_own), len(path)) if shared else 0
        if first_new == len(path):
            continue  # an own-tier path: emitted before
        lcp = 0  # DFS order: the longest shared prefix is with the previous path
        while lcp < min(len(prev), len(path)) and prev[lcp] == path[lcp]:
            lcp += 1
        keep = min(len(path), budget - len(out_t))
        if keep <= max(lcp, first_new):
            return False  # the cut path would only repeat nodes already emitted
        for j in range(keep):
            out_p.append(-1 if j == 0 else len(out_t) - 1)
            out_t.append(tokens[path[j]])
        prev = path
    return True
