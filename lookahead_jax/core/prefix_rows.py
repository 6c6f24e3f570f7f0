"""A `Slots`'s side of the prefix cache (`core.prefix_cache`, whose docstring has the
algorithm): at insert the cached leading blocks of each prompt are written into its row
(`fill`), after each non-last prefill block the unit it committed is copied out and stored
(`save`), through the two device programs of `core.kv_blocks`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .kv_blocks import block_bytes, copy_out, prefetch, write_in
from .prefix_cache import PrefixCache, chain_keys


class PrefixRows:
    """A `Slots`'s use of its engine's `PrefixCache` (module docstring): `fill` rows at
    insert, `save` the unit each non-last prefill block commits, `done` when a row's
    prefill ends or it is freed. chunk: the slots' prefill_chunk C (units of C - 1)."""

    def __init__(self, engine, state, chunk: int, capacity: int):
        self.engine, self.unit = engine, int(chunk) - 1
        self.cache: PrefixCache = engine.stores.of(PrefixCache)
        self.cache.resize(capacity)
        mode = state.step_mode(0, options=False, emit=False, prompt_logprobs=False, top_logprobs=0)
        self.salt = repr((state.batch, state.max_len, state.block, int(chunk), mode,
                          str(np.dtype(engine.dtype)))).encode()
        self.nbytes = block_bytes(engine.config, self.unit, engine.dtype)
        self._keys: dict = {}  # row -> its prompt's unit digests, while it prefills

    def units(self, n_tokens: int) -> int:
        """Units of a prompt of n_tokens that may come from the cache: its blocks but the
        last, floor((n - 2) / U) (the last block, >= 2 tokens, is always forwarded)."""
        return max(0, (int(n_tokens) - 2) // self.unit)

    def fill(self, state, rows: Sequence[int]) -> dict:
        """Write each row's cached prefix into it and set its length past it (rows just
        inserted, length 0, before their first block). Returns row -> units taken."""
        self.cache.bind(self.engine.params)
        taken = {}
        for s in rows:
            r = state.rows[s]
            if r.prompt_logprobs is not None:  # it needs every prompt token's forward
                continue
            n = self.take(state, s, r.prompt_ids, self.units(len(r.prompt_ids)))
            if n:
                taken[s] = n
        self.set_lengths(state, taken)
        return taken

    def take(self, state, s: int, ids: Sequence[int], units: int, count: bool = True) -> int:
        """Row s (length 0) will commit the first `units` units of `ids`: their digests are
        kept for `save`, and the cached ones of its longest leading run are written into
        the row (count=False: a warm job's lookup, not in the counters). Returns how many;
        the caller sets the row's length (`set_lengths`)."""
        keys = self._keys[s] = chain_keys(ids, self.unit, units, self.salt)
        hit = self.cache.match(keys, len(ids), self.unit, count=count)
        for i, kv in enumerate(hit):
            state.cache = write_in(self.engine, state.cache, kv, s, i * self.unit)
        return len(hit)

    def set_lengths(self, state, taken: dict) -> None:
        """Rows' lengths (host and cache) past the units they took (row -> units)."""
        if not taken:
            return
        idx = np.asarray(list(taken), np.int64)
        n = np.asarray([taken[s] * self.unit for s in taken], np.int32)
        lengths = state.lengths.copy()
        lengths[idx] = n
        state.lengths = lengths
        state.cache = state.cache.replace(length=state.cache.length.at[idx].set(n))

    def save(self, state, rows: Sequence[int], before: np.ndarray) -> int:
        """After a non-last prefill block over `rows` (their lengths were `before`): the
        unit each committed, copied out of its row and stored (unless held already).
        Returns the number of units stored."""
        U, stored = self.unit, 0
        for s in rows:
            keys, start = self._keys.get(s), int(before[s])
            i = start // U
            if keys is None or start % U or i >= len(keys) or int(state.lengths[s]) != start + U:
                continue
            if keys[i] in self.cache:
                self.cache.touch(keys[:i + 1])
                continue
            stored += self.cache.put(keys[:i + 1], copy_out(self.engine, state.cache, s, start, U), self.nbytes)
        return stored

    def held(self, s: int, start: int) -> bool:
        """Whether every unit of row s's keys from slot `start` on is cached already."""
        keys = self._keys.get(s)
        return keys is not None and all(k in self.cache for k in keys[int(start) // self.unit:])

    def done(self, rows: Sequence[int]) -> None:
        for s in rows:
            self._keys.pop(s, None)

    def warm_up(self, state) -> None:
        """Queue both block programs' compilation in the background (`kv_blocks.prefetch`)."""
        prefetch(self.engine, state.cache, self.unit)
