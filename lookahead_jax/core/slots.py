"""Slots: a decode state with a fixed number of rows that requests enter and leave while
the others decode (the seam a server with continuous batching drives).

    slots = Slots(engine, tokenizer, n_slots=4, max_len=1024, strategy=Lookahead())
    slots.insert(0, Request(prompt_ids, GenerationParams(max_new_tokens=64, seed=1)))  # prefill one
    while slots.busy:
        for event in slots.step():      # one propose -> verify -> accept over the busy slots
            print(event.slot, event.tokens, event.finish)
        ...                             # insert into free slots at any time
    row = slots.free(0)                 # its tokens, text, finish reason; the slot is free again

The shape is JetStream's (prefill / insert / generate / free_resource over an opaque
decode state of fixed slots) with speculation inside `step`: a step may emit several
tokens per slot. Everything per request lives in its row (`rows.RowState`: prompt,
tokens, stop strings, EOS ids, max / min new tokens, streaming callback) and in the
drafter's per-row state (`Drafter.begin(..., rows=)` / `end(rows=)`); what outlives
requests (lookahead's cache of earlier outputs or trie, acceptance statistics, draft engines) lives in the
engine's stores, as for `generate`.

Each request brings its own options in one checked object (`Request.params`, a
`core.params.GenerationParams`: length, stops, sampling, penalties, logit bias, seed): its
sampling values, penalties and bias reach the step as per-row arrays
(`sampling.RowSampling`, `RowPenalties`, `RowBias`), so greedy, sampled (any
temperature / top-k / top-p / seed), penalized and biased requests share one batch and
values never recompile; whether a row samples or cuts is data too (one program for
greedy and sampled rows, the argmax alone where none samples: `sampling.select_tokens`);
with `penalty_rows` (the server's slots) every step carries every row's penalties and
bias, neutral where a request has none, so such requests share those programs too
(otherwise whether some row needs them is compiled in). What one verify step
compiles in is shared by the slots: the acceptance rule, whether log-probabilities are
returned, the ids that `min_new_tokens` bans; and a retrieval run (below) decodes with
the slots' sampling and penalties. A request asking for other values of these gets a
clear error (run it on `Slots` of its own). A request's strategy is the slots' strategy,
or plain decoding (a strategy without a drafter, e.g. `Greedy()`: its rows simply get no
drafts), so
greedy and lookahead (or SpecInfer) requests share one batch. A strategy that drives the
loop itself (retrieval between verify steps: ralm, ralmspec, knnlm) brings a `Run`
(`strategies.base.Run`) over the slots: `insert` hands it the entering requests (it
rewrites their prompts, e.g. with the first retrieved passage), `step` is one turn of its
loop, `free` tells it the request left; its slots take only its own requests. Events carry
only tokens no later turn can change (a retrieval may roll a row back: those tokens are
held until verified), so a stream never has to take text back.

Chunked prefill (`prefill_chunk=C`): a prompt longer than C tokens would stall every
running request for its whole prefill; so `insert` forwards its first block of C tokens
(every block one row of the chunk's bucket of tokens: a few compiled programs for every
prompt length, `DecodeState.block`; with no other request decoding, all its blocks at
once: nobody waits) and the slot is `prefilling` (neither free nor decoding: its row's phase is
`Phase.PREFILLING`, so the decode step, the drafter and the budget skip it), and each `step`, after
its verify step over the decoding slots, forwards the next block of the prefilling slot
with the fewest prompt tokens left, the oldest among equals (one block of at most C tokens
per step; `shortest_first`: a short prompt behind a long one waits for its own few blocks,
not the long one's, which is what the median time to first token sees; a prompt passed
over for `max_prefill_wait` blocks in a row goes next, `prefill_order`). A block reads the
cached prefix (`decode.forward_rows`), and its last token stays uncached as
the row's root, re-forwarded first in the next block (the row's invariant holds between
blocks): a prompt of L > C tokens takes ceil((L - 1) / (C - 1)) blocks, the insert's and
one per step after it; a prompt whose next block after the insert's is its last (one of at
most two blocks, or one the prefix cache served but for its end) takes that one at insert
too, so its first token comes out at once for a second block's stall. With a `step_budget` k a step forwards more blocks (in
the same order) while it stays within k x a decode step of the running batch (the median of
the last few), at least one; and while other slots decode, `insert` forwards none (its
blocks go with the steps, so an admission never holds the running requests longer than a
step's budget). The last block gives the first token exactly as a whole prefill
(same position, same sampling key), that step's events carry it, and the drafter begins
the request then (a draft model forwards the prompt at the first step that drafts for
it). `free` cancels a prefilling slot like any other. A retrieval run's slots prefill whole prompts.

A prefix cache (`prefix_cache=` bytes, with `prefill_chunk`; `core.prefix_cache`): the
K/V of every prompt block but the last is kept on the engine as it is prefilled, and a
prompt that begins with cached blocks (the same passage, system prompt or few-shot header)
gets them written into its row at insert and forwards only the rest (at least its last
block: the first token comes from a real forward); before each block a prompt takes the
blocks cached since, and one whose next block another prompt of the same forward computes
waits for it (prompts inserted together that share a header forward it once: `generate`'s
rows). A cached block is bit for bit the K/V
its own block would compute (same tokens, positions and program), so the tokens are those
without the cache. A retrieval run's slots use it too: their whole prompts go in the same
blocks (pieces of the block size), and a re-prefill after a passage change starts at a
block boundary and takes the new context's cached blocks (`decode.replace_prompt`). Not
for requests that score their prompt (prompt_logprobs). A draft model's prompt K/V are
cached alike on its engine (`drafters.draft_prefix`): with the cache on, SpecInfer's draft
forwards a new request's context in the same blocks, its cached units first.
`warming` (`core.prefix_warm`) forwards a token sequence's blocks through a free slot into
the cache without a request (a chat's answer, for its next turn): the row is neither free
nor busy until it ends or is freed (not in a retrieval run's slots).

A request's tokens do not depend on the other slots: a row's logits do not depend on the
other rows of a forward, its sampling key is (seed, sampling row, position), and its
filters and penalties are its own, so a request inserted mid-decode gives the tokens it
gives alone (tests/test_slots.py, tests/test_row_sampling.py), also when its prompt is
prefilled in chunks (tests/test_chunked_prefill.py).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from .acceptance import TokenMatch
from .budget import FixedBudget, NoTree
from .buckets import tail_bucket
from .decode import DecodeState, forward_rows, prompt_bucket, step
from .device_steps import plain_steps
from .programs import inventory, warm_up as warm_programs
from .rows import Phase, RowState, free_row
from .drafts import SkipRows
from .multihost import agree_choice, to_host
from .params import GenerationParams
from .prefill_order import MAX_WAIT_BLOCKS, PrefillOrder
from .prefix_cache import budget_bytes
from .prefix_rows import PrefixRows
from .prefix_warm import PrefixWarm
from .request import NeedsOwnSlots, Request, SlotEvent  # noqa: F401 (the slots' API: imported from here)
from .sampling import Penalties, SamplingParams


class Slots:
    """`n_slots` rows of one KV cache of `max_len` slots, decoded together (module
    docstring). engine: a `core.engine.Engine`; strategy: a strategy object (None: plain
    decoding); drafter: a drafter to use instead of the strategy's own; run: the strategy's
    `Run` over these slots, when it drives the loop itself (default: `strategy.start`);
    eos_ids: the ids that end a request by default (and that min_new_tokens bans).
    `begin_s`: seconds the last insert spent starting the drafter (e.g. a draft model's
    prefill), its compilation excluded, and the first insert's setup of the strategy (e.g.
    auto's calibration). prefill_chunk: None (a prompt is forwarded whole at insert) or C >= 2
    tokens forwarded per block of a longer prompt (module docstring; a retrieval run's slots
    always prefill whole prompts at insert: `self.prefill_chunk` is then None, but its
    prompts and re-prefills go in blocks of C, `DecodeState.block`). overlap: a step's
    budget scoring (and a deferrable drafter update) runs while the next step computes
    (`decode.step`; insert, free, close and a run's step run it first). step_budget: None
    (one prefill block a step) or k >= 1: a step's prefill blocks fill it up to k x a decode
    step of the running batch (module docstring). penalty_rows: every step carries each
    row's penalties and logit bias as data (`DecodeState.penalty_rows`; not with a run or
    a strategy without penalties), so such a request compiles nothing of its own.
    prefix_cache: bytes of prompt-block K/V kept on the engine for later prompts that begin
    alike (`core.prefix_cache`; shared by every Slots of the engine, the last one built sets
    its size; None / 0: off); only with prefill_chunk (else ignored).
    Call `close()` when done (a run's workers stop)."""

    trees_while_prefilling = True  # False: a step with a prefill block verifies no tree (`budget.NoTree`)
    blocks_at_insert = True  # False: while others decode, an insert forwards no block (one a step)
    shortest_first = True  # False: prefilling slots take their blocks oldest first (`_next_prefill`)
    max_prefill_wait = MAX_WAIT_BLOCKS  # blocks a prefilling slot may be passed over in a row
    narrow_tail = True  # False: a prompt's short last piece takes the full block (`DecodeState.tail`)
    def __init__(self, engine, tokenizer, n_slots: int, max_len: int, strategy=None, *, drafter=None, run=None,
                 sampling: SamplingParams = SamplingParams(), penalties: Penalties = Penalties(),
                 logprobs: bool = False, eos_ids: Sequence[int] = (), prefill_chunk: Optional[int] = None,
                 overlap: bool = False, fallback: bool = False, step_budget: Optional[float] = None,
                 penalty_rows: bool = False, prefix_cache: Optional[int] = None):
        if not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be a positive integer, got {n_slots!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool)
                                          or not isinstance(prefill_chunk, (int, np.integer))
                                          or prefill_chunk < 2):
            raise ValueError(f"prefill_chunk must be an integer >= 2 (prompt tokens forwarded per block; each "
                             f"block re-forwards the last token of the one before) or None (whole prompts), "
                             f"got {prefill_chunk!r}")
        if step_budget is not None and (isinstance(step_budget, bool) or not isinstance(step_budget, (int, float))
                                        or not step_budget >= 1):
            raise ValueError(f"step_budget must be a number >= 1 (a step with prefill blocks may take that many "
                             f"times a decode step of the running batch) or None, got {step_budget!r}")
        if strategy is not None and strategy.runs_own_loop and run is None:
            run = strategy.start(tokenizer, n_slots, engine=engine)
        self.run = run
        # plain decoding's tokens per device call (a strategy's `device_steps`; 1: one step a call)
        self.device_steps = int(getattr(strategy, "device_steps", 1) or 1)
        # a run's rows are prefilled whole (its add / replace_prompt edit whole prompts)
        self.prefill_chunk = None if prefill_chunk is None or run is not None else int(prefill_chunk)
        if penalties.on and strategy is not None and not strategy.supports_penalties:
            raise ValueError(f"strategy {strategy.name!r} does not apply repetition / presence / frequency penalties")
        self.engine, self.tokenizer, self.strategy = engine, tokenizer, strategy
        self.eos_ids = tuple(sorted({int(t) for t in eos_ids}))
        self.state = DecodeState(
            rows=[free_row(b, tokenizer) for b in range(n_slots)], cache=engine.init_cache(n_slots, max_len),
            lengths=np.zeros(n_slots, np.int64), root=np.zeros(n_slots, np.int32),
            seeds=engine.put(np.zeros(n_slots, np.uint32)), rowids=engine.put(np.arange(n_slots, dtype=np.int32)),
            sampling=sampling, max_len=max_len, ban=self.eos_ids, logprobs=bool(logprobs), penalties=penalties,
            vocab=int(engine.config.vocab_size))
        self.state.overlap = bool(overlap)  # bookkeeping overlapped with the next step (`decode.step`)
        self.state.fallback = bool(fallback)  # steps do without programs not compiled yet
        self.state.penalty_rows = bool(penalty_rows) and run is None and (
            strategy is None or strategy.supports_penalties)
        if prefill_chunk is not None:  # every block one row of the chunk's bucket: a few programs (a
            self.state.block = prompt_bucket(int(prefill_chunk), max_len)  # run's whole prompts and re-prefills too)
            self.state.tail = tail_bucket(self.state.block) if self.narrow_tail else 0  # (a short last piece)
        self.state.set_row_values(engine.put)
        capacity = budget_bytes(prefix_cache)  # (a run's whole prompts go in pieces of the block)
        self.prefix = PrefixRows(engine, self.state, self.prefill_chunk or self.state.block, capacity) \
            if capacity and prefill_chunk is not None else None
        self.state.prefix = self.prefix  # (a run's re-prefills: `decode.replace_prompt`)
        # prefix-cache warm jobs (a chat's answer for its next turn; not in a run's slots)
        self.warming = PrefixWarm(self) if self.prefix is not None and run is None else None
        self.state.t_start = time.perf_counter()
        if drafter is None and strategy is not None:
            drafter = strategy.drafter(engine)
        self.begin_s = 0.0
        self.max_nodes = strategy.max_nodes(drafter) if strategy is not None else 0
        self.drafter = drafter if strategy is not None else None
        self.rule, self.budget = TokenMatch(sampling), FixedBudget(0)
        # a strategy's rule and budget are set up at the first insert, when rows hold prompts
        # (auto's calibration measures at a length of this run); the drafter begins per request
        self._set_up = strategy is None
        self._plain: set = set()  # slots whose request decodes without drafts
        self._sent = [0] * n_slots  # tokens of each slot's request handed out in events
        self._prefill: dict = {}  # slot -> its whole prompt, while prefilling (oldest first)
        self._order = PrefillOrder(self.shortest_first, self.max_prefill_wait)  # (whose block next)
        self._refs: dict = {}  # slot -> its request's references, until the drafter begins it
        self.last_step = None  # the last step's StepResult (None: a retrieval run's turn)
        self.step_budget = None if step_budget is None else float(step_budget)
        self._decode_s: list = []  # the last decode steps' seconds (the step budget's unit)
        self._clock = time.perf_counter  # the budget's clock (tests give steps fixed costs)
        self.warm = None  # the last warm_up's `programs.WarmUp` (progress of its compilations)

    # ------------------------------------------------------------------ queries
    @property
    def n_slots(self) -> int:
        return self.state.batch

    @property
    def free_slots(self) -> list:
        return [b for b, r in enumerate(self.state.rows) if r.phase is Phase.FREE]

    @property
    def busy(self) -> list:
        """Slots whose request is not finished: it decodes, or its prompt is still being
        prefilled (`prefilling`)."""
        return [b for b, r in enumerate(self.state.rows) if r.phase is Phase.PREFILLING or r.live]

    @property
    def prefilling(self) -> list:
        """Slots whose prompt is still being forwarded in chunks, oldest first; they are
        neither free nor decoding (`step` serves them in `_next_prefill`'s order)."""
        return list(self._prefill)

    def _next_prefill(self) -> int:
        """The prefilling slot whose block goes next (`prefill_order.PrefillOrder`): the
        fewest prompt tokens left first, the oldest among equals, unless a slot has been
        passed over for `max_prefill_wait` blocks (it goes next); or the oldest
        (`shortest_first` False)."""
        return self._order.pick({s: len(p) - int(self.state.lengths[s]) for s, p in self._prefill.items()})

    def row(self, slot: int) -> RowState:
        return self.state.rows[slot]

    # ------------------------------------------------------------------ insert / step / free
    def insert(self, slots, requests) -> list:
        """Prefill `requests` (one, or a list) into the free `slots` (an int, or a list of as
        many): their prompts are forwarded into their rows of the cache (rows of similar
        length in one block) and each gets its first token, while the other slots keep
        their caches. With `prefill_chunk` C, while other slots decode, a prompt longer than
        C gets only its first block of C tokens here and is `prefilling` (its first token
        comes from a later `step`). Returns the first SlotEvent of each (no tokens while prefilling)."""
        self.state.flush()
        slots = [slots] if isinstance(slots, (int, np.integer)) else [int(s) for s in slots]
        requests = [requests] if isinstance(requests, Request) else list(requests)
        if len(slots) != len(requests) or len(set(slots)) != len(slots):
            raise ValueError(f"insert: {len(slots)} distinct slots need as many requests, got {len(requests)}")
        for s, req in zip(slots, requests):
            self._check(s, req)
        st = self.state
        for s, req in zip(slots, requests):
            p = req.params
            row = RowState(s, [int(t) for t in req.prompt_ids], self.tokenizer, set(p.eos_ids(self.eos_ids)),
                           p.stop, p.max_new_tokens, req.on_text)
            row.min_new = p.min_new_tokens
            row.logprobs = [] if st.logprobs else None
            row.sampling, row.penalties, row.logit_bias = p.sampling, p.penalties, p.logit_bias
            row.top_k, row.tops = p.top_logprobs, [] if p.top_logprobs else None
            if p.prompt_logprobs is not None:  # the first prompt id has none (nothing before it)
                row.prompt_logprobs, row.prompt_k = [None], p.prompt_logprobs
                row.prompt_top = [None] if p.prompt_logprobs else None  # (alternatives only where k > 0)
            st.rows[s] = row
            st.finish_s.pop(s, None)
            self._sent[s] = 0
            self._refs[s] = list(req.references)
            (self._plain.add if self._plain_request(req) else self._plain.discard)(s)
        if self.run is not None:  # e.g. the first retrieval: the passage goes before the question
            prompts = self.run.add(st, slots, [st.rows[s].prompt_ids for s in slots],
                                   [req.question_span for req in requests])
            for s, p in zip(slots, prompts):
                st.rows[s].prompt_ids = [int(t) for t in p]
        idx = np.asarray(slots)
        lengths = st.lengths.copy()
        lengths[idx] = 0
        st.lengths = lengths
        st.cache = st.cache.replace(length=st.cache.length.at[idx].set(0))
        seeds, rowids = (np.array(x) for x in to_host((st.seeds, st.rowids)))
        seeds[idx] = [np.uint32(r.params.seed) for r in requests]
        rowids[idx] = [s if r.sampling_row is None else int(r.sampling_row) for s, r in zip(slots, requests)]
        st.seeds, st.rowids = self.engine.put(seeds), self.engine.put(rowids)
        st.set_row_values(self.engine.put)
        inserted = set(slots)  # (a set: a list's `in` made this quadratic in the batch)
        decoding = [b for b in np.flatnonzero(st.active) if b not in inserted]  # requests that would wait
        if self.prefill_chunk is None:  # the whole prompt in one forward
            if self.prefix is not None:  # (a run's rows) cached leading blocks in, the rest forwarded
                self.prefix.fill(st, slots)
            forward_rows(self.engine, st, slots, emit=self.run is None or not self.run.picks_first_token,
                         on_block=self.prefix and self.prefix.save)
            if self.prefix is not None:
                self.prefix.done(slots)
            self._activate(slots)
        else:  # every prompt enters as prefilling; those of at most C tokens finish in this block
            for s in slots:
                self._prefill[s], st.rows[s].phase = st.rows[s].prompt_ids, Phase.PREFILLING
                self._order.begin(s)
            if self.prefix is not None:  # cached leading blocks into the rows; the rest is forwarded
                self.prefix.fill(st, slots)
            if not decoding or self.step_budget is None and self.blocks_at_insert:  # (else the steps take them)
                self._forward_chunks(slots)
                # a prompt one block from its end (a short one, or one the prefix cache served)
                # takes it now too: its first token at insert, for a second block's stall
                near = [s for s in slots if s in self._prefill
                        and len(self._prefill[s]) - int(st.lengths[s]) <= self.prefill_chunk]
                if decoding and near:
                    self._forward_chunks(near)
            while not decoding and (rest := [s for s in slots if s in self._prefill]):
                self._forward_chunks(rest)  # nobody waits: every block now, the first token out at once
        return [self._event(s) for s in slots]

    def step(self) -> list:
        """One propose -> verify -> accept over the decoding slots (several tokens per slot
        where drafts are accepted; a retrieval strategy's run: one turn of its loop), then
        a prefilling slot's next block (`prefill_chunk`, `_next_prefill`; when it is the
        prompt's last, the slot gets its first token and decodes from the next step).
        Returns a SlotEvent per slot that was busy."""
        busy = self.busy
        if not busy:
            return []
        self.last_step = None  # no verify step (only prefilling), or a run's turn (it may hold several)
        t0 = self._clock()
        decoding = bool(self.state.active.any())
        if decoding:
            drafter = SkipRows(self.drafter, self._plain) if self.drafter is not None and self._plain \
                else self.drafter
            if self.run is not None:
                self.state.flush()
                self.run.step(self.engine, self.state, drafter, self.rule, self.budget)
            elif self._block_steps and self.state.row_penalties() is None and \
                    not self.state.top_k(np.flatnonzero(self.state.active)):
                # plain decoding, several tokens per call (the strategy's device_steps)
                self.last_step = plain_steps(self.engine, self.state, self.rule, self.device_steps)
            else:  # the StepResult (drafted / emitted per row: a server's speculation metrics)
                plain = self._prefill and not self.trees_while_prefilling  # (`budget.NoTree`)
                self.last_step = step(self.engine, self.state, drafter, self.rule,
                                      NoTree(self.budget) if plain else self.budget)
        if decoding:
            self._decode_s = (self._decode_s + [self._clock() - t0])[-8:]
        self._prefill_blocks(t0, decoding)
        return [self._event(b) for b in busy]

    def _prefill_blocks(self, t0: float, decoding: bool) -> None:
        """A step's prefill: the next block of a prefilling slot (`_next_prefill`); with a
        `step_budget` k, more blocks (each `_next_prefill`'s) while the step, begun at t0,
        stays within k x a decode step of the running batch (the median of the last ones):
        a block is forwarded when the last block's time still fits (process 0's times, over
        several processes). At least one block a
        step (every prompt progresses); with no slot decoding at the step's start (`decoding`),
        every block at once. A step whose rows all finished still keeps to the budget: their
        last tokens go out with this step's events, which would otherwise wait for every block."""
        while self._prefill:
            t = self._clock()
            self._forward_chunks([self._next_prefill()])
            block_s = self._clock() - t
            if self.step_budget is None:
                return
            if decoding and self._decode_s:
                limit = self.step_budget * float(np.median(self._decode_s))
                # (process 0's clock decides for every process: each must forward the same blocks)
                if agree_choice(self._clock() - t0 + block_s > limit)[0]:
                    return

    @property
    def _block_steps(self) -> int:
        """Tokens per device call of plain slots (`device_steps` > 1, no drafter, no run), else 0."""
        return self.device_steps if self.device_steps > 1 and self.drafter is None and self.run is None else 0

    def free(self, slot: int) -> RowState:
        """Release `slot` (finished, or cancelled mid-decode or while prefilling: finish
        reason "abort") and return its row (tokens, text, finish reason, logprobs; a
        retrieval strategy's record of the request in `row.retrieval`)."""
        self.state.flush()
        row = self.state.rows[slot]
        if row.phase is Phase.FREE:
            raise ValueError(f"slot {slot} is already free")
        if row.phase is Phase.WARMING:  # a warm job, no request: cancelled (its stored blocks stay)
            return self.warming.cancel(slot)
        began = slot not in self._prefill  # a prefilling row's drafter has not begun it
        if not began:
            row.prompt_ids = self._prefill.pop(slot)
            row.phase = Phase.DECODING
        if row.finish is None:
            row.finish = "abort"
        self._refs.pop(slot, None)
        if self.prefix is not None:
            self.prefix.done([slot])
        if self.drafter is not None and slot not in self._plain and began:
            self.drafter.end([slot])
        if self.run is not None:
            row.retrieval = self.run.row_stats(slot)
            self.run.remove([slot])
        self._plain.discard(slot)
        self.state.rows[slot] = free_row(slot, self.tokenizer)
        return row

    def programs(self) -> list:
        """Every step program these slots run (`programs.inventory`: prefill blocks,
        verify steps per tree size and window, plain decoding's blocks), the minimum set
        first: what `warm_up` compiles."""
        self._setup()
        return inventory(self)

    def warm_up(self, sampled: bool = False, progress: Optional[Callable[[int, int], None]] = None,
                wait: str = "all") -> int:
        """Compile, before any request, the steps these slots run (`programs()`), in
        background threads, the minimum set first (`programs.warm_up`; nothing runs: only
        shapes count, so the slots stay empty). Returns once `wait` is compiled: "all" (the
        default), "minimum" (what every request can be served with; the rest compiles
        while the slots serve, and `fallback` slots do without a tree size until it is
        ready) or "none". sampled: accepted for compatibility (sampling is data: greedy and
        sampled rows run the same programs). progress(done, total) as each program is
        compiled. Only while every slot is free. Returns the number of programs this call
        queued (0 when an earlier warm-up on this engine had them); `self.warm` tracks them."""
        if self.busy or len(self.free_slots) != self.n_slots:
            raise RuntimeError("warm_up() needs slots that hold no request")
        c0, shown = self.engine.compiled.compile_s, 0
        self._setup()

        def ticks(warm):  # one call per program compiled
            nonlocal shown
            while progress is not None and shown < warm.ready:
                shown += 1
                progress(shown, warm.total)

        if self.prefix is not None:  # its two block programs (tiny), in the background
            self.prefix.warm_up(self.state)
        self.warm = warm_programs(self, wait, ticks)
        self.state.compile_s += self.engine.compiled.compile_s - c0
        return self.warm.queued

    @property
    def rehearses(self) -> bool:
        """Whether these slots run a retrieval run, whose own jitted steps (KNN-LM's forward,
        search and mixture; a dense retriever's encoder and scoring) the inventory cannot
        list: a rehearsal (`rehearse`) compiles them ahead."""
        return self.run is not None

    def rehearse(self, max_new_tokens: int = 8) -> int:
        """Decode one short request in every slot to its end and free them: whatever these
        slots' steps run is compiled by it, a run's own jitted steps included (`rehearses`),
        and a run's `warm_up(state)`, where it has one, queues the shapes a short request
        does not reach (speculative KNN-LM's verification search per round length). For
        slots built for this, configured as the serving ones (a run's counters count it;
        the caller closes them). Returns the number of programs that compiled here."""
        n = len(self.engine.compiled.compilations)
        V = int(self.engine.config.vocab_size)
        prompt = [t % V for t in range(1, 17)]  # any ids: only the shapes count
        self.insert(list(range(self.n_slots)), [Request(prompt, GenerationParams(max_new_tokens=max_new_tokens))
                                                     for _ in range(self.n_slots)])
        while self.busy:
            self.step()
        for b in range(self.n_slots):
            self.free(b)
        if callable(getattr(self.run, "warm_up", None)):
            self.run.warm_up(self.state)
        return len(self.engine.compiled.compilations) - n

    def close(self) -> None:
        """Done with these slots: the drafter ends every row, the run stops its workers."""
        self.state.flush()
        if self.drafter is not None:
            self.drafter.end()
        if self.run is not None:
            self.run.close()

    def _event(self, b: int) -> SlotEvent:
        """Slot b's tokens that became final since its last event."""
        r = self.state.rows[b]
        final = len(r.ids) if self.run is None or r.finish is not None else self.run.final_upto(self.state, b)
        tokens, self._sent[b] = list(r.ids[self._sent[b]:final]), max(final, self._sent[b])
        return SlotEvent(b, tokens, None if r.phase is Phase.PREFILLING else r.finish)

    def _forward_chunks(self, slots) -> None:
        """The next block of each prefilling slot's prompt: its cached rows end at
        `lengths[s]` and its root (the last token forwarded, not yet cached) is the prompt's
        token there, so a block forwards prompt[lengths[s]:][:C] (`forward_rows`, which
        reads the cached prefix). A block that reaches the prompt's
        end is the last: the row gets its first token as a whole prefill gives it (same
        position, so the same sampling key) and decodes; otherwise the block's last token
        stays the root (emit=False) and the row still holds prompt[:lengths[s] + 1]."""
        st, C = self.state, self.prefill_chunk
        if self.prefix is not None:  # units cached since, and rows that wait for a unit another computes now
            st.flush()  # (a state edit: a step's deferred bookkeeping first)
            slots = self.prefix.ready(st, slots)
        last, more = [], []
        for s in slots:
            prompt, r = self._prefill[s], st.rows[s]
            if len(prompt) - int(st.lengths[s]) <= C:
                del self._prefill[s]
                r.prompt_ids, r.phase = prompt, Phase.DECODING
                st.finish_s.pop(s, None)
                last.append(s)
            else:
                r.prompt_ids = prompt[:int(st.lengths[s]) + C]
                more.append(s)
        if more:  # (each block's committed unit into the prefix cache)
            forward_rows(self.engine, st, more, emit=False, on_block=self.prefix and self.prefix.save)
        if last:
            if self.prefix is not None:
                self.prefix.done(last)
            forward_rows(self.engine, st, last)
            self._activate(last)

    def _activate(self, slots) -> None:
        """Slots whose first token is out start decoding: the strategy's setup (the first
        time: rows then hold prompts) and the drafter's begin (e.g. a draft model's prefill),
        their time and compilation not counted as decode time (`begin_s`)."""
        st = self.state
        c0, s0, t0 = self.engine.compiled.compile_s, st.compile_s, time.perf_counter()
        self._setup()
        drafting = [s for s in slots if s not in self._plain]
        if self.drafter is not None and drafting:
            by_row = [[] for _ in range(self.n_slots)]
            for s in drafting:
                by_row[s] = self._refs[s]
            if len(drafting) == self.n_slots:  # every row at once (generate): a new batch
                self.drafter.begin(st, by_row)
            else:
                self.drafter.begin(st, by_row, rows=drafting)
        for s in slots:
            self._refs.pop(s, None)
        st.compile_s += self.engine.compiled.compile_s - c0  # the target's (a drafter adds its own)
        self.begin_s = time.perf_counter() - t0 - (st.compile_s - s0)

    # ------------------------------------------------------------------ helpers
    def _setup(self) -> None:
        """The strategy's drafter, rule and budget, once (the first insert, or warm_up)."""
        if not self._set_up:
            self.drafter, self.rule, self.budget = self.strategy.setup(self.engine, self.state, self.drafter, None)
            self._set_up = True
            if self.prefill_chunk is not None and self.run is None:  # a draft model prefills in the
                capacity = self.prefix.cache.capacity if self.prefix is not None else 0  # blocks, cached too
                for d in getattr(self.drafter, "drafters", (self.drafter,)):
                    if callable(getattr(d, "use_prefix", None)):
                        d.use_prefix(self.state, self.prefill_chunk, capacity)

    def _plain_request(self, req: Request) -> bool:
        return req.strategy is not None and req.strategy != self.strategy

    def _check(self, slot: int, req: Request) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is not in [0, {self.n_slots})")
        if self.state.rows[slot].phase is not Phase.FREE:
            raise ValueError(f"slot {slot} holds a request: free({slot}) it first")
        if not isinstance(req.params, GenerationParams):
            raise ValueError(f"Request.params must be a GenerationParams, got {req.params!r}")
        p = req.params
        if self.run is not None and (p.sampling != self.state.sampling or p.penalties != self.state.penalties):
            raise NeedsOwnSlots(f"these slots run strategy {self.strategy.name!r} (retrieval between steps), which "
                             f"decodes with the slots' sampling {self.state.sampling} and penalties "
                             f"{self.state.penalties}: a request with others needs Slots of its own")
        strat = self.strategy if req.strategy is None else req.strategy
        if (p.prompt_logprobs is not None or p.top_logprobs) and self.run is not None:
            raise ValueError(f"these slots run strategy {self.strategy.name!r} (its own steps, retrieved text in "
                             "the prompt): prompt_logprobs and top_logprobs are not served on them")
        if p.logprobs and not self.state.logprobs:
            raise ValueError("these slots were built without log-probabilities (Slots(logprobs=True) keeps them)")
        if p.adjusts_logits and strat is not None and not strat.supports_penalties:
            raise ValueError(f"strategy {strat.name!r} does not apply repetition / presence / frequency penalties "
                             "or logit_bias")
        if self._plain_request(req) and (self.run is not None or req.strategy.runs_own_loop
                                         or req.strategy.drafter(self.engine) is not None):
            only = ("only its own requests" if self.run is not None else "only plain decoding shares them")
            raise NeedsOwnSlots(f"these slots run strategy {getattr(self.strategy, 'name', 'greedy')!r}; a "
                             f"{req.strategy.name!r} request needs Slots of its own ({only})")
        if p.min_new_tokens and not set(p.eos_ids(self.eos_ids)) <= set(self.eos_ids):
            raise NeedsOwnSlots("min_new_tokens bans the slots' eos_ids: a request with other ending ids "
                                "(stop_token_ids, ignore_eos) and min_new_tokens needs Slots of its own")
        ids = list(req.prompt_ids)
        V = self.state.vocab
        p.check_vocab(V)
        if not ids or min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"the prompt must be a non-empty list of token ids in [0, {V})")
        extra = self.run.extra_tokens if self.run is not None else 0
        need = len(ids) + extra + p.max_new_tokens + self.max_nodes + 1
        if need > self.state.max_len:
            note = f" + {self.run.extra_note}" if extra else ""
            raise ValueError(f"the request needs {need} cache slots (prompt {len(ids)}{note} + max_new_tokens "
                             f"{p.max_new_tokens} + {self.max_nodes + 1} for verification) but the slots "
                             f"hold {self.state.max_len}: shorten it or build Slots with a larger max_len")
