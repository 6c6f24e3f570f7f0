"""The strategy contract: what `generate` and the slot engine (`core/slots.py`) rely on.

A strategy is a frozen dataclass of its own options (hashable, so it can key caches),
implementing `Strategy`. Per call (or per inserted request) the loop asks it for

    drafter(engine)                    -> a `drafters.base.Drafter`, or None (plain decoding)
    max_nodes(drafter)                 -> the largest draft a step may verify (sizes the cache)
    setup(engine, state, drafter, refs)-> (drafter, acceptance rule, `core.budget.BudgetPolicy`);
                                          the loop's owner then begins the drafter on the
                                          rows (`Drafter.begin`), per request or per batch
    start(tokenizer, n_rows, engine)   -> a `Run` over n_rows rows for strategies that
                                          drive the loop themselves (retrieval: they rewrite
                                          prompts between verify steps), else None

`StrategyBase` gives the defaults (no drafter, no run, penalties supported), so `generate`
calls every method of every strategy and never probes with hasattr.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Run(Protocol):
    """The rows of a strategy that drives the decode loop itself (retrieval: ralm, ralmspec,
    knnlm) over a decode state of fixed rows, which requests enter and leave
    (`core/slots.py` keeps one per `Slots`; `generate` is one insert of every row).

    extra_tokens: prompt tokens it may add per row (cache sizing), described by `extra_note`
    in errors; picks_first_token: the prefill must not choose the first token (the run picks
    every token itself). add(state, rows, prompt_ids, spans): the requests entering `rows`
    (per-row state reset; spans: each prompt's question span or None) -> the prompts to
    prefill (e.g. with the first retrieved passage). step(...): one turn of its loop over
    the active rows (a verify step and the retrievals it leads to; knnlm: a round), instead
    of `core.decode.step`. final_upto(state, b): the generated tokens of row b that no later
    turn can change (what may be streamed). remove(rows): their requests left (their counts
    stay in the totals). close(): stop its workers. row_stats(b) / summary(): per-row and
    per-call stats; a retrieval run's per-call counters go under "retrieval", with the
    speculation counters of `speculation.SpeculationStats` (one shape for ralmspec and
    speculative knnlm; the CLI sums them over batches with `speculation.merge_counters`)."""

    extra_tokens: int
    extra_note: str
    picks_first_token: bool

    def add(self, state, rows, prompt_ids, spans=None) -> list: ...

    def step(self, engine, state, drafter, rule, budget) -> None: ...

    def final_upto(self, state, b: int) -> int: ...

    def remove(self, rows) -> None: ...

    def close(self) -> None: ...

    def row_stats(self, b: int) -> Optional[dict]: ...

    def summary(self) -> dict: ...


@runtime_checkable
class Strategy(Protocol):
    name: ClassVar[str]
    help: ClassVar[str]
    supports_penalties: ClassVar[bool]
    uses_question_spans: ClassVar[bool]
    runs_own_loop: ClassVar[bool]

    def validate(self) -> None: ...

    def drafter(self, engine): ...

    def max_nodes(self, drafter) -> int: ...

    def setup(self, engine, state, drafter, references: Optional[Sequence] = None) -> tuple: ...

    def start(self, tokenizer, n_rows: int, engine=None) -> Optional[Run]: ...


class StrategyBase:
    """Defaults of the `Strategy` protocol; CLI metadata (`cli.py` builds flags from the
    dataclass fields): `cli_names` renames a field's flag, `choices` / `parsers` /
    `metavars` / `field_help` describe it."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    supports_penalties: ClassVar[bool] = True  # False: its tokens come from its own distribution
    uses_question_spans: ClassVar[bool] = False  # its Run.add gets each prompt's question span
    runs_own_loop: ClassVar[bool] = False  # start() returns a Run that drives the decode loop
    takes_references: ClassVar[bool] = False  # whether `references` (texts a drafter drafts from) are used
    cli_names: ClassVar[dict] = {}
    choices: ClassVar[dict] = {}
    parsers: ClassVar[dict] = {}
    metavars: ClassVar[dict] = {}
    field_help: ClassVar[dict] = {}

    def validate(self) -> None:
        pass

    def drafter(self, engine):
        return None

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes if drafter is not None else 0

    def start(self, tokenizer, n_rows: int, engine=None) -> Optional[Run]:
        return None

    def unused_options(self, greedy: bool) -> dict:
        """{field: why} for fields this configuration does not use (the CLI warns when given)."""
        return {}
