"""The storage of the host-side token n-gram trie (pure Python, no jax): its nodes and their
counts, inserts (input, streaming output), capacity and squeeze. `ngram_trie.NgramTrie`
(this module's `NgramCounts` plus retrieval: the drafts) is the class to use; its module
docstring holds "Retrieval".

Storage
-------
Every window of W = branch_length + 1 consecutive tokens of an inserted sequence is a
path from a virtual root: the window's first token is a root child, its last token sits
at depth W. Windows that start near the end of a finished sequence are shorter; a window
of one token has no continuation and is skipped.

    # tokens [5, 6, 7, 8], branch_length=2 (W=3) -> windows [5,6,7], [6,7,8], [7,8]

Each node holds counts of three kinds, in two places:

* own counts, one counter per request id (``{req: count}``), visible only to that request:
  its *input* (its prompt and reference documents, e.g. retrieved passages) and its *own
  output* (the tokens it generated). Another request never sees them, so batch rows do
  not interfere; ``end_request(req)`` removes them. One counter holds both tiers
  (``input << 32 | own output``), so a node costs one counter per request that saw it.
* ``out``: output count, shared by every request: every request's generated tokens (a
  request's own output included), so the trie warms up across requests.

Inserting a window adds 1 to each count of its kind along its path, so counts are
monotone: ``count(child) <= count(parent)`` for ``out`` and for each request's input and
own output. A node left with no count at all is removed; monotonicity guarantees its
subtree is countless too, so nothing counted is ever orphaned.

Streaming output
----------------
Output windows are built up token by token, so a request's own recent n-grams can be
drafted at once (a model repeating a phrase is caught on its second occurrence, not W
tokens later). ``insert_output`` keeps a per-request tail of the last W-1 tokens; each new
token p extends every window that starts in the tail (start s, p - s < W) by one node,
adding 1 to that node only (the earlier nodes of the window were counted when it was
shorter); a window of two tokens counts both. Streaming a sequence in any chunks therefore
counts exactly the windows of the whole sequence, each once, in the shared output and in
the request's own output, and ``end_request`` drops the tail with the own counts. The node
ending each growing window is kept, so growing costs one lookup (a squeeze may detach
nodes: after one, the window's path is walked again).

    # W=3   insert_output([5, 6]) -> [5,6]                 tail [5, 6]
    #       insert_output([7])    -> [5,6,7] (7 added), [6,7]         tail [6, 7]
    #       insert_output([8])    -> [6,7,8] (8 added), [7,8]         tail [7, 8]

Should a squeeze evict part of a window that is still growing, its shared output stops
growing (own counts are never squeezed), and a grown node's count of each kind is capped by
its parent's, which keeps counts monotone.

Capacity and squeeze
--------------------
``max_nodes`` bounds the number of nodes and, separately, the number of own counters
(node, request) pairs (input and own output alike); ``max_output_nodes`` bounds the nodes
whose shared output count is > 0. Both hold after every public call, whatever the number
of requests; a request's own counters leave with ``end_request``.

One squeeze pass (PIA's rule) visits every node with an output count:
``out <= 1 -> out = 0`` and ``out >= 2 -> out // 2`` (so it stays >= 1). A node then left
with no count at all is dropped with its subtree; a node that still holds own counts of a
live request is kept with its output count zeroed. Own counts are never squeezed.

* After each output window, if the output nodes exceed ``max_output_nodes``, passes
  repeat until at most 7/8 of it remain (the low-water mark amortises the O(nodes) pass
  over at least budget/8 later insertions).
* Before each window, if it might not fit under ``max_nodes``, passes repeat until the
  nodes are at most ``max_nodes - max(W, max_nodes // 8)`` or no output count is left.
  If own counts alone fill the budget, the trie is "full": windows are cut where a new
  node or counter would be needed, until ``end_request`` or a squeeze frees nodes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

INPUT_WEIGHT = 1 << 32  # own score = INPUT_WEIGHT * input count + own output count
ONE_INPUT = 1 << 32  # one input count in an own counter (input << 32 | own output)
OWN_OUT = ONE_INPUT - 1  # mask of the own output count


class Node:
    __slots__ = ("children", "out", "own")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.out = 0  # output count (shared)
        self.own: dict[Hashable, int] | None = None  # {req: input << 32 | own output} or None


def as_ints(tokens: Iterable[int]) -> list[int]:
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False).ravel().tolist()
    return [int(t) for t in tokens]


class NgramCounts:
    """The n-gram trie's storage (module docstring): nodes with per-request own counts
    (input, own output) and shared output counts, inserts, capacity and squeeze. The base
    of `ngram_trie.NgramTrie` (which documents the arguments and adds retrieval)."""

    def __init__(
        self,
        branch_length: int = 12,
        max_nodes: int = 1 << 18,
        max_output_nodes: int = 1 << 17,
        input_weight: int = INPUT_WEIGHT,
    ) -> None:
        if branch_length < 1:
            raise ValueError(f"branch_length must be >= 1, got {branch_length}")
        if max_nodes < 1 or max_output_nodes < 0 or input_weight < 1:
            raise ValueError(f"need max_nodes >= 1, max_output_nodes >= 0, input_weight >= 1, got "
                             f"{max_nodes}, {max_output_nodes}, {input_weight}")
        self.branch_length = branch_length
        self.window = branch_length + 1  # W
        self.max_nodes = max_nodes
        self.max_output_nodes = max_output_nodes
        self.input_weight = input_weight
        self._root: dict[int, Node] = {}
        self._n_nodes = 0
        self._n_out = 0  # nodes with out > 0
        self._n_own = 0  # own counters, summed over nodes and requests
        self._full = False  # own counts fill max_nodes: stop squeezing until freed
        # Per request: each own counter it holds as 3 items, parent's children, token, node
        # (flat: no tuple for the gc), parent before child: end_request walks it backwards.
        self._trails: dict[Hashable, list] = {}
        self._tails: dict[Hashable, list[int]] = {}  # per request: last W-1 output tokens
        # Per request, aligned with its tail: (node, epoch) ending the window that starts
        # there (None: stopped, or no window yet), valid if no squeeze ran since epoch.
        self._ends: dict[Hashable, list] = {}
        self._epoch = 0  # squeeze passes so far

    # ------------------------------------------------------------------ sizes

    @property
    def num_nodes(self) -> int:
        return self._n_nodes

    @property
    def num_output_nodes(self) -> int:
        """Nodes whose shared output count is > 0."""
        return self._n_out

    @property
    def num_own_counters(self) -> int:
        """(node, request) own counters (input and own output) over all live requests."""
        return self._n_own

    def _node(self, path: Sequence[int]) -> Node | None:
        children, node = self._root, None
        for t in as_ints(path):
            node = children.get(t)
            if node is None:
                return None
            children = node.children
        return node

    def counts(self, path: Sequence[int], req: Hashable = 0) -> tuple[int, int] | None:
        """(input count of ``req``, shared output count) of the node at ``path`` from the
        root, or None if there is no such node."""
        node = self._node(path)
        return None if node is None else ((node.own.get(req, 0) >> 32 if node.own else 0), node.out)

    def own_counts(self, path: Sequence[int], req: Hashable = 0) -> tuple[int, int] | None:
        """(input count, own output count) of ``req`` at ``path``, or None without a node."""
        node = self._node(path)
        v = node.own.get(req, 0) if node is not None and node.own else 0
        return None if node is None else (v >> 32, v & OWN_OUT)

    # ---------------------------------------------------------------- inserts

    def insert_input(self, tokens: Sequence[int], req: Hashable = 0) -> None:
        """Add a finished sequence (prompt or reference document) to ``req``'s input counts.

        Each call is a separate sequence: no window spans two calls.
        """
        seq = as_ints(tokens)
        n, w = len(seq), self.window
        trail = self._trails.setdefault(req, [])
        for i in range(n - 1):
            self._reserve(min(w, n - i))
            self._put_input(seq, i, min(i + w, n), req, trail)
        if not trail:
            del self._trails[req]

    def insert_output(self, tokens: Sequence[int], req: Hashable = 0) -> None:
        """Stream newly accepted tokens of ``req`` into the shared output counts and into
        ``req``'s own output counts.

        Every window that ends at a new token grows by that token at once (module
        docstring, "Streaming output").
        """
        tail = self._tails.get(req, [])
        buf = tail + as_ints(tokens)
        ends = self._ends.get(req, []) + [None] * (len(buf) - len(tail))
        w = self.window
        trail = self._trails.setdefault(req, [])
        for p in range(len(tail), len(buf)):
            for s in range(max(0, p - w + 1), p - 1):  # windows of >= 3 tokens grow by one
                if ends[s] is not None:
                    ends[s] = self._grow_output_window(buf, s, p, ends[s], req, trail)
            if p >= 1:  # a new two-token window
                ends[p - 1] = self._put_output_window(buf, p - 1, p + 1, req, trail)
        keep = max(0, len(buf) - w + 1)
        self._tails[req], self._ends[req] = buf[keep:], ends[keep:]
        if not trail:
            del self._trails[req]

    def restart_output(self, req: Hashable = 0) -> None:
        """Forget ``req``'s output tail: the next output tokens start new windows (after a
        rollback, the tail no longer precedes them). Counted n-grams stay."""
        self._tails.pop(req, None)
        self._ends.pop(req, None)

    def end_request(self, req: Hashable = 0) -> None:
        """Finish ``req``: drop its output tail, then remove its own counts (input and own
        output), dropping nodes left with no count. Its share of the output counts stays."""
        self.restart_output(req)
        trail = self._trails.pop(req, None)
        if not trail:
            return
        # Children were counted after their parents, so walking backwards removes each
        # countless node after its (countless) children: no subtree walk needed.
        self._n_own -= len(trail) // 3
        for k in range(len(trail) - 3, -1, -3):
            children, t, node = trail[k:k + 3]
            own = node.own
            del own[req]
            if not own:
                node.own = None
                if node.out == 0:
                    del children[t]
                    self._n_nodes -= 1
                    self._full = False

    def squeeze(self) -> None:
        """One squeeze pass (module docstring). Runs by itself when over budget."""
        self._squeeze_level(self._root)
        self._full = False
        self._epoch += 1

    # -------------------------------------------------------------- internals

    def _reserve(self, n_new: int) -> None:
        """Squeeze ahead of a window that could add ``n_new`` nodes past ``max_nodes``."""
        if self._n_nodes + n_new <= self.max_nodes or self._full:
            return
        target = max(0, self.max_nodes - max(n_new, self.max_nodes // 8))
        while self._n_nodes > target and self._n_out > 0:
            self.squeeze()
        self._full = self._n_nodes + n_new > self.max_nodes

    def _count_own(self, children: dict, t: int, node: Node, req: Hashable, add: int,
                   trail: list) -> bool:
        """Add ``add`` to ``req``'s own counter at ``node``; False if that needs a new
        counter and the counter budget is spent."""
        own = node.own
        if own is not None and req in own:
            own[req] += add
            return True
        if self._n_own >= self.max_nodes:
            return False
        if own is None:
            own = node.own = {}
        own[req] = add
        self._n_own += 1
        trail += children, t, node
        return True

    def _new_node(self, children: dict, t: int, counted: bool = False) -> Node | None:
        """A new child ``t``, or None at the node bound (or counter bound, if ``counted``)."""
        if self._n_nodes >= self.max_nodes or (counted and self._n_own >= self.max_nodes):
            return None
        node = children[t] = Node()
        self._n_nodes += 1
        return node

    def _put_input(self, seq: list[int], i: int, j: int, req: Hashable, trail: list) -> None:
        children = self._root
        for k in range(i, j):
            t = seq[k]
            node = children.get(t)  # cut the window where the trie is full:
            if node is None and (node := self._new_node(children, t, counted=True)) is None:
                return
            if not self._count_own(children, t, node, req, ONE_INPUT, trail):
                return
            children = node.children

    def _put_output_window(self, seq: list[int], i: int, j: int, req: Hashable, trail: list):
        """Count the window seq[i:j]; its end as an ``_ends`` entry (None if cut)."""
        if self._n_nodes + j - i > self.max_nodes:
            self._reserve(j - i)
        children, own_ok = self._root, True
        for k in range(i, j):
            t = seq[k]
            node = children.get(t)
            if node is None and (node := self._new_node(children, t)) is None:
                self._trim_output()
                return None
            if node.out == 0:
                self._n_out += 1
            node.out += 1
            own_ok = own_ok and self._count_own(children, t, node, req, 1, trail)
            children = node.children
        end = (node, self._epoch)  # stamped before a squeeze may detach it
        if self._n_out > self.max_output_nodes:
            self._trim_output()
        return end

    def _grow_output_window(self, seq: list[int], i: int, p: int, end: tuple, req: Hashable,
                            trail: list):
        """Add 1 to the node of seq[p] below the path seq[i:p] (counted earlier, ending at
        ``end``), in the shared output if the path still has it and in ``req``'s own output
        if it has that. Returns the new end (None: the window stops growing). Hot: once per
        window and output token, so the common case makes no call."""
        if self._n_nodes >= self.max_nodes:
            self._reserve(1)  # may squeeze: before the walk, so the path below is current
        node, epoch = end
        if epoch != self._epoch:  # a squeeze ran since: walk the path again
            children, node = self._root, None
            for k in range(i, p):
                node = children.get(seq[k])
                if node is None:
                    return None
                children = node.children
        out, mine = node.out, node.own  # monotone: out > 0 here means > 0 along the path
        own = mine[req] & OWN_OUT if mine is not None and req in mine else 0
        if not (out or own):  # evicted by a squeeze, or cut: stop growing
            return None
        children, t = node.children, seq[p]
        child = children.get(t)  # a new one without output count needs a counter
        if child is None and (child := self._new_node(children, t, counted=not out)) is None:
            return None
        if out:
            if child.out == 0:
                self._n_out += 1
            child.out = min(child.out + 1, out)
        mine = child.own
        if own:
            if mine is not None and req in mine:
                if mine[req] & OWN_OUT < own:
                    mine[req] += 1
            elif self._count_own(children, t, child, req, 1, trail):
                mine = child.own
        # counted here (out, or req's own), so no other request's end_request drops it
        end = (child, self._epoch) if out or (mine is not None and req in mine) else None
        if self._n_out > self.max_output_nodes:
            self._trim_output()
        return end

    def _trim_output(self) -> None:
        """Past ``max_output_nodes`` output nodes, squeeze until at most 7/8 of it remain."""
        if self._n_out > self.max_output_nodes:
            target = self.max_output_nodes - self.max_output_nodes // 8
            while self._n_out > target:
                self.squeeze()

    def _squeeze_level(self, children: dict[int, Node]) -> None:
        for t, node in list(children.items()):
            out = node.out
            if out == 0:
                continue  # monotone: no output count below either
            if out == 1:
                node.out = 0
                self._n_out -= 1
                if node.own is None:  # countless; its subtree too (all out <= 1, no own)
                    del children[t]
                    self._drop(node)
                    continue
            else:
                node.out = out >> 1
            if node.children:
                self._squeeze_level(node.children)

    def _drop(self, node: Node) -> None:
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
        n_nodes = n_out = n_own = 0
        stack = [(c, 1) for c in self._root.values()]
        while stack:
            node, depth = stack.pop()
            n_nodes += 1
            n_out += node.out > 0
            assert depth <= self.window, "path deeper than a window"
            own = node.own or {}
            assert node.own is None or (own and all(v > 0 for v in own.values()))
            assert all(r in self._trails for r in own), "own counts of an ended request"
            n_own += len(own)
            assert node.out > 0 or own, "node without any count"
            for c in node.children.values():
                assert c.out <= node.out, "output counts not monotone"
                for r, v in (c.own or {}).items():  # input, own output: each monotone
                    u = own.get(r, 0)
                    assert v >> 32 <= u >> 32 and v & OWN_OUT <= u & OWN_OUT, "own not monotone"
                stack.append((c, depth + 1))
        assert (n_nodes, n_out, n_own) == (self._n_nodes, self._n_out, self._n_own)
        assert max(n_nodes, n_own) <= self.max_nodes and n_out <= self.max_output_nodes
        assert sum(len(tr) for tr in self._trails.values()) == 3 * n_own
        for r, trail in self._trails.items():
            assert trail, "an empty trail is kept"
            for children, t, node in zip(trail[::3], trail[1::3], trail[2::3]):
                assert children.get(t) is node and r in node.own
        for r, tail in self._tails.items():  # a current end is attached and counted for r
            assert len(tail) < self.window and len(self._ends[r]) == len(tail)
            for j, (node, epoch) in enumerate(e or (None, -1) for e in self._ends[r]):
                assert epoch != self._epoch or (
                    self._node(tail[j:]) is node and (node.out or r in (node.own or ())))

