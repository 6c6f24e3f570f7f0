"""Drafters: ways of proposing draft token trees (`base.Drafter` protocol).

`trie.TrieDrafter`: lookahead's n-gram trie over the prompt, references and past outputs.
"""

from .base import Drafter, PerRowDrafter

__all__ = ["Drafter", "PerRowDrafter"]
