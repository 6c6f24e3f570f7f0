"""Drafters: ways of proposing draft token trees (`base.Drafter` protocol).

`trie.TrieDrafter`: lookahead's n-gram trie over the prompt, references and past outputs.
`suffix.SuffixDrafter` (experimental, `Lookahead(drafts="suffix")`): the longest suffix
match over the request and a cache of earlier outputs, adaptive tree size.
"""

from .base import Drafter, PerRowDrafter

__all__ = ["Drafter", "PerRowDrafter"]
