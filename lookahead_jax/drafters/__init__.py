"""Drafters: ways of proposing draft token trees (`base.Drafter` protocol).

`suffix.SuffixDrafter` (lookahead's default, `Lookahead(drafts="suffix")`): the longest
suffix match over the request and a cache of earlier outputs, adaptive tree size.
`trie.TrieDrafter` (`Lookahead(drafts="trie")`): the n-gram trie over the prompt,
references and past outputs.
"""

from .base import Drafter, PerRowDrafter

__all__ = ["Drafter", "PerRowDrafter"]
