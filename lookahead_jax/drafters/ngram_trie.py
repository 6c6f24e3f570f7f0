"""Host-side token n-gram trie that proposes Lookahead drafts (pure Python, no jax).

`NgramTrie` is the trie: its storage (nodes, own and shared counts, inserts, streaming
output, capacity and squeeze) is its base class `ngram_counts.NgramCounts`, whose module
docstring describes it ("Storage", "Streaming output", "Capacity and squeeze"); this module
holds what drafts from it:

Retrieval
---------
``retrieve(context, ..., req)`` drafts from ``req``'s own evidence first. It matches the
longest suffix of ``context`` (lengths ``min(max_match, len(context), W - 1)`` down to 1)
whose path has own counts of ``req`` and that has a child with them; only if there is
none, the longest suffix that is a visible path (own counts or output count > 0) with a
visible child. From the matched node it takes continuations by key, in two tiers::

    own = input_weight * input + own_output     # input_weight = 2**32 by default
    key = (1, own) if own > 0 else (0, out)     # then the smaller token id first

Every node the request saw itself ranks before every node only the shared output holds.
Among them input counts come first and own output counts break their ties (lexicographic
while they stay below 2**32); shared output counts order only the shared tier. A match of
k tokens leaves paths of at most W - k tokens, so the draft depth is at most
``min(branch_length, W - k)``; the matched tokens themselves are never returned.
``max_match`` defaults to 2, as PIA's decoding loop matches the last two tokens: longer
matches are more specific but leave fewer levels. PIA's geometry (two-token match, full
depth b) is ``NgramTrie(branch_length=b + 1)`` retrieved with ``branch_length=b``.

Own trie first: the own tier is what a private ``NgramTrie`` fed only ``req``'s inputs and
outputs holds, with the same keys, so in every mode and for every budget the draft begins
with that private trie's draft (same match length, its nodes first with the same tokens
and parents) and shared output only fills what budget is left: other requests' outputs
never displace, reorder or shorten it. This holds as long as none of ``req``'s windows was
cut because the trie was full (below); squeezes never touch own counts.

Modes (``decoding_length`` caps the number of returned nodes in all of them):

* ``"hierarchical"``: one tree, shared prefixes merged; best-first expansion by key.
  Keys never grow along a path, so the result is the top-``decoding_length`` nodes of
  the continuation tree (closed under parents): the own tier's first. Heap ties: key
  desc, token asc, then parent index asc.
* ``"parallel"``: the root-to-leaf paths of the hierarchical tree as independent chains
  (prefixes duplicated, a block-diagonal ancestor mask), depth first, better children
  first, the own tier's chains before the rest; the last one cut to the budget
  (`trie_drafts.parallel_chains`).
* ``"single"``: the greedy best chain (best child at each step).

The result is a ``Draft``: ``tokens`` and ``parents`` (index into the draft of each node's
parent; -1 = child of the root, i.e. of the last accepted token), parent before child.

    # hierarchical draft  tokens [2, 3, 4, 5]   parents [-1, 0, 1, 0]
    #                     root -> 2 -> 3 -> 4
    #                               `-> 5
    # parallel draft      tokens [2, 3, 4, 2, 5] parents [-1, 0, 1, -1, 3]
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from ..core.drafts import Draft
from .ngram_counts import INPUT_WEIGHT, ONE_INPUT, OWN_OUT, NgramCounts, Node, as_ints
from .trie_drafts import TrieDraft, parallel_chains

__all__ = ["INPUT_WEIGHT", "MODES", "Draft", "NgramTrie", "TrieDraft"]

MODES = ("hierarchical", "parallel", "single")
_SHARED = 1 << 59  # rank (smaller first): -own score (< 0) in the own tier, _SHARED - out (> 0)


class NgramTrie(NgramCounts):
    """Token n-gram trie with per-request own counts (input, own output) and shared output
    counts.

    Args:
      branch_length: windows of ``branch_length + 1`` tokens are stored; drafts are at
        most ``branch_length`` deep.
      max_nodes: bound on the number of nodes, and on the number of own counters.
      max_output_nodes: bound on the number of nodes with a shared output count > 0.
      input_weight: score weight of an input count against an own output count.
    """

    # -------------------------------------------------------------- retrieval

    def retrieve(
        self,
        context: Sequence[int],
        decoding_length: int,
        branch_length: int | None = None,
        mode: str = "hierarchical",
        req: Hashable = 0,
        *,
        max_match: int = 2,
    ) -> Draft:
        """Draft continuing ``context`` (its last token is the root), ``req``'s own trie's
        draft first (module docstring, "Retrieval").

        At most ``decoding_length`` nodes, at most ``branch_length`` deep (default: the
        trie's). ``max_match`` caps the suffix length tried. Empty draft if nothing
        matches.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        depth_cap = self.branch_length if branch_length is None else branch_length
        kmax = min(max_match, len(context), self.window - 1)
        if decoding_length <= 0 or depth_cap <= 0 or kmax <= 0:
            return TrieDraft([], [])
        suffix = as_ints(context[len(context) - kmax:])
        found = self._match(suffix, req, True) or self._match(suffix, req, False)
        if found is None:
            return TrieDraft([], [])
        k, node = found
        counts = [c.out + (c.own.get(req, 0) >> 32 if c.own else 0) or  # input + output
                  (c.own.get(req, 0) & OWN_OUT if c.own else 0)  # (own output if squeezed)
                  for c in node.children.values()]
        counts = [c for c in counts if c]
        dominance = 2 if len(counts) == 1 else int(2 * max(counts) >= sum(counts))
        max_depth = min(depth_cap, self.window - k)
        w = self.input_weight
        if mode == "single":
            tokens, parents = self._single(node, decoding_length, max_depth, req, w)
        else:
            tokens, parents, n_own = self._hierarchical(node, decoding_length, max_depth, req, w)
            if mode == "parallel":
                tokens, parents = parallel_chains(tokens, parents, decoding_length, n_own)
        return TrieDraft(tokens, parents, match_len=k, dominance=dominance)

    # -------------------------------------------------------------- internals

    def _match(self, suffix: list[int], req: Hashable, own_only: bool):
        """(k, node) of the longest suffix of ``suffix`` whose path and one child are
        visible: through ``req``'s own counts (own_only) or any count. None if none is."""
        kmax = len(suffix)
        for k in range(kmax, 0, -1):
            node, children = None, self._root
            for t in suffix[kmax - k:]:
                node = children.get(t)
                if node is None or not (
                    (node.own is not None and req in node.own) or (node.out and not own_only)
                ):
                    node = None
                    break
                children = node.children
            if node is not None and any(
                (c.own is not None and req in c.own) or (c.out and not own_only)
                for c in children.values()
            ):
                return k, node
        return None

    def _kids(self, node: Node, req: Hashable, w: int, limit: int) -> list:
        """Visible children of ``node`` as [(rank, token, child)], best (smallest) first:
        rank = -own score in the own tier (< 0), _SHARED - out in the shared tier (> 0)."""
        kids = []
        fast, shared = w == ONE_INPUT, _SHARED
        for t, c in node.children.items():
            own = c.own
            if own is not None and req in own:
                v = own[req]  # own score: v itself for the default weight
                kids.append((-v if fast else -(w * (v >> 32) + (v & OWN_OUT)), t, c))
            elif c.out:
                kids.append((shared - c.out, t, c))
        if len(kids) > limit:
            return heapq.nsmallest(limit, kids)  # (rank, token) is unique: no node compare
        kids.sort()
        return kids

    def _hierarchical(self, start: Node, budget: int, max_depth: int, req: Hashable, w: int):
        """Best-first: the heap holds, per expanded node, its best not-yet-taken child;
        taking a child pushes its next sibling and its own best child. Also returns how
        many of the nodes are own-tier (they come first)."""
        tokens: list[int] = []
        parents: list[int] = []
        n_own = 0
        kids = self._kids(start, req, w, budget)
        if not kids:
            return tokens, parents, n_own
        # heap entry: (rank, token, parent index, sibling index, siblings, depth)
        heap = [(kids[0][0], kids[0][1], -1, 0, kids, 1)]
        while heap and len(tokens) < budget:
            rank, t, p, i, sibs, depth = heapq.heappop(heap)
            idx = len(tokens)
            tokens.append(t)
            parents.append(p)
            n_own += rank < 0
            if i + 1 < len(sibs):
                s2, t2, _ = sibs[i + 1]
                heapq.heappush(heap, (s2, t2, p, i + 1, sibs, depth))
            if depth < max_depth:
                sub = self._kids(sibs[i][2], req, w, budget - len(tokens))
                if sub:
                    heapq.heappush(heap, (sub[0][0], sub[0][1], idx, 0, sub, depth + 1))
        return tokens, parents, n_own

    def _single(self, node: Node, budget: int, max_depth: int, req: Hashable, w: int):
        tokens: list[int] = []
        for _ in range(min(budget, max_depth)):
            best = self._kids(node, req, w, 1)  # [(rank, token, child)] of the best child
            if not best:
                break
            _, t, node = best[0]
            tokens.append(t)
        return tokens, list(range(-1, len(tokens) - 1))
