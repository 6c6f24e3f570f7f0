"""A `Slots`'s side of the prefix cache (`core.prefix_cache`, whose docstring has the
algorithm): at insert the cached leading blocks of each prompt are written into its row
(`fill`), before each prefill block a row takes the units cached since and waits when an
earlier row of the same forward commits the very unit its block would (`ready`: rows of one
batch that share a header forward it once), after each non-last prefill block the unit it
committed is copied out and stored (`save`), through the two device programs of
`core.kv_blocks`. A retrieval run's rows too: their whole prompts (passage before the
question) are forwarded in the same blocks, and a re-prefill after a passage change
(`decode.replace_prompt`) takes the new context's cached units (`take`): a passage some row
had before, after the same head, comes from the cache."""

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
        self._hit: set = set()  # rows whose request has taken cached units

    def units(self, n_tokens: int) -> int:
        """Units of a prompt of n_tokens that may come from the cache: its blocks but the
        last, floor((n - 2) / U) (the last block, >= 2 tokens, is always forwarded)."""
        return max(0, (int(n_tokens) - 2) // self.unit)

    def fill(self, state, rows: Sequence[int]) -> dict:
        """Write each row's cached prefix into it and set its length past it (rows just
        inserted, length 0, before their first block). Returns row -> units taken, for
        rows that took some."""
        self.cache.bind(self.engine.params)
        for s in rows:
            if state.rows[s].prompt_logprobs is None:  # (else it needs every prompt token's forward)
                self._keys[s] = chain_keys(state.rows[s].prompt_ids, self.unit,
                                           self.units(len(state.rows[s].prompt_ids)), self.salt)
        return self._take(state, [s for s in rows if s in self._keys], again=False)

    def ready(self, state, rows: Sequence[int]) -> list:
        """Before a prefill block over `rows` (prefilling, oldest first): each takes the
        cached units that follow what it holds (blocks another row stored since it was
        filled), and a row whose next block would commit the very unit (same digest) that
        an earlier row's block commits in this forward waits for it, to take it from the
        cache before its next block: a header shared by the rows of one batch is forwarded
        once. Returns the rows to forward now (the first of `rows` always)."""
        self._take(state, [s for s in rows if self._next(state, s) is not None], again=True)
        now, computed = [], set()
        for s in rows:
            key = self._next(state, s)
            if key is not None and key in computed:
                continue
            computed.add(key)
            now.append(s)
        return now

    def _next(self, state, s: int):
        """The digest of the unit row s's next block commits (None: not a cached kind of
        block, e.g. its prompt's last)."""
        keys, n = self._keys.get(s), int(state.lengths[s])
        return None if keys is None or n % self.unit or n // self.unit >= len(keys) else keys[n // self.unit]

    def _take(self, state, rows: Sequence[int], again: bool) -> dict:
        """Each row's cached run of units from the one after what it holds (`PrefixCache.
        match`; again: a later look-up, not counted as one), written into it, its length
        set past them. Returns row -> the units it holds now, for rows that took some."""
        U, taken = self.unit, {}
        for s in rows:
            keys, start = self._keys[s], int(state.lengths[s]) // U
            hit = self.cache.match(keys, len(state.rows[s].prompt_ids), U, start, again, s in self._hit)
            for i, kv in enumerate(hit, start):
                state.cache = write_in(self.engine, state.cache, kv, s, i * U)
            if hit:
                taken[s] = start + len(hit)
                self._hit.add(s)
        self.set_lengths(state, taken)
        return taken

    def set_lengths(self, state, taken: dict) -> None:
        """Rows' lengths (host and cache) past the units they hold (row -> units)."""
        if not taken:
            return
        idx = np.asarray(list(taken), np.int64)
        n = np.asarray([taken[s] * self.unit for s in taken], np.int32)
        lengths = state.lengths.copy()
        lengths[idx] = n
        state.lengths = lengths
        state.cache = state.cache.replace(length=state.cache.length.at[idx].set(n))

    def warm_take(self, state, s: int, ids: Sequence[int], units: int) -> int:
        """A warm job's row s (length 0, `prefix_warm`) will commit the first `units` units
        of `ids`: their digests are kept for `save`, and the cached ones of its longest
        leading run are written into the row (a lookup in no counter). Returns how many;
        the caller sets the row's length (`set_lengths`)."""
        keys = self._keys[s] = chain_keys(ids, self.unit, units, self.salt)
        hit = self.cache.match(keys, len(ids), self.unit, count=False)
        for i, kv in enumerate(hit):
            state.cache = write_in(self.engine, state.cache, kv, s, i * self.unit)
        return len(hit)

    def take(self, state, b: int, kept: int) -> int:
        """Row b is re-prefilled to its new context (`decode.replace_prompt`, a retrieval
        run's passage change) keeping its first `kept` slots. With a cached unit at the
        unit boundary below `kept`, the row keeps up to that boundary and the context's
        cached run of units from there is written into it; without one, it goes down to
        the boundary only where that costs no extra block (the blocks forwarded from a
        boundary are those a prompt's own prefill runs: what they commit is a unit `save`
        can store, for the next row with this context), else it keeps `kept` (nothing of
        this context is stored). Returns the slots the row keeps now."""
        self.cache.bind(self.engine.params)
        U, context, kept = self.unit, state.context(b), int(kept)
        keys = chain_keys(context, U, self.units(len(context)), self.salt)
        held = min(kept // U, len(keys))
        # (queried: the tokens the row does not hold; the run of hits after them)
        hit = self.cache.match(keys, len(context) - held * U, U, start=held)
        for i, kv in enumerate(hit, held):
            state.cache = write_in(self.engine, state.cache, kv, b, i * U)
        if hit or _blocks(len(context) - held * U, U) == _blocks(len(context) - kept, U):
            self._keys[b] = keys
            return (held + len(hit)) * U
        return kept

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
            self._hit.discard(s)

    def warm_up(self, state) -> None:
        """Queue both block programs' compilation in the background (`kv_blocks.prefetch`)."""
        prefetch(self.engine, state.cache, self.unit)


def _blocks(n: int, unit: int) -> int:
    """Prefill blocks (`decode.forward_rows`: unit + 1 tokens each, every one but the last
    committing `unit`) that forward the last n tokens of a context (its root included)."""
    return 1 + max(0, -(-(int(n) - unit - 1) // unit))
