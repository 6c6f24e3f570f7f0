"""The decode state's one loop step and its edits; `core.slots.Slots` drives them.

    slots.insert(...)   # forward_rows: the prompt forward, first token per row
    slots.step()        # step: draft -> verify -> commit over the live rows

`DecodeState` (state.py) is everything about one batch in flight: per row the prompt, the
verified generated ids, the finish reason and its text (`RowState`), its sampling
parameters and penalties (host values on the row, arrays on device: `set_row_values`); the
KV cache; the root of every row (its last emitted token, not yet in the cache); the
committed cache length (host mirror of `cache.length`). Invariant per row: cache slots
0..length-1 hold `context[:length]` and `root = context[length]`, where context = prompt +
generated.

The plug-in hooks: what a strategy's `Run` (strategies/base.py), which drives the loop
itself between steps (retrieval-augmented decoding, knnlm), may do to the state:

* `step(engine, state, drafter, rule, budget)`: one verify step of the loop (below).
* `rollback(state, rows, to_length)`: set the rows back to `to_length` committed slots;
  the cache just sets `length` back (slots past it are overwritten later), the generated
  ids are cut to match, the drafter is told.
* `replace_prompt(engine, state, rows, prompts, keep_generated)`: a new prompt for the
  rows (e.g. another retrieved passage before the question), their first generated ids
  kept; the cache keeps the prefix the new context shares with the old one and the rest
  is forwarded (its last token left as the root).
* `accept(state, rows, tokens, cache=)` (with `set_logprob`, `accept_steps`): for a
  strategy whose own jitted step forwards the roots and picks each token (knnlm): commit
  the roots, append the tokens as the new roots.
* `call_compiled`: a strategy's own jitted step, its compilation counted.

One `step`: the drafter proposes a `DraftBatch` for the active rows; the
budget policy caps it (`budget.FixedBudget`, `budget.AutoBudget`); the drafts are packed
with the roots into a static block (`tree.py`) and verified in one jitted forward with the
acceptance rule (`verify.py`, `acceptance.py`); each row keeps its emitted tokens up to
EOS / stop string / max length (`DecodeState.commit`, the one per-row commit, which every
path that adds tokens to a row goes through: prefill, step, plain_steps, a run's `accept`); the drafter
and the budget see the outcome. Greedy is the same loop with no drafter (T = 0).
With `state.overlap` a step's budget scoring and, where `Drafter.defer_update` allows, the
drafter's update (the next draft then uses stores a step behind) run while the next step's forward
computes; `DecodeState.flush` runs them first at every state edit. Same tokens; tree sizes may differ.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from . import tree as tree_lib
from .drafts import DraftBatch
from .multihost import agree_drafts, multiprocess, to_host
from .params import MAX_TOP_LOGPROBS
from .state import DecodeState, StepResult  # noqa: F401 - the loop's state, re-exported
from .verify import WINDOW_MIN, WINDOW_STEP, fit_draft_probs

from .buckets import BLOCK_OVERHEAD_TOKENS, CACHE_ROUND, PROMPT_BUCKETS, prefill_groups, prompt_bucket  # noqa: F401


def timed(engine, state, fn, meanwhile: Optional[Callable[[], None]] = None):
    """Run fn() -> (named result, cache); time it apart from any compilation it triggers.
    meanwhile(): host work run after fn() dispatched the computation (asynchronous) and
    before its result is waited for. Returns (the result as host arrays, the cache,
    seconds, compiled?)."""
    c0, t0 = engine.compiled.compile_s, time.perf_counter()
    out, cache = fn()
    jax.copy_to_host_async(out)  # the copies start as soon as the device is done (a GPU's)
    if meanwhile is not None:
        meanwhile()
    out = to_host(out)  # host values, fetched together (fields not asked for stay None; all processes')
    dc = engine.compiled.compile_s - c0
    state.compile_s += dc
    return out, cache, time.perf_counter() - t0 - dc, dc > 0


def extend_block(engine, state: DecodeState, group, block, n_new, *, window: int, emit: bool, ahead=None,
                 prompt_logprobs: bool = False, top_logprobs: int = 0):
    """`Engine.extend` of one right-padded prefill block over the rows `group` (None: the
    batch's rows, no `sel`) with the state's step inputs cut to them; without `emit` (the
    pick is not kept) no options. prompt_logprobs: also the block's prompt log-probabilities
    (a row's `prompt_logprobs`); top_logprobs: k, the k most likely ids after every
    position (the prompt's alternatives, the first token's). ahead: only check or queue
    its compilation (`Engine._dispatch`)."""
    x = state.scores(state.step_inputs(block, rows=group, options=emit, n_new=n_new),
                     prompt_logprobs or top_logprobs > 0)
    mode = state.step_mode(window, options=emit, emit=emit, prompt_logprobs=prompt_logprobs, top_logprobs=top_logprobs)
    return engine.extend(state.cache, x, mode, ahead=ahead)


def windows(S: int, engine, tokens: int) -> list:
    """Every attention window a step of `tokens` new tokens per row may take in a cache of
    S slots (`Engine.window` over `verify.window_for`'s ladder), smallest first."""
    ladder = {S} | {WINDOW_MIN * WINDOW_STEP ** k for k in range(S.bit_length()) if WINDOW_MIN * WINDOW_STEP ** k < S}
    return sorted({engine.window(w, S, tokens) for w in ladder if w >= tokens or w == S})


def forward_rows(engine, state: DecodeState, rows: list, emit: bool = True, on_block=None) -> np.ndarray:
    """Forward every row's uncommitted context (context[length:]) in right-padded blocks,
    commit it, and append each row's next token. emit=False: the context's last token
    stays uncommitted as the row's root (the next step forwards it), none appended.

    Rows of very different lengths go in separate blocks (`prefill_groups`), each block
    over its rows only: a batch costs about the sum of its rows, not rows x the longest
    (a row's tokens do not depend on its block: the lossless tests compare batches with
    rows alone). When all of the batch's rows share one block it is the plain whole-batch
    step. With `state.block` (Slots' chunked prefill) each row is a block of its own of
    exactly `block` tokens at one of `Engine.window`'s few windows, a longer context in
    pieces of `block` (each but the last commits all its tokens but the last, which the next
    piece forwards again, as Slots' chunks do): a few compiled programs serve every prompt
    length, a retrieval run's re-prefills included. on_block(state, rows, lengths before): called
    after each forward that commits a block without emitting (the prefix cache stores the
    units they commit: `prefix_rows.PrefixRows.save`)."""
    state.flush()  # a step's deferred bookkeeping before the edit
    S = state.max_len
    blocks = {b: state.context(b)[int(state.lengths[b]):] for b in rows}
    need = int(max(state.lengths[b] + len(blk) for b, blk in blocks.items()))
    if need + 1 > S:
        raise ValueError(f"extend needs {need + 1} cache slots but the cache holds {S}")
    C = state.block
    while C and any(len(blk) > C for blk in blocks.values()):  # the long rows' next pieces
        long = {b: blk for b, blk in blocks.items() if len(blk) > C}
        before = state.lengths.copy()
        _forward_blocks(engine, state, {b: blk[:C] for b, blk in long.items()}, emit=False)
        if on_block is not None:
            on_block(state, list(long), before)
        blocks.update({b: blk[C - 1:] for b, blk in long.items()})
    before = state.lengths.copy()
    nxt_all, lps_all, tops_all = _forward_blocks(engine, state, blocks, emit)
    if on_block is not None and not emit:
        on_block(state, list(blocks), before)
    state.steps += 1  # one step of the batch, whatever its blocks (each row forwarded once)
    for b in rows:
        if not emit:  # the context's last token stays the root: a step, nothing to commit
            state.rows[b].steps += 1
            state.root[b] = state.context(b)[-1]
            continue
        state.commit(b, [nxt_all[b]], None if lps_all is None else [lps_all[b]], tops=tops_all.get(b))
    state.mark_finished()
    return nxt_all[rows]


def _forward_blocks(engine, state: DecodeState, blocks: dict, emit: bool):
    """Forward `blocks` (row -> its tokens, from the row's committed length) and commit
    them (emit=False: all but each row's last); returns each row's next token [B] and,
    with emit and log-probabilities, its log-probability [B] (None otherwise)."""
    B, S = state.batch, state.max_len
    rows = list(blocks)
    nxt_all = np.zeros(B, np.int32)
    lps_all = np.zeros(B, np.float32) if emit and state.logprobs else None
    tops_all = {} if emit else None  # row -> its first token's alternatives (rows that keep them)
    groups = [[b] for b in rows] if state.block else prefill_groups({b: len(blk) for b, blk in blocks.items()}, S)
    whole = len(groups) == 1 and len(rows) == B
    for group in groups:
        G = B if whole else len(group)
        at = {b: (b if whole else i) for i, b in enumerate(group)}  # row -> its row in the block
        n_new = np.zeros(G, np.int32)
        for b in group:
            n_new[at[b]] = len(blocks[b])
        start = state.lengths if whole else state.lengths[group]
        upto = int(max(state.lengths[b] + n_new[at[b]] for b in group))
        scoring = any(state.rows[b].prompt_logprobs is not None for b in group)  # (rows that score their prompt)
        # the k most likely ids: a scoring row's alternatives, or the first token's (emit)
        top = MAX_TOP_LOGPROBS if any(state.rows[b].prompt_k for b in group) else state.top_k(group) if emit else 0

        padded = {}  # P -> the group's rows padded to P tokens (built once: fallback checks reuse it)

        def call(P, window, ahead=None, group=group, n_new=n_new, scoring=scoring, top=top, padded=padded):
            if P not in padded:
                padded[P] = np.zeros((G, P), np.int32)
                for b in group:
                    padded[P][at[b], :n_new[at[b]]] = blocks[b]
            return extend_block(engine, state, None if whole else group, padded[P], n_new, window=window,
                                emit=emit, ahead=ahead, prompt_logprobs=scoring, top_logprobs=top)

        def window_of(P):  # a fresh prefill reads only its own P slots; later (and fixed) blocks the prefix too
            return P if not start.any() and not state.block else engine.window(max(upto, P), S, P)

        P = min(max(prompt_bucket(int(n_new.max()), S), state.block), S)
        # a prompt's last piece, when short, in the narrower block (`DecodeState.tail`)
        Ps = ([state.tail] if emit and int(n_new.max()) <= state.tail < P else []) + [P]
        P, window = Ps[0], window_of(Ps[0])
        if state.block and state.fallback:  # the narrowest block, smallest window, that is compiled
            P, window = next(((p, w) for p in Ps for w in windows(S, engine, p) if w >= window_of(p)
                              and call(p, w, "check")), (Ps[-1], window_of(Ps[-1])))
        out, state.cache, _, _ = timed(engine, state, lambda: call(P, window))
        for b in group:
            nxt_all[b] = out.tokens[at[b]]
            if lps_all is not None:
                lps_all[b] = out.logprobs[at[b]]
            i = at[b]
            if scoring:
                state.rows[b].record_prompt_logprobs(int(state.lengths[b]), out.prompt_logprobs[i][:n_new[i]],
                                                     *((out.top_logprobs[i], out.top_ids[i]) if top else ()))
            if emit and top and tops_all is not None:  # the first token was chosen after the block's last
                tops_all[b] = state.tops(b, out.top_ids[i], out.top_logprobs[i], [int(n_new[i]) - 1])
        lengths = state.lengths.copy()
        for b in group:
            lengths[b] += n_new[at[b]] if emit else max(int(n_new[at[b]]) - 1, 0)
        state.lengths = lengths
    return nxt_all, lps_all, tops_all


def accept(state: DecodeState, rows: Sequence[int], tokens, logprobs=None, cache=None) -> list:
    """Commit each row's root and append the token picked after it, for a strategy whose own
    jitted step forwards the roots and picks the tokens (knnlm). cache: that step's cache
    (it donated `state.cache`), its length advanced for `rows`: one step, counted. None:
    the roots' K/V are already in `state.cache` at slot `lengths[b]` (e.g. after `rollback`
    to that slot, to replace the token picked there): the length advances, no step is
    counted. tokens[i] is cut at EOS / stop / length as every step's (`RowState.accept`).
    Returns the ids each row kept."""
    state.flush()  # a step's deferred bookkeeping before the edit
    rows = [int(b) for b in rows]
    if len(tokens) != len(rows) or any(state.rows[b].finish for b in rows):
        raise ValueError(f"accept: {len(rows)} live rows need as many tokens, got {len(tokens)} "
                         f"(finished: {[b for b in rows if state.rows[b].finish]})")
    lengths = state.lengths.copy()
    lengths[rows] += 1
    state.lengths = lengths
    if cache is not None:
        state.cache, state.steps = cache, state.steps + 1
    else:
        state.cache = state.cache.replace(length=state.cache.length.at[np.asarray(rows)].add(1))
    kept = [state.commit(b, [int(tokens[i])], None if logprobs is None else [float(logprobs[i])],
                         steps=int(cache is not None)) for i, b in enumerate(rows)]
    state.mark_finished()
    return kept


def accept_steps(state: DecodeState, active, tokens, logprobs, cache) -> None:
    """Commit s steps a strategy's own jitted calls ran unseen by the host (knnlm's round):
    active [s,B] the rows each step forwarded, tokens / logprobs [s,B]; cache: the last
    step's (a row's length advanced per step it was active). Each row takes its tokens in
    order up to its finish (EOS / stop / length), one step each, as `accept`; what it ran
    past its finish is dropped (its cache length set back to the slots it committed)."""
    active = np.asarray(active, bool)
    ran = state.lengths + active.sum(axis=0)  # the cache's lengths after the steps
    if any(state.rows[b].finish for b in np.flatnonzero(active.any(axis=0))):
        raise ValueError("accept_steps: a finished row cannot step")
    for t in range(len(active)):  # each step as `accept` commits it, its rows that have not finished
        rows = [b for b in np.flatnonzero(active[t]) if not state.rows[b].finish]
        accept(state, rows, [tokens[t][b] for b in rows],
               None if logprobs is None else [logprobs[t][b] for b in rows], cache=cache)
    short = np.flatnonzero(state.lengths != ran)
    if len(short):
        state.cache = cache.replace(length=cache.length.at[short].set(state.lengths[short]))


def set_logprob(state: DecodeState, b: int, i: int, value: float) -> None:
    """Replace the log-probability of row b's generated id i (e.g. knnlm's, re-derived with
    the true neighbours); nothing when the row keeps none."""
    if state.rows[b].logprobs is not None:
        state.rows[b].logprobs[i] = float(value)


def call_compiled(engine, state: DecodeState, name: str, fn, *args, **static):
    """`engine.compiled(name, fn, ...)` for a strategy's own jitted step; its compilation
    counted as the state's (kept out of decode time)."""
    c0 = engine.compiled.compile_s
    out = engine.compiled(name, fn, *args, **static)
    state.compile_s += engine.compiled.compile_s - c0
    return out


def rollback(state: DecodeState, rows: Sequence[int], to_length: int, drafter=None) -> None:
    """Set `rows` back to `to_length` committed cache slots: the cache's length is set
    back (no copy: slots past it are overwritten by later steps), the generated ids are
    cut so that the row's root is context[to_length] again, and the drafter is told.
    `to_length` must leave the prompt's last token as the earliest root
    (len(prompt) - 1 <= to_length <= current length)."""
    state.flush()  # a step's deferred bookkeeping before the edit
    rows = list(rows)
    for b in rows:
        r = state.rows[b]
        if not len(r.prompt_ids) - 1 <= to_length <= state.lengths[b]:
            raise ValueError(f"rollback of row {b} to {to_length}: must be in "
                             f"[{len(r.prompt_ids) - 1}, {int(state.lengths[b])}] (prompt .. committed)")
        r.truncate(to_length + 1 - len(r.prompt_ids))
        state.root[b] = state.context(b)[to_length]
        state.finish_s.pop(b, None)
    lengths = state.lengths.copy()
    lengths[rows] = to_length
    state.lengths = lengths
    state.cache = state.cache.replace(length=state.cache.length.at[np.asarray(rows)].set(to_length))
    if drafter is not None:
        drafter.rollback(rows, to_length)


def replace_prompt(engine, state: DecodeState, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                   keep_generated: Sequence[int], drafter=None) -> np.ndarray:
    """Give row `rows[i]` the prompt `prompts[i]` and keep its first `keep_generated[i]`
    generated ids; its new context but the last token is put in the cache and the last
    token becomes the root: the row is live again, where decoding the new prompt had left
    it after those ids, and the next step picks its next token (so rows edited here stay
    in step with the others). For retrieval-augmented decoding, whose passage sits before
    the question and changes while decoding.

    The cache keeps the longest common prefix of the row's old cached context (the tokens
    in its slots, context[:length]) and the new context, at most all of it but the root
    (the prompt head before a passage: chat template, instruction); the row's length is
    set back to it (the slots past it are overwritten) and only the rest is forwarded, in
    right-padded blocks from each row's kept length (`forward_rows`, as a chunked prefill): the
    K/V of a prefill of the whole new context from slot 0 (to float rounding, as a
    chunked prefill's). A row whose whole new
    context but the root is kept (e.g. the same prompt with fewer generated ids) is set
    back without a forward. The drafter is told each row's kept length
    (`rollback([b], kept)`). Returns the kept slots of each row [len(rows)] (the re-prefill
    forwarded the context past them, len(context) - kept tokens with the root).

    With a prefix cache (`state.prefix`), a re-prefill starts at the unit boundary below the
    kept prefix where the new context's cached units follow it (written in first:
    `PrefixRows.take`, e.g. a passage another row had after the same head) or where starting
    there costs no extra block; the units its blocks commit are then stored. Kept counts
    them.

    A kept id must not end the row (EOS), and keep_generated[i] < the row's max_new_tokens;
    the context + 1 slot must fit the cache (an error before anything changes)."""
    state.flush()  # a step's deferred bookkeeping before the edit
    rows = [int(b) for b in rows]
    if not len(prompts) == len(keep_generated) == len(rows) or len(set(rows)) != len(rows):
        raise ValueError(f"replace_prompt: {len(rows)} distinct rows need as many prompts and keep counts "
                         f"(got {len(prompts)} and {len(keep_generated)})")
    for b, p, g in zip(rows, prompts, keep_generated):
        r = state.rows[b]
        if not len(p):
            raise ValueError(f"replace_prompt: empty prompt for row {b}")
        if not 0 <= g <= len(r.ids) or g >= r.max_new:
            raise ValueError(f"replace_prompt: row {b} can keep 0..{min(len(r.ids), r.max_new - 1)} generated "
                             f"ids, not {g}")
        if any(t in r.eos_ids for t in r.ids[:g]):
            raise ValueError(f"replace_prompt: row {b}'s first {g} generated ids hold an EOS")
        if len(p) + g + 1 > state.max_len:
            raise ValueError(f"replace_prompt: row {b} needs {len(p) + g + 1} cache slots (prompt {len(p)} + "
                             f"{g} generated + 1) but the cache holds {state.max_len}")
    kept = np.zeros(len(rows), np.int64)
    for i, (b, p, g) in enumerate(zip(rows, prompts, keep_generated)):
        new = [int(t) for t in p] + state.rows[b].ids[:g]
        # the tokens in its slots (a row cut short by EOS / stop counts more slots than its context)
        kept[i] = common_prefix(state.context(b)[:int(state.lengths[b])], new[:-1])
        state.rows[b].prompt_ids = new[:len(p)]
        state.rows[b].truncate(g)
        state.finish_s.pop(b, None)
        if state.prefix is not None and kept[i] < len(new) - 1:  # the prefix cache: from a unit
            kept[i] = state.prefix.take(state, b, int(kept[i]))  # boundary, its cached units taken
    lengths = state.lengths.copy()
    lengths[rows] = kept
    state.lengths = lengths
    state.cache = state.cache.replace(length=state.cache.length.at[np.asarray(rows)].set(
        np.asarray(kept, np.int32)))
    if drafter is not None:
        for n in sorted(set(kept.tolist())):
            drafter.rollback([b for b, k in zip(rows, kept) if k == n], int(n))
    todo = [b for b, k in zip(rows, kept) if k < len(state.context(b)) - 1]
    if todo:
        forward_rows(engine, state, todo, emit=False, on_block=state.prefix and state.prefix.save)
    if state.prefix is not None:
        state.prefix.done(rows)
    for b in rows:  # the invariant: slots hold context[:length], root = context[length]
        state.root[b] = state.context(b)[-1]
        assert state.lengths[b] == len(state.context(b)) - 1
    return kept


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


# ----------------------------------------------------------------------------- the step
def step(engine, state: DecodeState, drafter, rule, budget) -> StepResult:
    """One propose -> verify -> accept over the active rows (there must be one): the
    drafter proposes, the budget caps it, the block is verified in one forward, each row
    keeps its tokens, the drafter and the budget see the outcome."""
    B, S = state.batch, state.max_len
    active = state.active
    h0 = time.perf_counter()
    n = budget.propose_nodes(state) if drafter is not None else 0
    drafts = drafter.propose(state, n) if n else DraftBatch.empty(B)
    drafts = drafts.truncated(budget.plan(drafts, state))
    T = tree_lib.bucket_for(drafts.max_nodes, budget.buckets)
    L = int(state.lengths[active].max())  # the longest active row's cached slots
    top_k = state.top_k(np.flatnonzero(active))  # alternatives of each token, where a row keeps them
    x = state.scores(state.step_inputs(None, active=active), top_k > 0)  # the block's arrays per bucket, below

    def verify(T2, blk=None, ahead=None):  # the verify step of bucket T2 (blk None: an empty tree's shapes)
        blk = tree_lib.verify_block(state.root, DraftBatch.empty(B).drafts, T2) if blk is None else blk
        inputs = x.with_block(blk)._replace(draft_probs=fit_draft_probs(drafts.probs, T2))
        return engine.verify(state.cache, inputs, state.step_mode(engine.window(L + 1 + T2, S, 1 + T2),
                                                                  top_logprobs=top_k), rule=rule,
                             ahead=ahead)

    window = engine.window(L + 1 + T, S, 1 + T)
    if state.fallback and T and (T, window) not in state.ready:
        # never wait for a tree size: the largest compiled one; T compiles in the background
        ready = next((T2 for T2 in sorted(budget.buckets, reverse=True) if 0 < T2 <= T and verify(T2, ahead="check")), 0)
        if ready != T:
            verify(T, ahead="compile")
            drafts, T = drafts.truncated(ready), ready
            window = engine.window(L + 1 + T, S, 1 + T)
        state.ready |= {(T, window)} if T else set()
    # process 0's drafts and tree size on every process (the step's broadcast point; a drafter
    # that runs programs, SpecInfer's draft model, has its budget's choice agreed before: `agree_choice`)
    if drafter is not None and multiprocess():
        drafts, T = agree_drafts(drafts, T)
        window = engine.window(L + 1 + T, S, 1 + T)
    blk = tree_lib.verify_block(state.root, drafts.drafts, T)
    state.host_s += time.perf_counter() - h0
    state.tree_sizes.append(T)
    if window not in state.windows:  # the budget's other buckets are likely soon: loaded meanwhile
        state.windows.add(window)
        for T2 in (b for b in budget.buckets if b != T):
            verify(T2, ahead="load")
    out, state.cache, seconds, compiled = timed(engine, state, lambda: verify(T, blk), meanwhile=state.flush)
    emitted, n_emit, path, lps = out.tokens, out.n, out.path, out.logprobs
    h0 = time.perf_counter()
    if not compiled:  # real step times correct the calibration
        budget.record(T, window, seconds)
    state.lengths = state.lengths + n_emit
    state.steps += 1
    kept = [[] for _ in range(B)]
    for b in np.flatnonzero(active):
        n = int(n_emit[b])
        kept[b] = state.commit(b, emitted[b, :n], None if lps is None else lps[b, :n],
                               tops=state.tops(b, out.top_ids[b], out.top_logprobs[b], range(n)) if top_k else None)
    result = StepResult(emitted, n_emit, path, kept, T, window,
                        np.array([len(d) for d in drafts.drafts], np.int32))
    defer = state.overlap and getattr(drafter, "defer_update", False)  # `Drafter.defer_update`
    if drafter is not None and not defer:
        drafter.update(state, result)
    if state.overlap:  # run while the next step computes (or at the next flush)
        def bookkeeping():
            if defer:
                drafter.update(state, result)
            budget.score(state)
        state.deferred = bookkeeping
    else:
        budget.score(state)
    state.host_s += time.perf_counter() - h0
    state.mark_finished()
    return result
