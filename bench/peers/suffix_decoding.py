"""SuffixDecoding's own drafter (arctic-inference 0.3.0) behind our drafter protocol, for the bench only.

`SuffixDecodingDrafter` drives arctic-inference's `SuffixDecodingCache` (its C++ suffix
trees, built by bench/peers/build_suffix_decoding.sh into /tmp/suffix-decoding-peer) as
its simulator does, so our engine verifies its trees exactly as it verifies ours:

    begin   start_request(prompt + the references concatenated) (as
            bench/suffix_replay.py's adapter: the passage is the prompt's own context), then
            add_active_response(the first generated token)
    propose speculate(context = prompt + generated ids, max_spec_tokens = min(budget,
            depth)): its best-first tree (`parents` -1 for a child of the root, topological,
            as our `Draft`)
    update  add_active_response(the tokens the step kept)
    end     stop_request; the response stays in its global cache (FIFO, unbounded here:
            max_cached_requests=-1), shared by the requests of a set like our SuffixCache.

Rollback: a plain lookahead call never rolls back, but `core.decode.rollback` /
`replace_prompt` (RaLM, kNN-LM) do, and may change the prompt. The cache cannot cut a
response, so a rolled-back row is restarted at its next propose from the state: its cached
response evicted (start_request on the same id does it), the request started again with the
state's prompt (+ references) and its kept ids added.

decoding_length: `DECODING_LENGTH` = 63 nodes (tree buckets up to 1 + 63 = 64 query rows;
the engine pads each tree to the next bucket). The drafter asks the peer for at most
min(budget, 63) nodes (`max_spec_tokens`), so the engine never truncates a tree it returns.
The peer's own cap is min(max_spec_tokens, max_spec_factor x match length + offset), its
simulator's max_spec_tokens the depth 64, and a match is shorter than the context it
searches, which `speculate` cuts to the depth: at most 63 tokens. Under the defaults
(factor 1, offset 0) a tree is thus at most 63 nodes: 63 never cuts it. Under
'aggressive' (factor 4, offset 4) its simulator allows 64 from a match of 15 tokens on: our
tree is then at most one node smaller; `summary()` counts such drafts
(`suffixdecoding_capped`: full at our cap while the peer's own cap was larger).
(bench/suffix_replay.py replays it with the same budget, 63.)

Never imported by the library: `load_cache_class(peer_dir)` puts the built module on
sys.path.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

from lookahead_jax.core.drafts import EMPTY, Draft, DraftBatch

PEER_DIR = "/tmp/suffix-decoding-peer"
DECODING_LENGTH = 63
# its simulator's defaults, and a setting that drafts more
SETTINGS = {
    "defaults": dict(depth=64, factor=1.0, offset=0.0, min_prob=0.1, tree=True),
    "aggressive": dict(depth=64, factor=4.0, offset=4.0, min_prob=0.01, tree=True),
}

_REQUEST_IDS = itertools.count()  # unique over every cache of the process


def load_cache_class(peer_dir: str = PEER_DIR):
    """arctic_inference's SuffixDecodingCache from `peer_dir` (a clear error if not built)."""
    if peer_dir not in sys.path and Path(peer_dir).is_dir():
        sys.path.insert(0, peer_dir)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SystemExit(f"SuffixDecoding peer not available from {peer_dir} ({e}); "
                         f"run bash bench/peers/build_suffix_decoding.sh {peer_dir}") from e
    return SuffixDecodingCache


def new_cache(cache_cls, depth: int = 64):
    """A SuffixDecodingCache with its global cache of responses on and unbounded."""
    return cache_cls(max_tree_depth=depth, max_cached_requests=-1)


class SuffixDecodingDrafter:
    """The drafter protocol (lookahead_jax/drafters/base.py) over a `SuffixDecodingCache`
    (module docstring). `cache`: shared by the drafters of a prompt set (its global tree of
    earlier responses); settings as `SETTINGS`."""

    def __init__(self, cache, depth: int = 64, factor: float = 1.0, offset: float = 0.0, min_prob: float = 0.1,
                 tree: bool = True, max_nodes: int = DECODING_LENGTH):
        self.cache = cache
        self.depth = depth
        self.kw = dict(max_spec_factor=factor, max_spec_offset=offset, min_token_prob=min_prob, use_tree_spec=tree)
        self.max_nodes = max_nodes
        self.restarts = 0
        self.capped = 0  # drafts full at our cap while the peer's own was larger (module docstring)
        self._rows: dict = {}  # row -> [request id, references (token lists), rolled back?]

    def _start(self, req, prompt, refs, response) -> None:
        inputs = list(prompt)
        for r in refs:
            inputs += list(r)
        self.cache.start_request(req, np.asarray(inputs, np.int32))
        if len(response):
            self.cache.add_active_response(req, np.asarray(response, np.int32))

    def begin(self, state, references=None, rows=None) -> None:
        self.end(rows)
        for row in range(state.batch) if rows is None else rows:
            refs = [list(r) for r in (references[row] if references else ()) if r]
            req = next(_REQUEST_IDS)
            self._start(req, state.rows[row].prompt_ids, refs, state.rows[row].ids)
            self._rows[row] = [req, refs, False]

    def propose(self, state, budget: int) -> DraftBatch:
        drafts = []
        for b, live in enumerate(state.active):
            r = self._rows.get(b)
            n = min(budget, self.max_nodes, self.depth)
            if not live or r is None or n <= 0:
                drafts.append(EMPTY)
                continue
            if r[2]:  # rolled back: restart the request from the state's prompt and ids
                self.cache.stop_request(r[0])
                self._start(r[0], state.rows[b].prompt_ids, r[1], state.rows[b].ids)
                r[2] = False
                self.restarts += 1
            ctx = state.context(b)[-self.depth:]  # speculate matches at most `depth` tokens
            d = self.cache.speculate(r[0], np.asarray(ctx, np.int32), max_spec_tokens=n, **self.kw)
            own = min(self.depth, int(d.match_len * self.kw["max_spec_factor"] + self.kw["max_spec_offset"] + 1e-6))
            self.capped += len(d.token_ids) == n < own
            drafts.append(Draft([int(t) for t in d.token_ids], [int(p) for p in d.parents]) if d.token_ids else EMPTY)
        return DraftBatch(tuple(drafts))

    def update(self, state, step) -> None:
        for b, kept in enumerate(step.kept):
            r = self._rows.get(b)
            if kept and r is not None and not r[2]:
                self.cache.add_active_response(r[0], np.asarray([int(t) for t in kept], np.int32))

    def rollback(self, rows, length) -> None:
        """Mark the rows for a restart from the state at their next propose (module docstring)."""
        for b in rows:
            if b in self._rows:
                self._rows[b][2] = True

    def end(self, rows=None) -> None:
        for row in list(self._rows) if rows is None else [r for r in rows if r in self._rows]:
            req, _, rolled_back = self._rows.pop(row)
            self.cache.stop_request(req)
            if rolled_back and req in self.cache.cached_requests:
                # ended before the restart: its cached response runs past the rollback
                self.cache.evict_cached_response(req)

    def summary(self) -> dict:
        return dict(suffixdecoding_capped=self.capped, suffixdecoding_restarts=self.restarts)
