"""Prefix-cache warm jobs: a token sequence (a finished chat turn: the next turn's prompt up
to the end of the answer) forwarded through a free slot in the prefill blocks a prompt's
own prefill runs, every unit stored in the prefix cache (`core.prefix_cache`), no token
emitted, so that the next turn's prompt takes them instead of forwarding them.

Why not copy the answer's decode-time K/V (vLLM does): decode and tree-verify steps are
other programs than the chunk blocks, and on an accelerator their K/V may differ from a
prefill's in rounding; a warm job runs the same blocks, at the same positions, with the
same tokens, as the next turn's own prefill (`forward_rows(emit=False)` of the block
`ids[i*U : i*U + C]`), so its units are bit for bit that prefill's K/V and the next turn's
tokens are those it gives without the cache.

Which units: unit i (slots [i*U, (i+1)*U)) is committed by the block that forwards
ids[i*U .. (i+1)*U] (its last token the root, forwarded, not committed), so a sequence of
n tokens gives its first (n - 1) // U units; a prompt that begins with those n tokens
and is longer takes every one of them (it has (n_p - 2) // U >= (n - 1) // U units).
The units already cached (turn 1's prompt blocks) are written into the row first
(`PrefixRows.warm_take`, not counted as a request's lookup) and only the rest is forwarded.

    warm = slots.warming                   # Slots(prefix_cache=..., prefill_chunk=C)
    if warm.start(slot, ids):              # a free slot: phase WARMING (neither free nor busy)
        while warm.rows and nobody_waits():
            warm.advance()                 # one block: its unit stored; the slot frees itself after the last
    warm.cancel(slot)                      # any time (a request needs the slot): units stored stay

The caller decides when (the server's scheduler: only while no request runs or waits, one
block per turn of its loop, a request that needs the slot preempting it); the row is never decoded (`Phase.WARMING` rows are not live).
"""

from __future__ import annotations

from typing import Sequence

from .decode import forward_rows
from .rows import Phase, RowState, free_row


class PrefixWarm:
    """A `Slots`'s warm rows (module docstring); the slots build it when they have a prefix
    cache (`Slots.warming`). Counters on the cache: warm_jobs, warm_tokens, warm_cancelled."""

    def __init__(self, slots):
        self.slots = slots
        self._rows: dict = {}  # slot -> the whole sequence it warms, oldest first

    @property
    def rows(self) -> list:
        """Slots warming now, oldest first."""
        return list(self._rows)

    def units(self, n_tokens: int) -> int:
        """Units a warm job of n_tokens commits: (n - 1) // U (module docstring)."""
        return max(0, (int(n_tokens) - 1) // self.slots.prefix.unit)

    def start(self, slot: int, ids: Sequence[int]) -> bool:
        """Begin warming `ids` in the free `slot`: the units of it already cached are written
        into the row, the row is WARMING. False (the slot stays free) when every unit it
        has is cached already (or it has none). A sequence longer than the cache's rows
        is cut to what a prompt could use (max_len - 1 tokens)."""
        sl = self.slots
        st, prefix = sl.state, sl.prefix
        if not 0 <= slot < sl.n_slots or st.rows[slot].phase is not Phase.FREE:
            raise ValueError(f"warm: slot {slot} is not a free slot of these slots")
        ids = [int(t) for t in ids][:st.max_len - 1]
        if ids and (min(ids) < 0 or max(ids) >= st.vocab):
            raise ValueError(f"warm: token ids must be in [0, {st.vocab})")
        n = self.units(len(ids))
        if n == 0:
            return False
        st.flush()
        prefix.cache.bind(sl.engine.params)
        row = RowState(slot, ids, sl.tokenizer, set(), (), 1, None)
        row.phase = Phase.WARMING
        st.rows[slot] = row
        lengths = st.lengths.copy()
        lengths[slot] = 0
        st.lengths = lengths
        st.cache = st.cache.replace(length=st.cache.length.at[slot].set(0))
        taken = prefix.warm_take(st, slot, ids, n)
        if taken >= n:
            self._end(slot)
            return False
        prefix.set_lengths(st, {slot: taken})
        self._rows[slot] = ids
        prefix.cache.warm_jobs += 1
        return True

    def advance(self) -> int:
        """Forward the next block of the oldest warm row (a non-last prefill block: its unit
        stored); after its last unit the row ends and its slot is free, and so it does,
        forwarding nothing, when every unit it has left is cached already (a request with
        the same tokens prefilled them meanwhile). Returns the number of units stored."""
        if not self._rows:
            return 0
        sl = self.slots
        st, prefix, C = sl.state, sl.prefix, sl.prefill_chunk
        slot = next(iter(self._rows))
        ids = self._rows[slot]
        start = int(st.lengths[slot])
        if prefix.held(slot, start):  # a request prefilled the rest meanwhile (e.g. the next turn itself)
            self._end(slot)
            return 0
        st.rows[slot].prompt_ids = ids[:start + C]  # the block ids[start:start + C], its last the root
        before = st.lengths.copy()
        forward_rows(sl.engine, st, [slot], emit=False)
        stored = prefix.save(st, [slot], before)
        prefix.cache.warm_tokens += stored * prefix.unit
        if int(st.lengths[slot]) >= self.units(len(ids)) * prefix.unit:
            self._end(slot)
        return stored

    def cancel(self, slot: int) -> RowState:
        """Stop warming `slot` (its stored units stay) and free it; its row is returned."""
        if slot not in self._rows:
            raise ValueError(f"slot {slot} is not warming")
        self.slots.prefix.cache.warm_cancelled += 1
        return self._end(slot)

    def sequence(self, slot: int) -> list:
        """The sequence `slot` warms (to queue it again before a `cancel`: started again,
        its stored units are taken from the cache and only the rest is forwarded)."""
        return list(self._rows[slot])

    def _end(self, slot: int) -> RowState:
        sl = self.slots
        sl.prefix.done([slot])
        row = sl.state.rows[slot]
        sl.state.rows[slot] = free_row(slot, sl.tokenizer)
        self._rows.pop(slot, None)  # (last: a thread reading `rows` never sees a busy slot with no job)
        return row
