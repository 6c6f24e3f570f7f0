"""Lookahead's drafter: an n-gram trie over the prompt, its references and past outputs.

The drafter protocol used by `generate` (every drafter implements it):

    max_nodes: int              largest draft it will propose (sizes the cache)
    branch_length: int          deepest draft (how long until a draft can be scored)
    begin(prompts, references)  token ids per row; references: per row, list of id lists
    propose(row, context, budget) -> Draft   best-first, topological, <= budget nodes
                                (Draft.key classes it for the acceptance statistics)
    accept(row, tokens)         tokens just emitted for the row (streamed)
    end()                       the request is over
    acceptance                  optional `budget.AcceptanceStats` that outlives requests,
                                used by decoding_length="auto" (one per request if absent)

Input n-grams (prompt + references) belong to the request; output n-grams go into a
trie that is shared across requests (`TrieDrafter.shared`), so it warms up.
"""

from __future__ import annotations

import itertools

from ..budget import AcceptanceStats
from ..trie import MODES, Draft, NgramTrie

_request_ids = itertools.count()


class TrieDrafter:
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
    def shared(cls, model, branch_length: int = 12, mode: str = "hierarchical", **kw) -> "TrieDrafter":
        """A drafter over the model's global output trie and acceptance statistics
        (created on first use; the statistics are kept per drafter geometry)."""
        tries = model.__dict__.setdefault("_tries", {})
        if branch_length not in tries:
            tries[branch_length] = NgramTrie(branch_length=branch_length)
        stats = model.__dict__.setdefault("_acceptance", {})
        geometry = (branch_length, mode, kw.get("max_nodes", 64), kw.get("max_match", 2))
        if geometry not in stats:
            stats[geometry] = AcceptanceStats()
        return cls(branch_length, mode, trie=tries[branch_length], acceptance=stats[geometry], **kw)

    def begin(self, prompts, references=None) -> None:
        self.end()
        for row, ids in enumerate(prompts):
            req = next(_request_ids)
            self._req[row] = req
            self.trie.insert_input(ids, req)
            for ref in (references[row] if references else ()):
                if ref:
                    self.trie.insert_input(ref, req)

    def propose(self, row: int, context, budget: int) -> Draft:
        return self.trie.retrieve(
            context, budget, self.branch_length, self.mode, self._req[row], max_match=self.max_match
        )

    def accept(self, row: int, tokens) -> None:
        if tokens:
            self.trie.insert_output(tokens, self._req[row])

    def end(self) -> None:
        for req in self._req.values():
            self.trie.end_request(req)
        self._req.clear()
