"""Plain decoding, several steps per device call (`Greedy(device_steps=K)`): the one
shortcut beside the loop's `step` (decode.py). Up to K verify steps of a root-only block
run in one `lax.while_loop` on the device (`verify.plain_steps`); each row stops there at
its EOS ids or its length, and the host hands the block's tokens to the rows one by one,
as K single steps would."""

from __future__ import annotations

import time

import numpy as np

from . import tree as tree_lib
from .decode import DecodeState, StepResult, timed
from .drafts import DraftBatch
from .inputs import StepInputs


def plain_steps_inputs(state: DecodeState, active) -> StepInputs:
    """The `inputs.StepInputs` of `Engine.plain_steps` over the `active` rows: the roots'
    block, each row's seed, id and sampling values, its ban's positions, remaining [B]
    tokens it may still emit and stop_ids [B,E] its EOS ids, -1 padded."""
    B = state.batch
    remaining = np.zeros(B, np.int32)
    stops = [()] * B
    for b in np.flatnonzero(active):
        r = state.rows[b]
        remaining[b] = max(0, r.max_new - len(r.ids))
        stops[b] = sorted(int(t) for t in r.eos_ids)
    E = max(8, 1 << max(0, max(len(x) for x in stops) - 1).bit_length())  # one shape for most models' EOS sets
    stop_ids = np.full((B, E), -1, np.int32)
    for b, ids in enumerate(stops):
        stop_ids[b, :len(ids)] = ids
    blk = tree_lib.verify_block(state.root, DraftBatch.empty(B).drafts, 0)
    if state.row_penalties() is not None:
        raise ValueError("plain_steps takes no penalties: decode with step()")
    x = state.tree_inputs(blk, active, remaining=remaining, stop_ids=stop_ids)
    return x._replace(penalties=None, seen=None, counts=None)  # (`penalty_rows`' neutral ones)


def plain_steps(engine, state: DecodeState, rule, steps: int) -> StepResult:
    """Up to `steps` plain decode steps (no drafts) over the active rows in one device call
    (`Engine.plain_steps`, a `lax.while_loop`): each row stops on the device at one of its
    EOS ids or its max_new_tokens, the host takes the tokens once (stop strings cut there,
    as after single steps: each row takes the block's tokens one by one). The same tokens
    (and per-row forward steps) as `steps` calls of `step` without a drafter; the host and
    the device meet once per block instead of once per token; `state.steps` counts the
    loop's iterations (a row cut by a stop string mid-block leaves the rest computed). Not with
    penalties (their counts change every token: use `step`). Returns the block as one
    StepResult (emitted [B,steps], n_emit the tokens each row took, T = 0)."""
    B, S = state.batch, state.max_len
    active = state.active
    h0 = time.perf_counter()
    x = plain_steps_inputs(state, active)
    need = max(int(state.lengths[b]) + min(steps, int(x.remaining[b])) for b in np.flatnonzero(active))
    mode = state.step_mode(engine.window(max(need, 1), S, 1), steps=steps)
    state.host_s += time.perf_counter() - h0
    out, state.cache, _, _ = timed(engine, state, lambda: engine.plain_steps(state.cache, x, mode, rule=rule))
    h0 = time.perf_counter()
    emitted, n_emit, lps = out.tokens, out.n, out.logprobs
    state.lengths = state.lengths + n_emit
    state.steps += int(n_emit.max(initial=0))
    state.tree_sizes += [0] * int(n_emit.max(initial=0))
    kept = [[] for _ in range(B)]
    for b in np.flatnonzero(n_emit):  # token by token, as single steps hand them over (stop strings, streaming)
        n = int(n_emit[b])
        kept[b] = state.commit(b, emitted[b, :n], None if lps is None else lps[b, :n], each=True)
    state.host_s += time.perf_counter() - h0
    state.mark_finished()
    return StepResult(emitted, n_emit, np.zeros_like(emitted), kept, 0, mode.window, np.zeros(B, np.int32))
