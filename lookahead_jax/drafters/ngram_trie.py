"""Host-side token n-gram trie that proposes Lookahead drafts (pure Python, no jax).

Storage
-------
Every window of W = branch_length + 1 consecutive tokens of an inserted sequence is a
path from a virtual root: the window's first token is a root child, its last token sits
at depth W. Windows that start near the end of a finished sequence are shorter; a window
of one token has no continuation and is skipped.

    # tokens [5, 6, 7, 8], branch_length=2 (W=3) -> windows [5,6,7], [6,7,8], [7,8]

Each node holds two kinds of counts:

* ``out``: output count, shared by every request. Generated tokens are inserted as they
  stream out, so the trie warms up across requests.
* ``inp``: input counts, one counter per request id (``{req: count}``): the request's
  prompt and its reference documents (e.g. retrieved passages). Another request never
  sees them, so batch rows do not interfere; ``end_request(req)`` removes them.

Inserting a window adds 1 to each count of its kind along its path, so counts are
monotone: ``count(child) <= count(parent)`` for ``out`` and for each ``inp[req]``. A node
left with no count at all is removed; monotonicity guarantees its subtree is countless
too, so nothing counted is ever orphaned.

Streaming output
----------------
Output windows are built up token by token, so a request's own recent n-grams can be
drafted at once (a model repeating a phrase is caught on its second occurrence, not W
tokens later). ``insert_output`` keeps a per-request tail of the last W-1 tokens; each new
token p extends every window that starts in the tail (start s, p - s < W) by one node,
adding 1 to that node only (the earlier nodes of the window were counted when it was
shorter); a window of two tokens counts both. Streaming a sequence in any chunks therefore
counts exactly the windows of the whole sequence, each once, and ``end_request`` only
drops the tail.

    # W=3   insert_output([5, 6]) -> [5,6]                 tail [5, 6]
    #       insert_output([7])    -> [5,6,7] (7 added), [6,7]         tail [6, 7]
    #       insert_output([8])    -> [6,7,8] (8 added), [7,8]         tail [7, 8]

Should a squeeze evict part of a window that is still growing, the window stops growing,
and a grown node's count is capped by its parent's, which keeps counts monotone.

Capacity and squeeze
--------------------
``max_nodes`` bounds the number of nodes and, separately, the number of input counters
(node, request) pairs; ``max_output_nodes`` bounds the nodes whose output count is > 0.
Both hold after every public call, whatever the number of requests.

One squeeze pass (PIA's rule) visits every node with an output count:
``out <= 1 -> out = 0`` and ``out >= 2 -> out // 2`` (so it stays >= 1). A node then left
with no count of either kind is dropped with its subtree; a node that still holds input
counts of a live request is kept with its output count zeroed.

* After each output window, if the output nodes exceed ``max_output_nodes``, passes
  repeat until at most 7/8 of it remain (the low-water mark amortises the O(nodes) pass
  over at least budget/8 later insertions).
* Before each window, if it might not fit under ``max_nodes``, passes repeat until the
  nodes are at most ``max_nodes - max(W, max_nodes // 8)`` or no output count is left.
  If input counts alone fill the budget, the trie is "full": windows are cut where a new
  node or counter would be needed, until ``end_request`` or a squeeze frees nodes.

Retrieval
---------
``retrieve(context, ...)`` matches the longest suffix of ``context`` (lengths
``min(max_match, len(context), W - 1)`` down to 1) that is a visible path (count > 0 for
this request or for output) with at least one visible child. From the matched node it
takes continuations by score::

    score = input_weight * inp[req] + out        # input_weight = 2**32 by default

so input counts come first and output counts break their ties (lexicographic while
output counts stay below 2**32). Ties in score go to the smaller token id. A match of k
tokens leaves paths of at most W - k tokens, so the draft depth is at most
``min(branch_length, W - k)``; the matched tokens themselves are never returned.
``max_match`` defaults to 2, as PIA's decoding loop matches the last two tokens: longer
matches are more specific but leave fewer levels. PIA's geometry (two-token match, full
depth b) is ``NgramTrie(branch_length=b + 1)`` retrieved with ``branch_length=b``.

Modes (``decoding_length`` caps the number of returned nodes in all of them):

* ``"hierarchical"``: one tree, shared prefixes merged; best-first expansion by score.
  Scores never grow along a path, so the result is the top-``decoding_length`` nodes of
  the continuation tree (closed under parents). Heap ties: score desc, token asc, then
  parent index asc.
* ``"parallel"``: the root-to-leaf paths of the hierarchical tree, each emitted as an
  independent chain (prefixes duplicated, not merged), in depth-first order visiting
  better children first; the last chain is cut to the budget (and dropped when the cut
  leaves only a prefix already emitted). The ancestor mask is block diagonal.
* ``"single"``: the greedy best chain (best child at each step).

The result is a ``Draft``: ``tokens`` and ``parents`` (index into the draft of each node's
parent; -1 = child of the root, i.e. of the last accepted token), parent before child.

    # hierarchical draft  tokens [2, 3, 4, 5]   parents [-1, 0, 1, 0]
    #                     root -> 2 -> 3 -> 4
    #                               `-> 5
    # parallel draft      tokens [2, 3, 4, 2, 5] parents [-1, 0, 1, -1, 3]
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from ..core.drafts import Draft

INPUT_WEIGHT = 1 << 32  # score = INPUT_WEIGHT * input count + output count
MODES = ("hierarchical", "parallel", "single")


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


class _Node:
    __slots__ = ("children", "out", "inp")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.out = 0  # output count (shared)
        self.inp: dict[Hashable, int] | None = None  # {req: input count}, None if empty


def _as_ints(tokens: Iterable[int]) -> list[int]:
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False).ravel().tolist()
    return [int(t) for t in tokens]


class NgramTrie:
    """Token n-gram trie with per-request input counts and shared output counts.

    Args:
      branch_length: windows of ``branch_length + 1`` tokens are stored; drafts are at
        most ``branch_length`` deep.
      max_nodes: bound on the number of nodes, and on the number of input counters.
      max_output_nodes: bound on the number of nodes with an output count > 0.
      input_weight: score weight of an input count against an output count.
    """

    def __init__(
        self,
        branch_length: int = 12,
        max_nodes: int = 1 << 18,
        max_output_nodes: int = 1 << 17,
        input_weight: int = INPUT_WEIGHT,
    ) -> None:
        if branch_length < 1:
            raise ValueError(f"branch_length must be >= 1, got {branch_length}")
        if max_nodes < 1 or max_output_nodes < 0:
            raise ValueError(
                f"need max_nodes >= 1 and max_output_nodes >= 0, got {max_nodes}, "
                f"{max_output_nodes}"
            )
        self.branch_length = branch_length
        self.window = branch_length + 1  # W
        self.max_nodes = max_nodes
        self.max_output_nodes = max_output_nodes
        self.input_weight = input_weight
        self._root: dict[int, _Node] = {}
        self._n_nodes = 0
        self._n_out = 0  # nodes with out > 0
        self._n_inp = 0  # input counters, summed over nodes and requests
        self._full = False  # input counts fill max_nodes: stop squeezing until freed
        # Per request: every input counter it owns as (parent's children, token, node),
        # in creation order (parent before child), so end_request needs no traversal.
        self._trails: dict[Hashable, list[tuple[dict[int, _Node], int, _Node]]] = {}
        self._tails: dict[Hashable, list[int]] = {}  # per request: last W-1 output tokens

    # ------------------------------------------------------------------ sizes

    @property
    def num_nodes(self) -> int:
        return self._n_nodes

    @property
    def num_output_nodes(self) -> int:
        """Nodes whose output count is > 0."""
        return self._n_out

    @property
    def num_input_counters(self) -> int:
        """(node, request) input counters over all live requests."""
        return self._n_inp

    def __len__(self) -> int:
        return self._n_nodes

    def counts(self, path: Sequence[int], req: Hashable = 0) -> tuple[int, int] | None:
        """(input count of ``req``, output count) of the node at ``path`` from the root,
        or None if there is no such node."""
        children, node = self._root, None
        for t in _as_ints(path):
            node = children.get(t)
            if node is None:
                return None
            children = node.children
        if node is None:
            return None
        return (node.inp.get(req, 0) if node.inp else 0), node.out

    # ---------------------------------------------------------------- inserts

    def insert_input(self, tokens: Sequence[int], req: Hashable = 0) -> None:
        """Add a finished sequence (prompt or reference document) to ``req``'s input counts.

        Each call is a separate sequence: no window spans two calls.
        """
        seq = _as_ints(tokens)
        n, w = len(seq), self.window
        trail = self._trails.setdefault(req, [])
        for i in range(n - 1):
            self._reserve(min(w, n - i))
            self._put_input(seq, i, min(i + w, n), req, trail)
        if not trail:
            del self._trails[req]

    def insert_output(self, tokens: Sequence[int], req: Hashable = 0) -> None:
        """Stream newly accepted tokens of ``req`` into the shared output counts.

        Every window that ends at a new token grows by that token at once (module
        docstring, "Streaming output").
        """
        tail = self._tails.get(req, [])
        buf = tail + _as_ints(tokens)
        w = self.window
        for p in range(len(tail), len(buf)):
            for s in range(max(0, p - w + 1), p - 1):  # windows of >= 3 tokens grow by one
                self._grow_output_window(buf, s, p)
            if p >= 1:  # a new two-token window
                self._put_output_window(buf, p - 1, p + 1)
        self._tails[req] = buf[max(0, len(buf) - w + 1):]

    def restart_output(self, req: Hashable = 0) -> None:
        """Forget ``req``'s output tail: the next output tokens start new windows (after a
        rollback, the tail no longer precedes them). Counted n-grams stay."""
        self._tails.pop(req, None)

    def end_request(self, req: Hashable = 0) -> None:
        """Finish ``req``: drop its output tail, then remove its input counts (dropping
        nodes left with no count)."""
        self._tails.pop(req, None)
        trail = self._trails.pop(req, None)
        if not trail:
            return
        # Children were counted after their parents, so walking backwards removes each
        # countless node after its (countless) children: no subtree walk needed.
        for children, t, node in reversed(trail):
            inp = node.inp
            del inp[req]
            self._n_inp -= 1
            if not inp:
                node.inp = None
                if node.out == 0:
                    del children[t]
                    self._n_nodes -= 1
                    self._full = False

    def squeeze(self) -> None:
        """One squeeze pass (module docstring). Runs by itself when over budget."""
        self._squeeze_level(self._root)
        self._full = False

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
        """Draft continuing ``context`` (its last token is the root).

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
        suffix = _as_ints(context[len(context) - kmax:])
        w, root = self.input_weight, self._root
        for k in range(kmax, 0, -1):
            node, children = None, root
            for t in suffix[kmax - k:]:
                node = children.get(t)
                if node is None or not (node.out or (node.inp and node.inp.get(req))):
                    node = None
                    break
                children = node.children
            if node is not None and any(
                c.out or (c.inp and c.inp.get(req)) for c in children.values()
            ):
                break
        else:
            return TrieDraft([], [])
        counts = [c.out + (c.inp.get(req, 0) if c.inp else 0) for c in children.values()]
        counts = [c for c in counts if c]
        dominance = 2 if len(counts) == 1 else int(2 * max(counts) >= sum(counts))
        max_depth = min(depth_cap, self.window - k)
        if mode == "single":
            tokens, parents = self._single(node, decoding_length, max_depth, req, w)
        else:
            tokens, parents = self._hierarchical(node, decoding_length, max_depth, req, w)
            if mode == "parallel":
                tokens, parents = _parallel(tokens, parents, decoding_length)
        return TrieDraft(tokens, parents, match_len=k, dominance=dominance)

    # -------------------------------------------------------------- internals

    def _kids(self, node: _Node, req: Hashable, w: int, limit: int) -> list:
        """Visible children of ``node`` as [(-score, token, child)], best first."""
        kids = []
        for t, c in node.children.items():
            inp = c.inp
            s = c.out if inp is None else w * inp.get(req, 0) + c.out
            if s:
                kids.append((-s, t, c))
        if len(kids) > limit:
            return heapq.nsmallest(limit, kids)  # (-score, token) is unique: no node compare
        kids.sort()
        return kids

    def _hierarchical(self, start: _Node, budget: int, max_depth: int, req: Hashable, w: int):
        """Best-first: the heap holds, per expanded node, its best not-yet-taken child;
        taking a child pushes its next sibling and its own best child."""
        tokens: list[int] = []
        parents: list[int] = []
        kids = self._kids(start, req, w, budget)
        if not kids:
            return tokens, parents
        # heap entry: (-score, token, parent index, sibling index, siblings, depth)
        heap = [(kids[0][0], kids[0][1], -1, 0, kids, 1)]
        while heap and len(tokens) < budget:
            _, t, p, i, sibs, depth = heapq.heappop(heap)
            idx = len(tokens)
            tokens.append(t)
            parents.append(p)
            if i + 1 < len(sibs):
                s2, t2, _ = sibs[i + 1]
                heapq.heappush(heap, (s2, t2, p, i + 1, sibs, depth))
            if depth < max_depth:
                sub = self._kids(sibs[i][2], req, w, budget - len(tokens))
                if sub:
                    heapq.heappush(heap, (sub[0][0], sub[0][1], idx, 0, sub, depth + 1))
        return tokens, parents

    def _single(self, node: _Node, budget: int, max_depth: int, req: Hashable, w: int):
        tokens: list[int] = []
        for _ in range(min(budget, max_depth)):
            best = self._kids(node, req, w, 1)  # [(-score, token, child)] of the best child
            if not best:
                break
            _, t, node = best[0]
            tokens.append(t)
        return tokens, list(range(-1, len(tokens) - 1))

    def _reserve(self, n_new: int) -> None:
        """Squeeze ahead of a window that could add ``n_new`` nodes past ``max_nodes``."""
        if self._n_nodes + n_new <= self.max_nodes or self._full:
            return
        target = max(0, self.max_nodes - max(n_new, self.max_nodes // 8))
        while self._n_nodes > target and self._n_out > 0:
            self.squeeze()
        self._full = self._n_nodes + n_new > self.max_nodes

    def _put_input(self, seq: list[int], i: int, j: int, req: Hashable, trail: list) -> None:
        children = self._root
        for k in range(i, j):
            t = seq[k]
            node = children.get(t)
            inp = None if node is None else node.inp
            if inp is not None and req in inp:
                inp[req] += 1
            else:  # needs a new counter (and maybe a new node): cut the window if full
                if self._n_inp >= self.max_nodes:
                    return
                if node is None:
                    if self._n_nodes >= self.max_nodes:
                        return
                    node = children[t] = _Node()
                    self._n_nodes += 1
                if inp is None:
                    node.inp = {req: 1}
                else:
                    inp[req] = 1
                self._n_inp += 1
                trail.append((children, t, node))
            children = node.children

    def _put_output_window(self, seq: list[int], i: int, j: int) -> None:
        self._reserve(j - i)
        children = self._root
        for k in range(i, j):
            t = seq[k]
            node = children.get(t)
            if node is None:
                if self._n_nodes >= self.max_nodes:
                    break
                node = children[t] = _Node()
                self._n_nodes += 1
            if node.out == 0:
                self._n_out += 1
            node.out += 1
            children = node.children
        self._trim_output()

    def _grow_output_window(self, seq: list[int], i: int, p: int) -> None:
        """Add 1 to the node of seq[p] below the path seq[i:p] (counted earlier)."""
        self._reserve(1)  # may squeeze: before the walk, so the path below is current
        children, node = self._root, None
        for k in range(i, p):
            node = children.get(seq[k])
            if node is None or node.out == 0:  # evicted by a squeeze: stop growing
                return
            children = node.children
        child = children.get(seq[p])
        if child is None:
            if self._n_nodes >= self.max_nodes:
                return
            child = children[seq[p]] = _Node()
            self._n_nodes += 1
        if child.out == 0:
            self._n_out += 1
        child.out = min(child.out + 1, node.out)
        self._trim_output()

    def _trim_output(self) -> None:
        """Past ``max_output_nodes`` output nodes, squeeze until at most 7/8 of it remain."""
        if self._n_out > self.max_output_nodes:
            target = self.max_output_nodes - self.max_output_nodes // 8
            while self._n_out > target:
                self.squeeze()

    def _squeeze_level(self, children: dict[int, _Node]) -> None:
        for t, node in list(children.items()):
            out = node.out
            if out == 0:
                continue  # monotone: no output count below either
            if out == 1:
                node.out = 0
                self._n_out -= 1
                if node.inp is None:  # countless; its subtree too (all out <= 1, no inp)
                    del children[t]
                    self._drop(node)
                    continue
            else:
                node.out = out >> 1
            if node.children:
                self._squeeze_level(node.children)

    def _drop(self, node: _Node) -> None:
        """Uncount a detached node (its own out already zeroed) and its subtree."""
        stack = [node]
        self._n_nodes -= 1
        while stack:
            for c in stack.pop().children.values():
                self._n_nodes -= 1
                if c.out:
                    self._n_out -= 1
                stack.append(c)

    # ------------------------------------------------------------- debugging

    def check_invariants(self) -> None:
        """Recount everything and assert the documented invariants (for tests)."""
        n_nodes = n_out = n_inp = 0
        stack = [(c, 1) for c in self._root.values()]
        while stack:
            node, depth = stack.pop()
            n_nodes += 1
            n_out += node.out > 0
            assert depth <= self.window, "path deeper than a window"
            assert node.inp is None or (node.inp and all(v > 0 for v in node.inp.values()))
            n_inp += len(node.inp) if node.inp else 0
            assert node.out > 0 or node.inp, "node without any count"
            for c in node.children.values():
                assert c.out <= node.out, "output counts not monotone"
                for r, v in (c.inp or {}).items():
                    assert v <= (node.inp or {}).get(r, 0), "input counts not monotone"
                stack.append((c, depth + 1))
        assert (n_nodes, n_out, n_inp) == (self._n_nodes, self._n_out, self._n_inp)
        assert n_nodes <= self.max_nodes and n_inp <= self.max_nodes
        assert n_out <= self.max_output_nodes
        assert sum(len(tr) for tr in self._trails.values()) == n_inp
        for r, trail in self._trails.items():
            for children, t, node in trail:
                assert children.get(t) is node and r in node.inp
        assert all(len(tail) < self.window for tail in self._tails.values())


def _parallel(tokens: list[int], parents: list[int], budget: int):
    """Hierarchical draft -> independent chains, one per root-to-leaf path.

    # tokens [2, 3, 4, 5], parents [-1, 0, 1, 0]  (paths 2-3-4 and 2-5)
    #   -> tokens [2, 3, 4, 2, 5], parents [-1, 0, 1, -1, 3]
    """
    kids: list[list[int]] = [[] for _ in tokens]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else kids[p]).append(i)
    out_t: list[int] = []
    out_p: list[int] = []
    prev: list[int] = []  # previous emitted path (draft indices)
    stack = [[r] for r in reversed(roots)]
    while stack and len(out_t) < budget:
        path = stack.pop()
        if kids[path[-1]]:
            stack.extend(path + [c] for c in reversed(kids[path[-1]]))
            continue
        lcp = 0  # DFS order: the longest shared prefix is with the previous path
        while lcp < min(len(prev), len(path)) and prev[lcp] == path[lcp]:
            lcp += 1
        keep = min(len(path), budget - len(out_t))
        if keep <= lcp:
            break  # the cut path would only repeat a prefix already emitted
        for j in range(keep):
            out_p.append(-1 if j == 0 else len(out_t) - 1)
            out_t.append(tokens[path[j]])
        prev = path
    return out_t, out_p
