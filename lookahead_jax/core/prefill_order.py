"""Which prefilling slot's block a step forwards next (`Slots._next_prefill`).

Shortest remaining first: the slot with the fewest prompt tokens left, the oldest among
equals. A short prompt that arrives behind long ones then gets its first token after its
own few blocks, not theirs, which is what the median time to first token sees (vLLM's and
SGLang's schedulers also favour short work when they chunk prefills). Its known cost: a
long prompt waits while shorter ones keep prefilling in the other slots, and a steady
stream of shorter prompts would delay it for as long as the stream lasts. The age bound
ends that: a slot passed over for `max_wait` blocks in a row goes next (the longest
passed over first, the oldest among equals), so a long prompt takes at least one block in
every max_wait + 1.

Oldest first (`shortest_first` False) bounds every wait by the prompts ahead.

The rule reads only the blocks taken (no clock), so every process of a multi-process
server, which forwards the same blocks, picks alike.
"""

from __future__ import annotations

# blocks a prefilling slot may be passed over in a row before it goes next: at the server's
# 64-token blocks (~0.1-0.13 s a step with a block on 2 CPU cores) a long prompt then waits
# at most ~2 s for its next block, however many shorter prompts arrive
MAX_WAIT_BLOCKS = 16


class PrefillOrder:
    """The order of the prefilling slots' blocks (module docstring)."""

    def __init__(self, shortest_first: bool = True, max_wait: int = MAX_WAIT_BLOCKS):
        if int(max_wait) < 1:
            raise ValueError(f"max_wait must be 1 or more blocks, got {max_wait}")
        self.shortest_first, self.max_wait = bool(shortest_first), int(max_wait)
        self.waited: dict = {}  # slot -> blocks it was passed over for since its last

    def begin(self, slot: int) -> None:
        """`slot` starts prefilling a new prompt: it has waited for nothing yet."""
        self.waited[int(slot)] = 0

    def pick(self, left: dict) -> int:
        """The slot whose block goes next. left: each prefilling slot -> its prompt tokens
        left to forward, oldest slot first (the order the slots began prefilling)."""
        if not left:
            raise ValueError("no slot is prefilling")
        waited = {s: self.waited.get(s, 0) for s in left}
        if not self.shortest_first:
            pick = next(iter(left))
        else:
            overdue = [s for s in left if waited[s] >= self.max_wait]
            pick = max(overdue, key=waited.get) if overdue else min(left, key=left.get)
        self.waited = {s: 0 if s == pick else n + 1 for s, n in waited.items()}
        return pick
