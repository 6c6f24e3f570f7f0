"""The drafter protocol: how a way of proposing drafts plugs into the decode loop.

The loop (`decode.step`, driven by `Slots`) calls a drafter once per step for the whole batch:

    begin(state, references, rows=None)
                               requests start on `rows` (None: every row, a new batch);
                               `state` already holds their prompts and first generated
                               token; references: per batch row a list of token-id lists
                               (e.g. retrieved passages), or None. Other rows keep theirs
                               (the slot API inserts a request while others decode)
    propose(state, budget)     -> DraftBatch: one Draft per row (empty for finished rows),
                               best-first and topological, at most `budget` nodes each;
                               host lists now, device arrays for a draft model later
    update(state, step)        after the verify step: `step.kept[b]` the tokens row b
                               emitted (cut at EOS / stop / length), `step.path[b]` the
                               block indices of its accepted path (root first), so a draft
                               model can commit its own K/V along that path
    rollback(rows, length)     rows were set back to `length` committed cache slots
                               (`decode.rollback`): forget anything drafted past it
    end(rows=None)             the requests of `rows` (None: all) are over
    summary() -> dict          counters for the call's stats (e.g. the draft model's time)
    max_nodes: int             the largest draft it proposes (sizes the cache)
    defer_update: bool         optional (absent: False). True when `update` only feeds
                               stores that later proposals read, so the next `propose`
                               may run before it: the overlapped loop (`overlap=True`) then
                               runs it while the next step's forward computes. False for a
                               drafter whose next draft needs it (a draft model's cache)

What a drafter keeps for the budget policy (e.g. the trie's acceptance statistics per
match class, on `Draft.key`) stays with the drafter; the loop reads no drafter fields
beyond this protocol. `PerRowDrafter` adapts a drafter written per row.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

from ..core.drafts import EMPTY, Draft, DraftBatch


@runtime_checkable
class Drafter(Protocol):
    max_nodes: int

    def begin(self, state, references: Optional[Sequence[Sequence[Sequence[int]]]] = None,
              rows: Optional[Sequence[int]] = None) -> None: ...

    def propose(self, state, budget: int) -> DraftBatch: ...

    def update(self, state, step) -> None: ...

    def rollback(self, rows: Sequence[int], length: int) -> None: ...

    def end(self, rows: Optional[Sequence[int]] = None) -> None: ...

    def summary(self) -> dict: ...


class PerRowDrafter:
    """Base for host drafters that think one row at a time: implement
    `propose_row(row, context, budget) -> Draft` (context = prompt + generated ids, its
    last token the root); `begin`/`update`/`rollback`/`end` default to doing nothing."""

    max_nodes: int = 64

    def begin(self, state, references=None, rows=None) -> None:
        pass

    def propose_row(self, row: int, context: list, budget: int) -> Draft:
        raise NotImplementedError

    def propose(self, state, budget: int) -> DraftBatch:
        return DraftBatch(tuple(
            self.propose_row(b, state.context(b), budget) if live else EMPTY
            for b, live in enumerate(state.active)
        ))

    def update(self, state, step) -> None:
        pass

    def rollback(self, rows, length) -> None:
        pass

    def end(self, rows=None) -> None:
        pass

    def summary(self) -> dict:
        return {}
