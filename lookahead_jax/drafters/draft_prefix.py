"""The prefix cache of SpecInfer's draft model (`drafters.model.ModelDrafter`): the draft's
prompt K/V, kept in units keyed by tokens and shared across requests, so that a request
whose context begins with cached units has the draft forward only the rest.

Without chunked prefill the draft forwards a new row's context (its prompt, and whatever it
decoded before its first drafted step) in one bucketed block (`ModelDrafter._catch_up`).
With it (`Slots(prefill_chunk=C)`, the prefix cache on or off: the same programs either
way, so the cache changes no token, sampled ones included), a row whose draft cache is
empty forwards that context in the target's fixed blocks (`core.prefix_cache`): block i forwards
context[i*U : i*U + C] (U = C - 1) as one row of the chunk's bucket, commits its first U
tokens and leaves the last uncommitted (the next block, or the draft's tree step, forwards
it again); the attention window a function of i alone. So unit i (slots [i*U, (i+1)*U))
depends only on tokens [0, (i+1)*U) and is computed by the same program wherever it is
computed: a unit another request stored is bit for bit the K/V the row's own block would
write, and a row that takes h cached units and forwards the rest holds the draft K/V it
holds without taking them. A context of n tokens (the root, token n, is forwarded by the
tree step) has n // U units; each full block's unit is stored, the last (shorter) block's
tokens are not.

    U=3 (C=4), context t0..t7, root t8: blocks [t0 t1 t2 t3] [t3 t4 t5 t6] [t6 t7 t8]
    units: slots 0-2 (key t0..t2), 3-5 (key t0..t5); the last block commits t6 t7

The store is a `PrefixCache` of the draft engine (`DraftPrefixCache`, its own type: a
draft engine that is also the target's keeps the two apart), salted with the draft's
cache shape, block width and chunk; bound to the draft's params. Counters as the target's
(`PrefixCache.summary`, also in `ModelDrafter.summary` as draft_prefix_*).
"""

from __future__ import annotations

import numpy as np

from ..core.inputs import StepInputs, StepMode
from ..core.kv_blocks import block_bytes, copy_out, prefetch, write_in
from ..core.prefix_cache import PrefixCache, chain_keys


class DraftPrefixCache(PrefixCache):
    """The draft model's prefix cache (module docstring): one per draft engine
    (`engine.stores.of(DraftPrefixCache)`), apart from the target's `PrefixCache`."""


class DraftPrefix:
    """A `ModelDrafter`'s use of its engine's `DraftPrefixCache` (module docstring).
    batch, max_len: the draft cache's shape; block: the target's prefill block width
    (`DecodeState.block`); chunk: C; capacity: the cache's bytes (0: no cache, `cache`
    None: the blocks alone, the engine's store untouched)."""

    def __init__(self, engine, batch: int, max_len: int, block: int, chunk: int, capacity: int):
        self.engine, self.chunk, self.unit, self.block = engine, int(chunk), int(chunk) - 1, int(block)
        self.S = int(max_len)
        self.cache = engine.stores.of(DraftPrefixCache) if capacity else None
        if self.cache is not None:
            self.cache.resize(capacity)
        self.salt = repr(("draft", int(batch), self.S, self.block, self.chunk, str(np.dtype(engine.dtype)))).encode()
        self.nbytes = block_bytes(engine.config, self.unit, engine.dtype)
        self._prefetched = False

    def keys(self, context, n: int) -> list:
        """The digests of the units of context[:n] (n // U of them)."""
        return chain_keys(context, self.unit, int(n) // self.unit, self.salt)

    def steps(self, context, start: int, n: int, seeds, rowids, b: int) -> list:
        """The blocks that forward context[start:n] of row b (start a unit boundary), the
        root context[n] last: [(slot, StepInputs, StepMode)], each committing all its
        tokens but the last."""
        P, out, p = self.block, [], int(start)
        while p < n:
            take = min(self.chunk, n + 1 - p)
            tokens = np.zeros((1, P), np.int32)
            tokens[0, :take] = context[p:p + take]
            x = StepInputs(tokens, seeds, rowids, n_new=np.asarray([take], np.int32)).rows([b])
            window = self.engine.window(max(p + take, P), self.S, P)
            out.append((p, x, StepMode(window=window, emit=False)))
            p += take - 1
        return out

    def held(self, keys) -> int:
        """Units of the longest cached leading run of `keys` (a look-up in no counter)."""
        return 0 if self.cache is None else len(self.cache.match(keys, 0, self.unit, count=False))

    def catch_up(self, cache, context, n: int, b: int, seeds, rowids):
        """Row b of the draft `cache` (length 0) forwards context[:n] (module docstring):
        its cached units are written in, the rest forwarded in blocks, each full block's
        unit stored. Returns the cache (row b's length n)."""
        e, U = self.engine, self.unit
        keys, hit = self.keys(context, n), []
        if self.cache is not None:
            self.cache.bind(e.params)
            hit = self.cache.match(keys, n, U)
        for i, kv in enumerate(hit):
            cache = write_in(e, cache, kv, b, i * U)
        start = len(hit) * U
        cache = cache.replace(length=cache.length.at[b].set(start))
        for p, x, mode in self.steps(context, start, n, seeds, rowids, b):
            _, cache = e.extend(cache, x, mode)
            i = p // U
            if self.cache is not None and int(x.n_new[0]) == self.chunk:  # a full block: its unit i is stored
                if keys[i] in self.cache:
                    self.cache.touch(keys[:i + 1])
                else:
                    self.cache.put(keys[:i + 1], copy_out(e, cache, b, p, U), self.nbytes)
        return cache

    def ready(self, cache, context, n: int, b: int, seeds, rowids) -> bool:
        """Whether row b's blocks (after its cached units) are compiled; the missing ones are
        queued in the background (`Engine.extend(ahead=)`), as the copy / write programs
        are the first time."""
        e, ok = self.engine, True
        if not self._prefetched and self.cache is not None:
            prefetch(e, cache, self.unit)
            self._prefetched = True
        start = self.held(self.keys(context, n)) * self.unit
        seen = set()
        for _, x, mode in self.steps(context, start, n, seeds, rowids, b):
            if mode.window in seen:
                continue
            seen.add(mode.window)
            if not e.extend(cache, x, mode, ahead="check"):
                e.extend(cache, x, mode, ahead="compile")
                ok = False
        return ok
