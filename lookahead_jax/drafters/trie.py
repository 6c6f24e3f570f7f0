"""Lookahead's drafter: an n-gram trie over the prompt, its references and past outputs.

It implements the drafter protocol of `drafters/base.py` (one call per step for the batch).
The trie is shared across requests (`TrieDrafter.shared`: one per engine), so it warms
up: every request's output n-grams count for all. A request's input n-grams (prompt +
references) and its own output n-grams are its own as well, ranked first, so its draft
begins with what its own n-grams alone would draft (`ngram_trie`, "Retrieval"); they
leave the trie when the request ends (a slot's next request starts with none).
`acceptance` (a `budget.AcceptanceStats`, per draft class `Draft.key` = (match length,
dominance)) also outlives the request: `decoding_length="auto"` reads it. Both live in the
engine's `TrieStore` (`engine.stores.of(TrieStore)`, core/engine.py's `Stores`).
"""

from __future__ import annotations

import dataclasses
import itertools

from ..core.budget import AcceptanceStats
from ..core.drafts import EMPTY, DraftBatch
from .ngram_trie import MODES, NgramTrie

_request_ids = itertools.count()


@dataclasses.dataclass
class TrieStore:
    """What the trie drafter keeps on an engine across requests (`engine.stores.of(TrieStore)`,
    made on first use, kept as long as the engine): the shared trie per branch length and
    the acceptance statistics per drafter geometry."""

    tries: dict = dataclasses.field(default_factory=dict)  # branch_length -> NgramTrie
    acceptance: dict = dataclasses.field(default_factory=dict)  # (branch_length, mode, ...) -> AcceptanceStats


class TrieDrafter:
    # `update` only adds output n-grams: a proposal one step before they are in the trie
    # is still valid (the overlapped loop runs it during the next step's forward)
    defer_update = True

    def __init__(self, branch_length: int = 12, mode: str = "hierarchical", max_nodes: int = 64,
                 trie: NgramTrie | None = None, max_match: int = 2,
                 acceptance: AcceptanceStats | None = None):
        if mode not in MODES:
            raise ValueError(f"lookahead mode must be one of {MODES}, got {mode!r}")
        if not 1 <= branch_length <= 64:
            raise ValueError(f"branch_length must be in [1, 64], got {branch_length}")
        if trie is not None and trie.branch_length < branch_length:
            raise ValueError("the shared trie stores shorter n-grams than branch_length")
        self.branch_length = branch_length
        self.mode = mode
        self.max_nodes = max_nodes
        self.max_match = max_match
        self.trie = trie if trie is not None else NgramTrie(branch_length=branch_length)
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats()
        self._req: dict[int, int] = {}

    @classmethod
    def shared(cls, engine, branch_length: int = 12, mode: str = "hierarchical", **kw) -> "TrieDrafter":
        """A drafter over the engine's global output trie and acceptance statistics
        (created on first use; the statistics are kept per drafter geometry)."""
        store = engine.stores.of(TrieStore)
        tries = store.tries
        if branch_length not in tries:
            tries[branch_length] = NgramTrie(branch_length=branch_length)
        stats = store.acceptance
        geometry = (branch_length, mode, kw.get("max_nodes", 64), kw.get("max_match", 2))
        if geometry not in stats:
            stats[geometry] = AcceptanceStats()
        return cls(branch_length, mode, trie=tries[branch_length], acceptance=stats[geometry], **kw)

    def begin(self, state, references=None, rows=None) -> None:
        """A request starts on each of `rows` (None: every row, a new batch): its prompt and
        references go into the trie as its input n-grams. references: per batch row."""
        if rows is None:
            self.end()
        else:
            self.end(rows)
        for row in range(state.batch) if rows is None else rows:
            req = next(_request_ids)
            self._req[row] = req
            self.trie.insert_input(state.rows[row].prompt_ids, req)
            for ref in (references[row] if references else ()):
                if ref:
                    self.trie.insert_input(ref, req)
            if state.rows[row].ids:
                self.trie.insert_output(state.rows[row].ids, req)

    def add_input(self, row: int, tokens) -> None:
        """More input n-grams for row's request (e.g. a passage retrieved while decoding)."""
        self.trie.insert_input(tokens, self._req[row])

    def propose(self, state, budget: int) -> DraftBatch:
        return DraftBatch(tuple(
            self.trie.retrieve(state.context(b), budget, self.branch_length, self.mode, self._req[b],
                               max_match=self.max_match) if live and b in self._req else EMPTY
            for b, live in enumerate(state.active)  # a row that began no request here (plain decoding): none
        ))

    def update(self, state, step) -> None:
        for b, tokens in enumerate(step.kept):
            if tokens and b in self._req:
                self.trie.insert_output(tokens, self._req[b])

    def rollback(self, rows, length) -> None:
        """Output windows restart after a rollback (n-grams already counted stay: they only
        steer drafts, never the output)."""
        for b in rows:
            if b in self._req:
                self.trie.restart_output(self._req[b])

    def end(self, rows=None) -> None:
        """The requests of `rows` (None: all) are over: their input n-grams leave the trie."""
        for row in list(self._req) if rows is None else [r for r in rows if r in self._req]:
            self.trie.end_request(self._req.pop(row))

    def summary(self) -> dict:
        return {}
