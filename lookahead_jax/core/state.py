"""The decode state: one batch in flight (`DecodeState`) and what one verify step did to
it (`StepResult`). The loop and the state edits are in `decode.py`, which re-exports both;
every commit of a row's emitted tokens goes through `DecodeState.commit`.

Per row: the prompt, the verified generated ids, the finish reason and its text
(`RowState`), its sampling parameters, penalties and logit bias (host values on the
row, arrays on device: `set_row_values`); the KV cache; the root of every row (its last emitted token,
not yet in the cache); the committed cache length (host mirror of `cache.length`).
Invariant per row: cache slots 0..length-1 hold `context[:length]` and
`root = context[length]`, where context = prompt + generated.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import numpy as np

from .inputs import StepInputs, StepMode
from .params import MAX_TOP_LOGPROBS
from .sampling import Penalties, RowBias, RowPenalties, RowSampling, SamplingParams


# ----------------------------------------------------------------------------- state
@dataclasses.dataclass
class StepResult:
    """What one verify step did, per row (host arrays): `emitted[b, :n_emit[b]]` the
    tokens it produced, `kept[b]` those the row kept (cut at EOS / stop / length; [] for
    inactive rows), `path[b]` the block indices of the accepted path (root first)."""

    emitted: np.ndarray  # [B,1+T]
    n_emit: np.ndarray  # [B]
    path: np.ndarray  # [B,1+T]
    kept: list
    T: int
    window: int
    drafted: Optional[np.ndarray] = None  # [B] draft nodes each row was verified with (after the budget)


@dataclasses.dataclass
class DecodeState:
    rows: list  # RowState per batch row
    cache: object  # KVCache
    lengths: np.ndarray  # [B] committed cache slots (host mirror of cache.length)
    root: np.ndarray  # [B] int32 last emitted token of each row (not yet in the cache)
    seeds: object  # [B] uint32 (device)
    rowids: object  # [B] int32 sampling row of each row (device)
    sampling: SamplingParams  # the rows' default (a row's own: RowState.sampling)
    max_len: int  # cache slots S
    # options every step applies alike (verify.py): min_new_tokens bans `ban` (EOS + stop
    # ids) until that many tokens are out; logprobs returns each emitted token's
    # log-probability; penalties (repetition / presence / frequency) over a vocabulary of
    # `vocab` ids
    min_new: int = 0
    ban: tuple = ()
    logprobs: bool = False
    # with logprobs: top / prompt log-probabilities on demand, in every step's program
    # (`step_mode`); False: in programs of their own, compiled when a request asks
    scores_on_demand: bool = True
    penalties: Penalties = Penalties()  # the rows' default (a row's own: RowState.penalties)
    vocab: int = 0
    # every row's sampling values, penalties and logit bias as device arrays (`set_row_values`)
    row_sampling_values: Optional[RowSampling] = None
    row_penalty_values: Optional[RowPenalties] = None
    row_bias_values: Optional[RowBias] = None
    # bookkeeping of the call (wall times exclude compilation)
    steps: int = 0
    tree_sizes: list = dataclasses.field(default_factory=list)
    host_s: float = 0.0
    prefill_s: float = 0.0
    # generate's prefill of its prompts: the steps it took, and per row (by index) the
    # forward steps and tokens it gave (1 and 1; knnlm: 1 and 0, it picks the first token
    # in a step of its own): decode steps and tokens are the rest
    prefill_steps: int = 0
    prefill_rows: dict = dataclasses.field(default_factory=dict)
    t_start: float = 0.0
    compile_s: float = 0.0  # compilation seen since t_start
    windows: set = dataclasses.field(default_factory=set)  # attention windows steps have used
    finish_s: dict = dataclasses.field(default_factory=dict)
    # block > 0: every prefill block is one row of exactly `block` tokens at one of the few
    # windows (`decode.forward_rows`): Slots with prefill_chunk, whose chunks then run a few
    # compiled steps whatever the prompts' lengths; 0: blocks sized to their rows
    block: int = 0
    # tail: with block, the narrower block (`buckets.tail_bucket`) a prompt's last piece
    # (a block that emits) of at most that many tokens is forwarded in; 0: none
    tail: int = 0
    # prefix: with block, the slots' side of the engine's prefix cache (`prefix_rows.PrefixRows`)
    # when it is on: a retrieval run's prompts and re-prefills take and give blocks through it
    # (`decode.replace_prompt`); None: off
    prefix: object = None
    # fallback: a step never waits for a program it can do without: a tree size not compiled
    # yet gives way to the largest that is (it compiles in the background meanwhile), a
    # prefill block takes the smallest compiled window that covers it (`decode.step`,
    # `forward_rows`); the tokens are the same. Off: compiled in place (exact step counts)
    fallback: bool = False
    ready: set = dataclasses.field(default_factory=set)  # (T, window) of verify steps found compiled
    # overlap: a step's bookkeeping runs while the next step's forward computes (`step`)
    overlap: bool = False
    deferred: Optional[Callable[[], None]] = None
    # penalty_rows: every step but plain_steps' carries each row's penalties as data, rows
    # without any at their neutral values (the step skips the work when no row has any:
    # `sampling.penalize`), so requests with and without penalties share one compiled
    # step (a server's slots: a request's penalties never compile a program of their own);
    # so does each row's logit bias (`step_bias`), all zeros where a request has none
    penalty_rows: bool = False
    _zeros: dict = dataclasses.field(default_factory=dict, repr=False)  # (shape, dtype) -> host zeros

    def flush(self) -> None:
        """Run the bookkeeping a step deferred (`overlap`); every state edit between steps
        and the end of decoding call this first."""
        if self.deferred is not None:
            fn, self.deferred, h0 = self.deferred, None, time.perf_counter()
            fn()
            self.host_s += time.perf_counter() - h0

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def active(self) -> np.ndarray:
        return np.array([r.live for r in self.rows])

    def context(self, b: int) -> list:
        """Prompt + generated ids of row b (its last token is the root)."""
        return self.rows[b].prompt_ids + self.rows[b].ids

    def sampling_of(self, b: int) -> SamplingParams:
        s = self.rows[b].sampling
        return self.sampling if s is None else s

    def penalties_of(self, b: int) -> Penalties:
        p = self.rows[b].penalties
        return self.penalties if p is None else p

    def set_row_values(self, put) -> None:
        """Every row's sampling values and penalties (its own, else the defaults) and logit
        bias onto the device (`put`, e.g. `Engine.put`): after prefill, and when requests
        enter rows."""
        B = self.batch
        self.row_sampling_values = RowSampling.of([self.sampling_of(b) for b in range(B)], put=put)
        self.row_penalty_values = RowPenalties.of([self.penalties_of(b) for b in range(B)], put=put)
        self.row_bias_values = RowBias.of([self.rows[b].logit_bias for b in range(B)], put=put)

    def row_sampling(self, rows=None) -> Optional[RowSampling]:
        """Each row's sampling for a step over `rows` (default: the batch; a list: a block
        of those rows only, host arrays): None when every live one of them is greedy (the
        argmax path), else their values with the mode (`filter`) of the live sampled ones.
        Values are arrays: changing them never recompiles; the mode does (3 variants)."""
        idx = range(self.batch) if rows is None else rows
        live = [self.sampling_of(b) for b in idx if self.rows[b].live]
        sampled = [p for p in live if not p.greedy]
        if not sampled:
            return None
        if self.row_sampling_values is None:  # (a state built without set_row_values)
            self.set_row_values(np.asarray)
        vals = self.row_sampling_values
        if rows is not None:
            vals = jax.tree.map(lambda x: np.asarray(x)[np.asarray(rows)], vals)
        return dataclasses.replace(vals, filter=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled))

    def step_sampling(self, rows=None) -> RowSampling:
        """Each row's sampling values for a step over `rows` (default: the batch; a list: a
        block of those rows only, host arrays), greedy rows' included, whatever the mode:
        the step reads on the device whether a row samples and whether one cuts
        (`sampling.select_tokens`), so greedy, sampled and top-k / top-p batches run one
        compiled step (`row_sampling`, which leaves greedy batches without values, is a
        draft model's own step's)."""
        if self.row_sampling_values is None:  # (a state built without set_row_values)
            self.set_row_values(np.asarray)
        vals = self.row_sampling_values
        if rows is not None:
            vals = jax.tree.map(lambda x: np.asarray(x)[np.asarray(rows)], vals)
        return dataclasses.replace(vals, filter=True)

    def row_penalties(self) -> Optional[RowPenalties]:
        """Each row's penalties for a step (None: no live row has any); static only which
        of `seen` / `counts` some live row needs (both with `penalty_rows`, so the step's
        program does not depend on which)."""
        live = [self.penalties_of(b) for b in range(self.batch) if self.rows[b].live]
        used = [p for p in live if p.on]
        if not used:
            return None
        if self.row_penalty_values is None:
            self.set_row_values(np.asarray)
        every = self.penalty_rows
        return dataclasses.replace(self.row_penalty_values, uses_context=every or any(p.uses_context for p in used),
                                   uses_counts=every or any(p.uses_counts for p in used))

    def step_penalties(self, rows=None) -> dict:
        """The penalty fields of a step over `rows` (default: the batch; a list: a prefill
        block of those rows only): `penalties` with `seen` / `counts` as each row's context
        stands (prompt + generated, its last token the root or the last token an extend
        forwards), recounted every step, so rollback / replace_prompt / extend need no
        bookkeeping: seen[b, t] = t occurs in it, counts[b, t] = how often t occurs in the
        generated ids. {} when no live row has penalties, unless `penalty_rows`: then
        every row's values (neutral ones leave its logits exactly as they are) with zero
        seen / counts, host arrays built once per shape."""
        pen = self.row_penalties()
        if pen is None and not self.penalty_rows:
            return {}
        idx = list(range(self.batch)) if rows is None else [int(b) for b in rows]
        G, V = len(idx), self.vocab
        zero = pen is None  # nobody has penalties: the step's cond skips them (no host work)
        if zero:
            if self.row_penalty_values is None:
                self.set_row_values(np.asarray)
            pen = dataclasses.replace(self.row_penalty_values, uses_context=True, uses_counts=True)
        if rows is not None:  # the block's rows' values
            pen = jax.tree.map(lambda a: np.asarray(a)[np.asarray(idx)], pen)
        if zero:
            return dict(penalties=pen, seen=self._zero((G, V), bool), counts=self._zero((G, V), np.int32))
        out = dict(penalties=pen)
        if pen.uses_context:
            seen = np.zeros((G, V), bool)
            for g, b in enumerate(idx):
                seen[g, np.asarray(self.context(b), np.int64)] = True
            out["seen"] = seen
        if pen.uses_counts:
            out["counts"] = np.stack([np.bincount(np.asarray(self.rows[b].ids, np.int64), minlength=V)[:V]
                                      for b in idx]).astype(np.int32)
        return out

    def step_bias(self) -> dict:
        """The bias field of a step: every row's logit_bias (`sampling.RowBias`, one shape:
        [B, MAX_LOGIT_BIAS]) when some live row has one, and always with `penalty_rows`
        (one program for requests with and without: the step skips the work where every
        bias is 0); else {} (no bias in the step)."""
        if not self.penalty_rows and not any(r.logit_bias for r in self.rows if r.live):
            return {}
        if self.row_bias_values is None:  # (a state built without set_row_values)
            self.set_row_values(np.asarray)
        return dict(bias=self.row_bias_values)

    def _zero(self, shape: tuple, dtype) -> np.ndarray:
        key = (shape, np.dtype(dtype).str)
        if key not in self._zeros:
            self._zeros[key] = np.zeros(shape, dtype)
        return self._zeros[key]

    def suppress(self) -> Optional[np.ndarray]:
        """[B] int32 each row's position below which a token's successor may not be a `ban`
        id: len(prompt) + min_new - 1 (None: no ban ids). It goes with every step that has
        ban ids, min_new_tokens or not (a row without it has suppress = len(prompt) - 1,
        below which no position it picks at lies): min_new_tokens is data, one compiled step
        for requests with and without it."""
        if not self.ban:
            return None
        return np.array([len(r.prompt_ids) + r.min_new - 1 for r in self.rows], np.int32)

    def step_inputs(self, tokens, rows=None, options: bool = True, **block) -> StepInputs:
        """This step's `inputs.StepInputs`: the block (`tokens` and `block`'s arrays: a
        prefill's n_new, or a tree's parent / depth / mask and active: `tree_inputs`) with
        each row's seed, id and sampling values (`step_sampling`) and, with `options`, the
        options' arrays: `suppress`, each row's logit bias (`step_bias`) and penalties
        (`step_penalties`). rows: a
        prefill block of those rows only (`StepInputs.rows`: `tokens` and n_new have their
        rows, everything else is cut to them)."""
        x = StepInputs(tokens, self.seeds, self.rowids, sampling=self.step_sampling(), **block)
        if self.logprobs and self.scores_on_demand:  # (`step_mode`): the caller sets whether its rows ask
            x = x._replace(scores=np.False_)
        pen = {}
        if options:
            x = x._replace(suppress=self.suppress(), **self.step_bias())
            pen = self.step_penalties(rows)
        x = x if rows is None else x.rows(rows)
        return x._replace(**pen)

    def tree_inputs(self, block, active, **fields) -> StepInputs:
        """`step_inputs` of a verify step of the packed `tree.VerifyBlock` `block` (fields:
        e.g. draft_probs, or plain_steps' remaining / stop_ids)."""
        return self.step_inputs(None, active=active, **fields).with_block(block)

    def step_mode(self, window: int, options: bool = True, *, top_logprobs: int = 0,
                  prompt_logprobs: Optional[bool] = None, **static) -> StepMode:
        """This step's `inputs.StepMode`: the window, and with `options` the rows' ban ids
        and whether they return log-probabilities (`static`: e.g. emit, steps).
        top_logprobs: the alternatives the step's rows ask for (`top_k`); prompt_logprobs:
        a prefill block's, whether one of its rows scores its prompt (None: not a prefill).
        Slots that return log-probabilities (`logprobs`, the server's) serve both on
        demand: every step but plain_steps' is compiled with MAX_TOP_LOGPROBS alternatives
        (and a prefill with its prompt's log-probabilities), and the inputs' `scores`
        (`scores`) say whether a step computes them, so a request that asks compiles
        nothing of its own."""
        if self.logprobs and self.scores_on_demand and not static.get("steps"):
            top_logprobs = MAX_TOP_LOGPROBS
            prompt_logprobs = None if prompt_logprobs is None else True
        if prompt_logprobs:
            static["prompt_logprobs"] = True
        static["top_logprobs"] = top_logprobs
        if not options:
            return StepMode(window=window, **static)
        return StepMode(window=window, ban=tuple(int(t) for t in self.ban), logprobs=bool(self.logprobs), **static)

    @staticmethod
    def scores(inputs: StepInputs, wanted: bool) -> StepInputs:
        """`inputs` computing its mode's top / prompt log-probabilities or not (`wanted`:
        some row of the step asks), where the slots serve them on demand (`step_mode`)."""
        return inputs if inputs.scores is None else inputs._replace(scores=np.bool_(bool(wanted)))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start - self.compile_s

    def top_k(self, rows) -> int:
        """The alternatives a step over `rows` returns per token: MAX_TOP_LOGPROBS where one
        of them asks for some (`RowState.top_k`; one program however many), else 0."""
        return MAX_TOP_LOGPROBS if any(self.rows[b].top_k for b in rows) else 0

    def tops(self, b: int, top_ids, top_lps, positions) -> Optional[list]:
        """Row b's (id, log-probability) pairs at `positions` of a step's top_ids / top_lps
        [.., k] (None unless the row keeps them)."""
        if not self.rows[b].top_k or top_ids is None:
            return None
        return [list(zip(top_ids[p].tolist(), top_lps[p].tolist())) for p in positions]

    def commit(self, b: int, tokens, logprobs=None, *, steps: int = 1, each: bool = False, tops=None) -> list:
        """The one commit of a row's tokens (prefill, a verify step, plain_steps' block, a
        run's `accept`): row b takes `tokens` (what its forward emitted, with their
        log-probabilities where kept) up to EOS / stop string / max length
        (`RowState.accept`, which also streams text), `steps` forward steps are counted on
        it, and the last token emitted is its new root (not yet in the cache). each: token
        by token, one step each, up to its finish (a block of plain steps hands them over as
        single steps would: stop strings, streaming). The caller advances `lengths` and
        then calls `mark_finished`. tops: per token its (ids, log-probabilities) of the most
        likely, for a row that keeps them. Returns the tokens the row kept."""
        r = self.rows[b]
        if each:
            kept = []
            for j in range(len(tokens)):
                r.steps += 1
                kept += r.accept(tokens[j:j + 1], None if logprobs is None else logprobs[j:j + 1],
                                 None if tops is None else tops[j:j + 1])
                if r.finish:
                    break
        else:
            r.steps += steps
            kept = r.accept(tokens, logprobs, tops)
        self.root[b] = tokens[-1]
        return kept

    def mark_finished(self) -> None:  # the finish time of rows that just finished
        for r in self.rows:
            if r.finish and r.index not in self.finish_s:
                self.finish_s[r.index] = self.elapsed()
