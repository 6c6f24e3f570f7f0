"""The step programs a `Slots` runs, listed in one place, and their compilation ahead of
the requests.

A compiled step is one program per shape and static mode. What a configuration can run is
`inventory(slots)`: prefill blocks (Slots with `prefill_chunk`, a retrieval run's too: one
row of exactly the chunk's bucket of tokens, at each of a few attention windows,
committing its last token or not, and the narrower block a short last piece takes,
`DecodeState.tail`; without chunks: one request's whole prompt per prompt
bucket), verify steps (one
per tree size the budget may pick, at each window a step of that size may take: on CPU
with the attention kernel only the whole cache, `Engine.window`) and plain decoding's
multi-token blocks (`device_steps`). Sampling, `min_new_tokens`, each row's values and,
on slots with `penalty_rows` (the server's), penalties and logit biases are data
(`sampling.select_tokens`, `sampling.penalize`, `sampling.add_bias`,
`DecodeState.step_inputs`), so they add no programs; so are top and prompt
log-probabilities on slots that return log-probabilities (the server's: every step
carries them under a `lax.cond`, `DecodeState.step_mode`). A draft model's steps
(SpecInfer) compile in the background at first sight while the steps go without drafts
(`ModelDrafter.propose`); a retrieval run's own steps are rehearsed (below).

The minimum set (`Program.minimum`) is what every request can be served with: plain
decoding at every window it may need and the prefill blocks at the widest window (a block
takes the smallest compiled window that covers it). `warm_up` queues every program's
compilation in the background (`CompiledFunctions.prefetch`), the minimum set first,
and returns once the minimum set is compiled (`wait="minimum"`; "all": every program);
the rest finish while requests are served, and until a tree size is compiled the steps
do without it (`DecodeState.fallback`).

A retrieval run's own jitted steps (KNN-LM's forward, search and mixture, its speculative
rounds; a dense retriever's encoder) are programs the inventory cannot list;
`Slots.rehearse` decodes a short request on slots built like the serving ones (and then
dropped), and the run's `warm_up` queues the shapes it did not meet, so that they are
compiled before anything is served.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from .buckets import PROMPT_BUCKETS
from .decode import extend_block, windows
from .drafts import EMPTY
from .tree import verify_block


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step: `kind` "prefill" (a block of `tokens` prompt tokens per row;
    `emit`: its last token committed and the next one picked), "verify" (a tree block of
    `tokens` = 1 + T) or "steps" (`tokens` = the plain tokens per call); `rows` per call,
    the attention `window`; `minimum`: compiled before anything is served."""

    kind: str
    tokens: int
    rows: int
    window: int
    emit: bool = True
    minimum: bool = False

    def __str__(self) -> str:
        what = {"prefill": f"prefill P={self.tokens}{'' if self.emit else ' (no emit)'}",
                "verify": f"verify T={self.tokens - 1}", "steps": f"steps K={self.tokens}"}[self.kind]
        return f"{what} rows={self.rows} window={self.window}{' [minimum]' if self.minimum else ''}"


def inventory(slots) -> list:
    """Every step program `slots` runs (module docstring), the minimum set first."""
    st, eng = slots.state, slots.engine
    S, B = st.max_len, slots.n_slots
    progs = []
    # a run that picks every token itself (knnlm) prefills without a pick and verifies nothing
    own_picks = slots.run is not None and slots.run.picks_first_token
    if st.block:  # chunked prefill: one row of `block` tokens per call (the batch's own row at B = 1)
        P = st.block
        wins = windows(S, eng, P)
        emits = (False,) if own_picks else (True, False)
        for W in sorted(wins, reverse=True):
            progs += [Program("prefill", P, 1, W, emit, minimum=W == wins[-1]) for emit in emits]
        if st.tail and not own_picks:  # a short last piece's narrower block, at the widest window
            # (any row's; where the CPU kernel runs it, no dearer than a narrower one); until
            # it is compiled, such pieces take the full block
            progs.append(Program("prefill", st.tail, 1, wins[-1], True))
    else:  # one request's whole prompt, per prompt bucket (a fresh prefill reads its own P slots)
        progs += [Program("prefill", P, 1, P, not own_picks, minimum=True)
                  for P in PROMPT_BUCKETS if P + slots.max_nodes + 2 <= S]
    K = slots._block_steps
    if K:
        progs += [Program("steps", K, B, W, minimum=True) for W in windows(S, eng, 1)]
    buckets = () if own_picks else slots.budget.buckets  # (a retrieval run's turns verify with them)
    for T in sorted(buckets):
        progs += [Program("verify", 1 + T, B, W, minimum=T == 0 and not K) for W in windows(S, eng, 1 + T)]
    # the minimum set, then the tree sizes up to 15 (the speedup), the narrower prefill
    # windows (a saving per block), the largest trees (rarely worth it in a full batch)
    return sorted(progs, key=lambda p: 0 if p.minimum else 1 if p.kind != "prefill" and p.tokens <= 16
                  else 2 if p.kind == "prefill" else 3)


def queue(slots, prog: Program, ahead: str = "compile") -> bool:
    """Queue `prog`'s compilation in the background (ahead="compile": whether it was queued
    now), or check whether it is compiled ("check"): the arguments are built as the slots' steps build them (the
    slots' options: log-probabilities, the banned ids; every row's sampling values), only
    their shapes count."""
    from .device_steps import plain_steps_inputs

    st, eng = slots.state, slots.engine
    B = slots.n_slots
    if prog.kind == "prefill":  # one row: the batch's own at B = 1, else a `sel` of one
        group = None if B == 1 else [0]
        block = np.zeros((1, prog.tokens), np.int32)
        n_new = np.ones(1, np.int32)
        return extend_block(eng, st, group, block, n_new, window=prog.window, emit=prog.emit, ahead=ahead)
    if prog.kind == "steps":
        return eng.plain_steps(st.cache, plain_steps_inputs(st, np.ones(B, bool)),
                               st.step_mode(prog.window, steps=prog.tokens), rule=slots.rule, ahead=ahead)
    blk = verify_block(np.zeros(B, np.int32), [EMPTY] * B, prog.tokens - 1)
    return eng.verify(st.cache, st.tree_inputs(blk, np.ones(B, bool)), st.step_mode(prog.window), rule=slots.rule,
                      ahead=ahead)


@dataclasses.dataclass
class WarmUp:
    """Progress of a warm-up: the programs, how many are compiled, since when."""

    programs: list
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    ready: int = 0
    queued: int = 0  # programs this warm-up queued (the others were compiled or queued before)
    keys: list = dataclasses.field(default_factory=list)  # each program's key in the engine's table
    minimum_s: Optional[float] = None  # seconds until the minimum set was compiled
    done_s: Optional[float] = None  # seconds until every program was

    @property
    def total(self) -> int:
        return len(self.programs)

    @property
    def minimum(self) -> int:
        return sum(p.minimum for p in self.programs)


def warm_up(slots, wait: str = "minimum", progress: Optional[Callable[[WarmUp], None]] = None,
            poll: float = 0.05) -> WarmUp:
    """Queue every program of `inventory(slots)` for compilation in the background (the
    minimum set first) and wait for the minimum set (wait="minimum"), every program ("all")
    or nothing ("none"); `progress(warm)` after each program that finished while waiting.
    Returns the `WarmUp`, whose `ready` `track` keeps counting afterwards."""
    if wait not in ("minimum", "all", "none"):
        raise ValueError(f"wait must be 'minimum', 'all' or 'none', got {wait!r}")
    warm = WarmUp(inventory(slots))
    for prog in warm.programs:
        warm.queued += bool(queue(slots, prog, "compile" if prog.minimum or wait == "all" else "later"))
        warm.keys.append(slots.engine.compiled.last_key)
    target = {"minimum": warm.minimum, "all": warm.total, "none": 0}[wait]
    while track(slots, warm, progress) < target:
        time.sleep(poll)
    return warm


def track(slots, warm: WarmUp, progress: Optional[Callable[[WarmUp], None]] = None) -> int:
    """Count the compiled programs of `warm` (the minimum set's first; from any thread:
    their table keys are looked up, nothing is rebuilt); calls `progress` when the count
    moved. Returns how many of the leading programs are compiled."""
    n = 0
    for key in warm.keys:
        if not slots.engine.compiled.done(key, failed=True):
            break
        n += 1
    if n != warm.ready:
        warm.ready = n
        now = time.perf_counter() - warm.t0
        if warm.minimum_s is None and n >= warm.minimum:
            warm.minimum_s = now
        if warm.done_s is None and n == warm.total:
            warm.done_s = now
        if progress is not None:
            progress(warm)
    return n

