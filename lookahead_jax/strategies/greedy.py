"""Plain decoding: the loop with no drafter (T = 0), greedy or sampling."""

from __future__ import annotations

import dataclasses

from ..core.acceptance import TokenMatch
from ..core.budget import FixedBudget
from .base import StrategyBase


@dataclasses.dataclass(frozen=True)
class Greedy(StrategyBase):
    """Plain decoding, one token per forward (greedy, or sampling with temperature > 0)."""

    name = "greedy"
    help = "plain decoding"
    def max_nodes(self, drafter=None) -> int:
        return 0

    def setup(self, engine, state, drafter=None, references=None):
        return None, TokenMatch(state.sampling), FixedBudget(0)
