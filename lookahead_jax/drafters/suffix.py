"""Adaptive suffix drafter: the longest suffix match over the request and a cross-request cache.

At each step the drafter matches the longest suffix of the row's context (up to
`max_match` tokens, far more than the trie's 2) against

* the request's own tokens: its prompt, its references and its output so far, and
* a cache of earlier requests' outputs (`SuffixCache`, shared by the requests of a
  process; outputs only: a request never drafts from another request's prompt),

collects what followed every occurrence of that longest match, and grows a tree best-first
by path probability (the product of child count / parent count over the occurrences, as
SuffixDecoding scores its suffix trees), dropping nodes below `min_prob`. The tree is at
most `alpha * match length + offset` nodes (rounded up to the next of `buckets`, the
tree sizes the engine verifies, whose padding slots are paid for anyway): a long match (a
copy in progress) drafts deep, a weak one drafts little, so a miss costs little.

How much of the tree a step verifies is the budget's choice (`core/budget.py`): every
node carries its path probability (`Draft.accept_probs`) and the draft its match class
(`Draft.key`); under `decoding_length="auto"`, `AutoBudget` calibrates the probabilities
per class against what was really accepted and picks the prefix (tree bucket) with the
most expected tokens per unit of measured verify time for the whole batch, plain decoding
(no drafts) included. The statistics live with the drafter when given (`acceptance`, a
`budget.AcceptanceStats` shared by the requests of a process like the cache: the
strategy keeps one per settings on the engine, in its `SuffixStore`). `costs=` instead trims each draft here,
with the drafter's own calibration: for offline replay (bench/suffix_replay.py).

Data structure (chosen by host time per step, bench/suffix_replay.py; a numpy suffix match
took 2-8 ms a step): a flat token list per store with indexes n-gram (4, 2 and 1 tokens) ->
the positions that follow it; a match is found by its last 4 tokens (else 2, else 1) and
extended backwards from those positions, and the continuation tree is built by grouping
the occurrences' next tokens only at the nodes the best-first search expands. The cache
evicts its oldest outputs one at a time (their index entries are the oldest of their
keys), so no step pauses to rebuild an index.
Host module: pure Python (numpy only to save / load the cache), no jax.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque

import numpy as np

from ..core.drafts import EMPTY, Draft, DraftBatch

SEP = -1  # between the segments of a store: no match or continuation crosses it


class TokenStore:
    """A growing token list with indexes n-gram (n in `KEYS`) -> the positions that follow
    it (most recent last). `extend` appends; `segment()` starts a new segment;
    `evict_front(start, length)` drops the oldest segment (a FIFO cache's).

    Positions in the index are absolute (they survive eviction): `buf` holds the tokens
    from absolute position `base` on, of which the first `dead` are evicted; the dead
    prefix is cut once it is as long as the rest (amortized O(1) per token)."""

    KEYS = (4, 2, 1)  # a match is looked up by its last 4 tokens first, then 2, then 1

    def __init__(self, max_candidates: int = 64):
        self.buf: list = []  # tokens, SEP between segments
        self.base = 0  # absolute position of buf[0]
        self.dead = 0  # evicted tokens at the front of buf
        self.max_candidates = max_candidates
        self.index = {n: {} for n in self.KEYS}

    @property
    def n(self) -> int:
        """Tokens held (separators included, evicted ones not)."""
        return len(self.buf) - self.dead

    @property
    def end(self) -> int:
        """Absolute position of the next token."""
        return self.base + len(self.buf)

    def segment(self) -> None:
        if len(self.buf) > self.dead and self.buf[-1] != SEP:
            self.buf.append(SEP)

    def extend(self, tokens) -> None:
        buf, base = self.buf, self.base
        for t in tokens:
            buf.append(int(t))
            p = len(buf)  # position p follows buf[p - n:p]
            if buf[-1] == SEP:
                continue
            for n, index in self.index.items():
                if p - self.dead < n:
                    continue
                key = tuple(buf[p - n:p]) if n > 1 else buf[-1]
                if n > 1 and SEP in key:
                    continue
                index.setdefault(key, []).append(base + p)

    def evict_front(self, start: int, length: int) -> None:
        """Drop the oldest live segment: `length` tokens from absolute position `start`
        (the first live token): its index entries (the oldest of their keys), then the
        tokens themselves (the separator after them too)."""
        buf, base = self.buf, self.base
        if start != base + self.dead:
            raise ValueError(f"evict_front({start}, {length}): the oldest live segment starts at {base + self.dead}")
        for n, index in self.index.items():
            for p in range(start + n, start + length + 1):
                key = tuple(buf[p - n - base:p - base]) if n > 1 else buf[p - 1 - base]
                hits = index[key]
                assert hits[0] == p, (key, hits[0], p)  # FIFO: its entries are the oldest
                if len(hits) == 1:
                    del index[key]
                else:
                    del hits[0]
        self.dead = min(len(buf), start + length + 1 - base)
        if 2 * self.dead >= len(buf):
            del buf[:self.dead]
            self.base += self.dead
            self.dead = 0

    def match(self, tail: list, backoff: bool = False):
        """Occurrences of suffixes of `tail`: [(match length, position in `buf` that
        follows it)] at the longest key length (`KEYS`) with any (the most recent
        `max_candidates`), and with `backoff` also those of the last token alone; [] if
        none."""
        buf, n_buf, m, base = self.buf, len(self.buf), len(tail), self.base
        found = []
        for n in self.KEYS:
            if m < n or (found and not (backoff and n == 1)):
                continue
            hits = self.index[n].get(tuple(tail[-n:]) if n > 1 else tail[-1])
            if not hits:
                continue
            seen = {p for _, p in found}
            for p in reversed(hits[-self.max_candidates - 1:]):
                p -= base
                if p >= n_buf or buf[p] == SEP or p in seen:  # no continuation (yet: the context's own end)
                    continue
                k = n
                while k < m and p - k - 1 >= self.dead and buf[p - k - 1] == tail[-k - 1]:
                    k += 1
                found.append((k, p))
        return found


class SuffixCache:
    """Earlier requests' outputs, shared by the requests of a process: a token store with
    FIFO eviction by requests: once it holds more than `max_tokens` tokens, the oldest
    outputs leave one by one until it fits again (`TokenStore.evict_front`: their index
    entries are removed, O(their length), no pause to rebuild). Memory: ~0.5 KB per token
    (the default 2^18 tokens, ~2,000 outputs of 128 tokens: ~120 MB), the token list up
    to twice the tokens held. An output enters when its request ends.

    `save(path)` / `SuffixCache.load(path)`: the outputs, oldest first (a .npz file), e.g.
    to warm a process from an earlier one's."""

    def __init__(self, max_tokens: int = 1 << 18):
        self.max_tokens = max_tokens
        self.outputs: deque = deque()
        self._starts: deque = deque()  # absolute start of each output in the store
        self.tokens = 0
        self.store = TokenStore()

    def add(self, output) -> None:
        output = [int(t) for t in output]
        if not output:
            return
        self.store.segment()
        self._starts.append(self.store.end)
        self.store.extend(output)
        self.outputs.append(output)
        self.tokens += len(output) + 1
        while self.tokens > self.max_tokens and len(self.outputs) > 1:
            old = self.outputs.popleft()
            self.store.evict_front(self._starts.popleft(), len(old))
            self.tokens -= len(old) + 1
        if self.tokens > self.max_tokens:  # one output longer than the cache: not kept
            self.store.evict_front(self._starts.popleft(), len(self.outputs.popleft()))
            self.tokens = 0

    def save(self, path) -> None:
        """The outputs, oldest first, and `max_tokens` into an .npz file at `path`."""
        lengths = np.array([len(o) for o in self.outputs], np.int64)
        flat = np.array([t for o in self.outputs for t in o], np.int64)
        with open(path, "wb") as f:
            np.savez(f, tokens=flat, lengths=lengths, max_tokens=np.int64(self.max_tokens))

    @classmethod
    def load(cls, path, max_tokens: int | None = None) -> "SuffixCache":
        """A cache holding the outputs saved at `path` (`save`), bounded by `max_tokens`
        (default: the saved bound; a smaller one keeps the newest outputs)."""
        with np.load(path) as z:
            flat, lengths = z["tokens"].tolist(), z["lengths"].tolist()
            cache = cls(int(z["max_tokens"]) if max_tokens is None else max_tokens)
        at = 0
        for n in lengths:
            cache.add(flat[at:at + n])
            at += n
        return cache


@dataclasses.dataclass
class SuffixStore:
    """What the suffix drafter keeps on an engine across requests (`engine.stores.of(SuffixStore)`,
    made on first use, kept as long as the engine): the cache of earlier outputs that
    `SuffixDrafter.shared` drafts from, and the acceptance statistics per drafter settings
    (strategies/lookahead.py's, for `decoding_length="auto"`)."""

    cache: SuffixCache = dataclasses.field(default_factory=SuffixCache)
    acceptance: dict = dataclasses.field(default_factory=dict)  # settings -> AcceptanceStats


class SuffixDrafter:
    """The drafter protocol (`drafters/base.py`) over per-request token stores and a shared
    `SuffixCache` (module docstring)."""

    def __init__(self, max_nodes: int = 32, max_match: int = 32, alpha: float = 4.0, offset: float = 4.0,
                 min_prob: float = 0.03, backoff: float = 0.3, cache: SuffixCache | None = None,
                 share_outputs: bool = True, costs: dict | None = None, buckets=None,
                 acceptance=None):
        self.max_nodes = max_nodes
        self.max_match = max_match
        self.alpha = alpha
        self.offset = offset
        self.min_prob = min_prob
        self.backoff = backoff
        self.costs = dict(sorted(costs.items())) if costs else None
        # tree sizes a draft is rounded up to (costs' sizes when trimming here)
        self.buckets = tuple(sorted(self.costs if self.costs else buckets or ()))
        # acceptance per match class for AutoBudget, kept across requests like the cache
        # (a budget.AcceptanceStats; None: the budget keeps its own for the call)
        self.acceptance = acceptance
        self.calibration: dict = {}  # match class -> [accepted, predicted] over past drafts
        self._last: dict = {}  # row -> (match class, predicted accepted) of its last draft
        self.cache = cache if cache is not None else SuffixCache()
        self.share_outputs = share_outputs
        self._rows: dict = {}  # row -> [store (None: rebuild), references, output tokens]

    @classmethod
    def shared(cls, engine, **kw) -> "SuffixDrafter":
        """A drafter over the engine's cache of earlier outputs (its `SuffixStore`, created on
        first use)."""
        return cls(cache=engine.stores.of(SuffixStore).cache, **kw)

    @property
    def defer_update(self) -> bool:
        """`update` appends the kept tokens to the row's store (a proposal one step before
        they are in it is still valid: the overlapped loop runs it during the next step's
        forward), except when trimming here: `calibration` pairs each draft with its outcome."""
        return not self.costs

    def begin(self, state, references=None, rows=None) -> None:
        self.end(rows)
        for row in range(state.batch) if rows is None else rows:
            refs = [list(r) for r in (references[row] if references else ()) if r]
            self._rows[row] = self._new_row(state.rows[row].prompt_ids, refs, list(state.rows[row].ids))

    def _new_row(self, prompt, refs, output):
        store = TokenStore()
        for x in [list(prompt)] + refs:
            store.segment()
            store.extend(x)
        store.segment()
        store.extend(output)
        return [store, refs, output]

    def propose(self, state, budget: int) -> DraftBatch:
        drafts = []
        for b, live in enumerate(state.active):
            if not live or b not in self._rows:
                drafts.append(EMPTY)
                continue
            if self._rows[b][0] is None:  # rolled back: rebuild from the state's prompt and output
                self._rows[b] = self._new_row(state.rows[b].prompt_ids, self._rows[b][1], list(state.rows[b].ids))
            drafts.append(self.propose_context(b, state.context(b), budget))
        return DraftBatch(tuple(drafts))

    def propose_context(self, row: int, context, budget: int) -> Draft:
        tail = [int(t) for t in context[-self.max_match:]]
        found = [(length, s.buf, p) for s in (self._rows[row][0], self.cache.store)
                 for length, p in s.match(tail, self.backoff > 0)]
        self._last.pop(row, None)
        if not found:
            return EMPTY
        best = max(f[0] for f in found)
        cap = int(self.alpha * best + self.offset)
        if self.buckets:  # a tree is verified padded to the next bucket: fill it
            cap = next((T for T in self.buckets if T >= cap), cap)
        cap = min(budget, self.max_nodes, cap)
        if cap <= 0:
            return EMPTY
        # occurrences of the longest match weigh 1, shorter ones backoff ** (tokens shorter),
        # matches of 8 tokens or more all alike
        top = min(best, 8)
        members = [(buf, p, self.backoff ** (top - min(length, 8))) for length, buf, p in found]
        members = [m for m in members if m[2] > 0]
        draft, q = self._grow(members, cap, best)
        if self.costs:  # trimmed here (the offline replay); in the engine AutoBudget sizes the tree
            draft, q = self._trim(draft, q)
            self._last[row] = (draft.key, sum(q))  # for `calibration`, which only `_trim` reads
        return draft

    def _trim(self, draft, q):
        """The prefix of the draft that maximises expected tokens per unit of verify time:
        (1 + r * sum of its path probabilities) / cost(tree bucket), r the ratio of accepted
        to predicted tokens measured on this match class so far (prior 1/2)."""
        acc, pred = self.calibration.get(draft.key, (0.0, 0.0))
        r = (acc + 1.0) / (pred + 2.0)
        best_n, best_v, total, i = 0, 1.0 / self.costs[0], 0.0, 0
        for T, c in self.costs.items():
            if T == 0:
                continue
            while i < min(T, len(q)):
                total += q[i]
                i += 1
            v = (1.0 + r * total) / c
            if v > best_v:
                best_n, best_v = i, v
            if i >= len(q):
                break
        return draft.truncated(best_n), q[:best_n]

    def _grow(self, members, cap: int, match: int) -> Draft:
        """Best-first by path probability over the occurrences `members` [(buffer, position
        of the next token, weight)]."""
        tokens, parents = [], []
        heap, tick = [], 0
        floor = self.min_prob

        def expand(node, prob, members):
            nonlocal tick
            groups, total = {}, 0.0
            for buf, p, w in members:
                total += w
                if p < len(buf):
                    t = buf[p]
                    if t != SEP:
                        g = groups.get(t)
                        if g is None:
                            groups[t] = g = [0.0, []]
                        g[0] += w
                        g[1].append((buf, p + 1, w))
            for t, (w, sub) in groups.items():
                q = prob * w / total
                if q >= floor:
                    tick += 1
                    heapq.heappush(heap, (-q, tick, node, t, sub))

        expand(-1, 1.0, members)
        probs = []
        while heap and len(tokens) < cap:
            negq, _, parent, t, sub = heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            probs.append(-negq)
            expand(len(tokens) - 1, -negq, sub)
        return Draft(tokens, parents, key=("suffix", min(match, 16)), accept_probs=tuple(probs)), probs

    def update(self, state, step) -> None:
        for b, kept in enumerate(step.kept):
            last = self._last.pop(b, None)
            if last is not None and kept:  # calibrate: tokens accepted vs predicted, per match class
                c = self.calibration.setdefault(last[0], [0.0, 0.0])
                c[0] += len(kept) - 1
                c[1] += last[1]
            if kept and b in self._rows and self._rows[b][0] is not None:
                self._rows[b][0].extend(kept)
                self._rows[b][2].extend(int(t) for t in kept)

    def rollback(self, rows, length) -> None:
        """The row's output is cut back, or its prompt replaced (`decode.replace_prompt`,
        e.g. RaLM's new passage): its store is rebuilt at the next propose from the state's
        prompt and output then (and the request's references), so it drafts from the
        prompt in effect."""
        for b in rows:
            if b in self._rows:
                self._rows[b][0] = None

    def end(self, rows=None) -> None:
        for row in list(self._rows) if rows is None else [r for r in rows if r in self._rows]:
            _, _, output = self._rows.pop(row)
            if self.share_outputs:
                self.cache.add(output)

    def summary(self) -> dict:
        return {}
