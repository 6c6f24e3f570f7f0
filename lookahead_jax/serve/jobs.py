"""What the server's engine thread (`scheduler.Scheduler`) decodes and hands back: a `Job`
(one prompt, one sample of it, with the sink its outputs go to), each `Output` the sink
gets (tokens, text delta, log-probabilities, finish), and a job's `Speculation` counts
(vLLM's per-request acceptance metrics). Host-only: no JAX."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from ..core.params import GenerationParams
from ..core.request import Request


@dataclasses.dataclass
class Output:
    """What the engine hands a job after an insert or step: `tokens` kept (EOS / stop cut),
    their `logprobs` (None unless the job asked), the `text` delta, and at the end
    `finish` ("eos" | "stop" | "length" | "abort" | "error") with `error` / `status`, and
    a retrieval strategy's record of the request (`Slots.free(slot).retrieval`); with its
    last tokens (the output before the finish), a job that asked for prompt
    log-probabilities gets them (`RowState.prompt_logprobs` / `prompt_top`)."""

    index: int
    tokens: list
    text: str
    logprobs: Optional[list] = None
    finish: Optional[str] = None
    error: Optional[str] = None
    status: int = 200
    retrieval: Optional[dict] = None
    prompt_logprobs: Optional[list] = None
    prompt_top: Optional[list] = None
    tops: Optional[list] = None  # per token its most likely (id, log-probability) pairs (top_logprobs)
    speculation: Optional[dict] = None  # with the finish: the job's `Speculation.record()` (drafting jobs)


@dataclasses.dataclass
class Speculation:
    """One job's speculative decoding: the verify steps that checked drafts for it, the
    draft tokens (tree nodes) they checked and how many of them it kept; `record()` is the
    response's `metrics.speculative_decoding` (vLLM's per-request acceptance metrics)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: dict = dataclasses.field(default_factory=dict)  # accepted draft tokens -> steps

    def add(self, drafted: int, accepted: int) -> None:
        self.steps, self.drafted, self.accepted = self.steps + 1, self.drafted + drafted, self.accepted + accepted
        self.histogram[accepted] = self.histogram.get(accepted, 0) + 1

    def record(self) -> dict:
        return dict(num_spec_steps=self.steps, num_draft_tokens=self.drafted, num_accepted_draft_tokens=self.accepted,
                    draft_acceptance_rate=self.accepted / self.drafted if self.drafted else 0.0,
                    mean_acceptance_length=1.0 + self.accepted / self.steps if self.steps else 1.0,
                    acceptance_histogram={str(k): v for k, v in sorted(self.histogram.items())})


@dataclasses.dataclass(eq=False)
class Job:
    """One sequence to decode (one prompt, one sample of it). `sink(Output)` is called
    from the engine thread (it must be thread-safe and quick); `index` is its choice."""

    prompt_ids: list
    params: GenerationParams
    sink: Callable[[Output], None]
    index: int = 0
    sampling_row: int = 0
    references: list = dataclasses.field(default_factory=list)
    strategy: object = None  # None: the server's; a drafter-less strategy: plain decoding
    question_span: Optional[tuple] = None  # retrieval strategies: the question's [start, end) in the prompt
    # filled in by the scheduler
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    done: bool = False
    n_out: int = 0
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    retrieval: Optional[dict] = None
    spec: Speculation = dataclasses.field(default_factory=Speculation)
    _text: list = dataclasses.field(default_factory=list)

    def request(self) -> Request:
        return Request(self.prompt_ids, self.params, strategy=self.strategy, sampling_row=self.sampling_row,
                       references=self.references,
                       question_span=self.question_span, on_text=lambda _slot, delta: self._text.append(delta))
