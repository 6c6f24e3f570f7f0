"""Plain decoding: the loop with no drafter (T = 0), greedy or sampling."""

from __future__ import annotations

import dataclasses

from ..core.acceptance import TokenMatch
from ..core.budget import FixedBudget
from .base import StrategyBase


@dataclasses.dataclass(frozen=True)
class Greedy(StrategyBase):
    """Plain decoding, one token per forward (greedy, or sampling with temperature > 0).

    device_steps: tokens decoded per call into the device (1..256): with K > 1 a
        `lax.while_loop` runs up to K steps and stops each row at its EOS or length on the
        device, so the host (streaming, stop strings, scheduling) is woken every K tokens
        instead of every token; the same tokens. Streamed text then arrives K tokens at a
        time. Not with penalties (single steps are taken then)."""

    device_steps: int = 1

    name = "greedy"
    help = "plain decoding"
    field_help = {
        "device_steps": "tokens decoded per device call (a while loop on the device; the host, streaming and "
                        "stop strings are woken every K tokens; same tokens; default 1)",
    }

    def validate(self) -> None:
        k = self.device_steps
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 256:
            raise ValueError(f"device_steps must be an integer in [1, 256], got {k!r}")

    def max_nodes(self, drafter=None) -> int:
        return 0

    def setup(self, engine, state, drafter=None, references=None):
        return None, TokenMatch(state.sampling), FixedBudget(0)
