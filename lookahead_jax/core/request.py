"""What a request to `core.slots.Slots` is, and what a step tells of it: `Request` (one
generation request: its encoded prompt and its checked `GenerationParams`, handed on
whole from `generate` and the server's scheduler), `SlotEvent` (one step's final tokens
and finish reason of one slot), and `NeedsOwnSlots` (a request the running slots cannot
take beside their others). Host-only: no JAX. `core.slots` re-exports all three."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from .params import GenerationParams


class NeedsOwnSlots(ValueError):
    """A request these slots cannot decode beside their others (a retrieval run's slots and
    other sampling values or penalties, another drafting strategy, min_new_tokens with
    other EOS ids): decode it on `Slots` of its own (the server's scheduler waits for the
    running requests and rebuilds the slots with its values)."""


@dataclasses.dataclass
class Request:
    """One generation request, prompt already encoded.

    params: its options, checked (`GenerationParams`: max / min new tokens, stop strings
    and token ids, ignore_eos, sampling, seed, penalties); the ids that end it are the
    slots' `eos_ids` (none with ignore_eos) and its stop_token_ids. strategy: None (the
    slots' strategy) or a strategy object: the slots' own, or one without a drafter
    (plain decoding). sampling_row: the row of the sampling key (default: the slot);
    `generate` numbers rows across a whole call so batches sample alike. references:
    token-id lists a drafting strategy also drafts from (e.g. retrieved passages)."""

    prompt_ids: Sequence[int]
    params: GenerationParams = GenerationParams()
    strategy: object = None
    sampling_row: Optional[int] = None
    references: Sequence[Sequence[int]] = ()
    on_text: Optional[Callable[[int, str], None]] = None  # (slot, text delta)
    question_span: Optional[tuple] = None  # retrieval strategies: the [start, end) of the question in the prompt


@dataclasses.dataclass
class SlotEvent:
    """What one step did to one slot: the tokens that became final (those it kept; with a
    retrieval strategy, those no later retrieval can change), and its finish reason once
    the request is complete ("eos", "stop", "length"; None while it goes on)."""

    slot: int
    tokens: list
    finish: Optional[str]
