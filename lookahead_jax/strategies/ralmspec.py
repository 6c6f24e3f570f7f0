"""`strategy="ralmspec"`: RaLM's outputs with speculative retrieval (RaLMSpec, Zhang et al.
ICML'24), on ralm.py's run.

The same outputs, token for token, with fewer calls to the full index (speculated
boundaries are checked in one batched call) and never more re-prefills than RaLM. Each row
keeps a speculation cache of corpus positions (every real retrieval adds its
top-`prefetch`). At a boundary the *speculated* top-1 is the best cached passage
(`retriever.retrieve_from`, which scores a subset exactly as the full index does and ranks
ties the same way). When it is the passage in effect the row goes on with it (a
speculation); when it is another passage the row does not change passage on a guess: it is
verified at once, one batched `retriever.retrieve` of its speculated queries plus the
query at this boundary (a real retrieval, as RaLM's). After `s` speculated boundaries, at
the next boundary g', the same batched call takes the s speculated queries plus the query
at g'. The first speculated boundary whose true top-1 differs is rolled back (generated ids
cut to it, prompt replaced by the true passage, later speculation dropped); when all were
right the query at the current boundary is a real retrieval, whose passage takes effect
like RaLM's. A row that ends with unverified boundaries is verified before it is final (a
mismatch revives it).

Why the outputs are RaLM's: a verified boundary has RaLM's passage, so the tokens up to the
next boundary are RaLM's (greedy, or sampling keyed by (seed, row, absolute position)); a
passage change re-prefills exactly the context RaLM re-prefills. Why the re-prefills are
RaLM's, one for one: a row's passage changes only on a verified answer, at a verified
boundary; a speculation never changes it (it keeps the passage), so a wrong one is a
boundary where the true passage differs from the one in effect, where RaLM re-prefills too
(the rollback's re-prefill is that one); a right one is a boundary where RaLM keeps its
passage. Rows are edited and re-prefilled in different groupings by the two strategies, so
identity also rests on a row's logits not depending on the other rows of a forward, as for
every strategy here.

OS3 (`speculation_stride="auto"`; the cost model is `speculation.os3_rates`, its argmax
`speculation.os3_stride`): after each verification a row picks its next s in
0..MAX_SPECULATION_STRIDE. s = 0 is plain RaLM: a real retrieval at every boundary (the
cache lookup is still made and checked, so the row's acceptance estimate keeps measuring
and speculation comes back when it pays). Synchronous s >= 1: a round decodes s + 1 strides
(one after the round's real boundary, one after each of its s speculated boundaries) and
ends with one batched retrieval of s + 1 queries. With per-boundary chance gamma that a
speculation is right and keeps the passage (independent), the round resolves
E(s) = sum_{i=0..s} gamma^i = (1 - gamma^(s+1)) / (1 - gamma) boundaries (all s right:
s+1, the last by the real retrieval; first miss at i: i) in
T(s) = (s + 1) a + b(s + 1) + (1 - gamma^(s+1)) R seconds, a = one stride of decoding plus
one cache lookup, b(n) = b0 + b1 n one verification of n queries, R one re-prefill (a
miss is a passage change: it costs R, as it does RaLM). Each round picks

    s = argmax_{0 <= s <= MAX_SPECULATION_STRIDE}  E(s) / T(s),  E(0) = 1, T(0) = a + b(1) + (1 - gamma) R

from measured a (decode seconds per step * steps per stride + seconds per cache lookup),
b0 and b1 (`speculation.fit_verify_cost`: least squares over the last VERIFY_FIT_CALLS
verification calls' (queries, seconds)), R (seconds per re-prefill call) and gamma, the
row's sliding window (`speculation.AcceptanceWindow`: (keeps + 1) / (n + 2) over its last
OS3_WINDOW checks; a keep is a lookup that kept the passage and was right). A lookup that
names another passage ends the round at once with a verification, wasting no stride: the
window counts these apart (d, `detect`), and the synchronous model then counts the three
outcomes (keep, change: the round ends early at j a + b(j), miss: the rest of the round is
wasted; `speculation.os3_rates`). Counting a change as a miss, as the form above does,
chose s = 0 wherever passages change often (a quarter of NQ's boundaries). Until a and b
are measured, s = RALM_DEFAULT_STRIDE (3).

Asynchronous verification (`async_verify=True`): every speculated boundary's real
retrieval goes to a worker thread as soon as the worker is free (at the boundary itself
when it is; else with the other boundaries waiting, in one batched call when the one in
flight is applied), and the row decodes on (XLA, numpy, bm25s and faiss release the GIL,
so the retrieval overlaps decoding). A result is applied at the first pause (after any
verify step) once it is ready: a wrong speculation rolls the row back as above, dropping
the speculations made since, so a miss loses the decoding done while its verification
ran (about one retrieval's time), not a stride. A lookup that names another passage is
recorded too (the row goes on with the passage in effect, never a re-prefill on a
guess), except for a row alone in the batch (no other row could use the time) when
waiting costs less than decoding on would lose (`_wait_on_change`: b(1) against the
ceil(b(1) / step) steps run before the result, times the share of such lookups that were
right): it waits for the verification in flight, then is verified at once with the real
query at the boundary, as sync. One verification is in flight at a time; a row with s unverified
boundaries (recorded and in flight: s bounds them), a row with s = 0 and a finished row
with unverified boundaries wait for it (then are verified at once, as above). OS3's async
form (`speculation.os3_rates`): per boundary, T(s) = max(a, b(n)/n) + (1 - gamma)(b(n) + R)
with n = min(s, ceil(b(1)/a)) the boundaries one call covers, against plain RaLM's
a + b(1) + (1 - gamma) R: speculation wins whenever gamma > 0 and the worker keeps up, and
ties go to the largest s (more room before a row waits). Over several processes only
process 0 runs the worker (its own index: no collective off the main thread); whether its
answer is ready at a pause, and a lone row's `_wait_on_change`, are process 0's choices
(`agree_choice`), and the answer is broadcast where it is applied (`_collect`), so every
process rolls back at the same step. (The form before, rounds of s
boundaries launched one stride after the first of them with a miss wasting a stride,
chose s = 0 at most boundaries of a 100 ms retrieval: its blocking calls were the time
left un-hidden.) Stats (`speculation.SpeculationStats`): `verify_s` is the worker's
retrieval time, `verify_wait_s` (counted in `retrieval_s`) the time decoding waited for
it (`verify_wait_end_s` of it at a finished row), `blocking_verify_s` (counted in
`retrieval_s`) the verifications made at once in the loop, `speculations_while_verifying`
the speculated boundaries whose verification ran while decoding went on; `speculations`
counts every lookup that was recorded or checked at once, `mean_speculation_stride` the s
chosen at each verification (async: the bound on unverified boundaries, 16 once OS3 has
measured, 0 for plain rounds)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Optional

import jax
import numpy as np

from ..core.multihost import agree_choice, broadcast_plan, multiprocess, padded
from .ralm import ProcessZeroRetriever, RaLM, RalmRun
from .speculation import (RALM_DEFAULT_STRIDE, VERIFY_FIT_CALLS, AcceptanceWindow, SpeculationStats, auto_or_int,
                          check_speculation_stride, fit_verify_cost, number_in, os3_stride)

log = logging.getLogger("lookahead_jax")


@dataclasses.dataclass(frozen=True)
class RaLMSpec(RaLM):
    """RaLM's outputs with speculative retrieval (module docstring).

    speculation_stride: speculated boundaries per verification: "auto" (OS3) or 1..16.
    prefetch: top-k of each real retrieval that enter the row's speculation cache.
    async_verify: run each batched verification on a worker thread while the rows decode on
        (module docstring, "Asynchronous verification"). Off over several processes (a log
        line): when a result is applied depends on each process's timing."""

    speculation_stride: object = "auto"
    prefetch: int = 20
    async_verify: bool = False

    name = "ralmspec"
    help = "ralm's tokens with speculative retrieval from a per-request cache, verified in batches"
    cli_names = {}  # RaLM's fields share their flags (--retriever, --stride, ...) with ralm
    field_help = dict(RaLM.field_help,
                      speculation_stride="speculated boundaries per verification: auto (OS3) or 1..16",
                      prefetch="top-k of each real retrieval added to the speculation cache (default 20)",
                      async_verify="verify on a worker thread while decoding goes on (default off)")

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "speculation_stride", auto_or_int(self.speculation_stride))

    def validate(self) -> None:
        super().validate()
        check_speculation_stride(self.speculation_stride)
        number_in("prefetch", self.prefetch, 1, 1 << 20)
        if not isinstance(self.async_verify, bool):
            raise ValueError(f"async_verify must be True or False, got {self.async_verify!r}")

    def start(self, tokenizer, n_rows: int, engine=None):
        return RalmSpecRun(self, tokenizer, n_rows)


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Spec:
    g: int  # boundary (generated tokens)
    query: str
    spec: int  # the passage the row went on with: always the one in effect (`before`)
    before: int  # passage in effect before the boundary
    looked: int  # the cache's top-1 (differs from spec only in async: a change not yet verified)


class RalmSpecRun(RalmRun):
    """RaLMSpec over the rows of a decode state: RalmRun plus per row the speculation cache,
    the unverified boundaries, the round's speculation stride; the counters
    (`SpeculationStats`, as speculative knnlm's)."""

    def __init__(self, strat: RaLMSpec, tokenizer, n_rows: int):
        super().__init__(strat, tokenizer, n_rows)
        B = int(n_rows)
        self.cache = [set() for _ in range(B)]
        self.records = [[] for _ in range(B)]
        self.s = [self._fixed_s() or RALM_DEFAULT_STRIDE] * B
        self.stats = SpeculationStats(B)
        self._step_s = self._tokens_per_step = None  # OS3 measurements: decoding,
        self._verify_cost = collections.deque(maxlen=VERIFY_FIT_CALLS)  # (queries, seconds) per verification,
        self._changes = [0, 0]  # async: lookups naming another passage checked, and those right to
        self.window = AcceptanceWindow(B)  # and each row's last checks
        self.inflight = [[] for _ in range(B)]  # async: speculations being verified, per row
        self.epoch = [0] * B  # async: a verification's answers for a row whose request has left are dropped
        self._pending = None  # async: (future, rows, spans, epochs) of the verification in flight
        self._pool = None

    def _reset(self, b: int) -> None:
        super()._reset(b)
        self.cache[b], self.records[b], self.inflight[b] = set(), [], []
        self.s[b] = self._fixed_s() or RALM_DEFAULT_STRIDE
        self.epoch[b] += 1
        self.stats.retire(b)
        self.window.reset(b)

    def add(self, state, rows, prompt_ids, spans=None) -> list:
        """RalmRun.add; its first retrieval (a full-index call of one query per row, top
        `prefetch`) is also a measured verification cost (b(n)), so OS3 and a lone row's
        choice at a passage change have one from the first boundary on."""
        out = super().add(state, rows, prompt_ids, spans)
        self._verify_cost.append((len(out), self.last_retrieve_s))
        return out

    def _fixed_s(self) -> Optional[int]:
        s = self.strat.speculation_stride
        return None if s == "auto" else int(s)

    def _first_k(self) -> int:
        return self.strat.prefetch

    def _prefetched(self, rows, ids) -> None:
        for b, row in zip(rows, ids):
            self.cache[b].update(int(i) for i in row if i >= 0)

    def _paused(self, state) -> bool:
        return any(self._due(state, b) or self._unverified_end(state, b) for b in self._held(state))

    def _unverified_end(self, state, b) -> bool:
        return (bool(self.records[b] or self.inflight[b]) and state.rows[b].finish is not None
                and not self._due(state, b))

    def final_upto(self, state, b: int) -> int:
        pending = self.inflight[b] or self.records[b]
        g = pending[0].g if pending else self.next_g[b]
        return min(len(state.rows[b].ids), g)

    def close(self) -> None:
        """The verification worker stops (a verification in flight is waited for)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._pending = None

    def _timed_decode(self, state, seconds, steps, n0) -> None:
        tokens = sum(max(len(r.ids) - n, 0) for r, (n, _) in zip(state.rows, n0))
        row_steps = sum(r.steps - s for r, (_, s) in zip(state.rows, n0))
        if steps > 0 and row_steps > 0 and tokens > 0:
            ema = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
            self._step_s = ema(self._step_s, seconds / steps)
            self._tokens_per_step = ema(self._tokens_per_step, tokens / row_steps)

    def os3(self, b: int) -> int:
        """The speculation stride of row b's next round, 0 = plain RaLM (module docstring)."""
        fixed = self._fixed_s()
        if fixed is not None:
            return fixed
        st = self.stats
        if self._step_s is None or not self._verify_cost:
            return RALM_DEFAULT_STRIDE
        a = self._step_s * self.strat.stride / self._tokens_per_step
        a += st.spec_s / max(st.spec_calls, 1)
        b0, b1 = fit_verify_cost(self._verify_cost)
        r = self.reprefill_s / self.reprefill_calls if self.reprefill_calls else 0.0  # (RalmRun._swap)
        asynchronous = self.strat.async_verify
        return os3_stride(self.window.gamma(b), a, b0, b1, r, asynchronous=asynchronous,
                          detect=0.0 if asynchronous else self.window.detect(b))

    def _resolve(self, engine, state, drafter) -> None:
        """The retrievals due, in one batched call where they can share one: rows at a
        boundary look their speculation up in the cache; one that keeps the passage goes on
        (speculated). One that would change it, a row whose round is full (s speculations)
        and a finished row with unverified boundaries are verified now (their speculations
        plus the real query at the boundary). Async: `_resolve_async`."""
        if self.strat.async_verify:
            return self._resolve_async(engine, state, drafter)
        while True:
            spec, verify, ended = [], [], []
            for b in self._held(state):
                if self._due(state, b):
                    (verify if len(self.records[b]) >= self.s[b] else spec).append(b)
                elif self._unverified_end(state, b):
                    ended.append(b)
            if not spec and not verify and not ended:
                return
            # s = 0 rows probe the cache too (their window keeps measuring)
            probe = spec + [b for b in verify if self.s[b] == 0]
            looks = self._lookup(state, probe) if probe else {}
            now = ended + verify + [b for b in spec if looks[b][1] != self.passage[b]]
            swaps = []
            if now:
                self._verify(state, sorted(now), swaps, {b: looks[b][1] for b in now if b in looks})
            for b in sorted(b for b in looks if b not in now):
                self._record(b, *looks[b])
            self._swap(engine, state, drafter, swaps)

    def _resolve_async(self, engine, state, drafter) -> None:
        """Async (module docstring): a verification that is ready is applied; when none is
        in flight, every row's unverified boundaries go to the worker in one call; rows at a
        boundary with s > 0 and room (fewer than s unverified) speculate it, whatever their
        lookup says (a change goes on with the passage in effect until its verification);
        a row with s = 0, a full row and a finished row with unverified boundaries wait
        for the call in flight, then the first two and any finished row with boundaries
        not yet sent are verified at once (a blocking call, as sync); so is a row whose
        lookup names another passage when it is the only active row and waiting is the
        cheaper (`_wait_on_change`)."""
        while True:
            held = self._held(state)
            due = [b for b in held if self._due(state, b)]
            ended = [b for b in held if self._unverified_end(state, b)]
            plain = [b for b in due if self.s[b] == 0]
            full = [b for b in due if self.s[b] > 0 and len(self.records[b]) + len(self.inflight[b]) >= self.s[b]]
            if self._pending is not None and (ended or plain or full or self._ready()):
                swaps = []
                self._collect(state, swaps, "end" if ended else "full" if full or plain else None)
                self._swap(engine, state, drafter, swaps)
                continue  # rolled-back rows have new boundaries; verified ones fewer records
            now = sorted(set(ended + plain + full))
            if now:  # nothing in flight: verified at once, with the real query at the boundary
                looks = self._lookup(state, [b for b in now if b in due])  # keeps the window measuring
                swaps = []
                self._verify_blocking(state, now, swaps, {b: pid for b, (_, pid) in looks.items()})
                self._swap(engine, state, drafter, swaps)
                continue
            if due:
                looks = self._lookup(state, due)
                # a lone active row whose lookup names another passage waits for the truth
                # when decoding on would lose more (`_wait_on_change`); with others, they use the time
                alone = int(np.count_nonzero(state.active)) <= 1 and agree_choice(self._wait_on_change())[0]
                change = [b for b in due if alone and looks[b][1] != self.passage[b]]
                if change:
                    swaps = []
                    if self._pending is not None:
                        self._collect(state, swaps, "change")
                    else:
                        self._verify_blocking(state, change, swaps, {b: looks[b][1] for b in change})
                    self._swap(engine, state, drafter, swaps)
                    continue
                for b, look in sorted(looks.items()):
                    self._record(b, *look)
            waiting = [b for b in held if self.records[b]]
            if self._pending is None and waiting:
                self._launch(state, waiting)
                continue
            if not due:
                return

    # ---- asynchronous verification
    def _ready(self) -> bool:
        """Whether the verification in flight has answered: process 0's worker's answer, the
        same on every process (over several processes only process 0 runs the worker)."""
        future = self._pending[0]
        return bool(agree_choice(future is not None and future.done())[0])

    def _verify_blocking(self, state, rows, swaps, probes) -> None:
        """`_verify` made at once in the async loop (nothing in flight), its time counted
        as `blocking_verify_s`."""
        t0 = time.perf_counter()
        self._verify(state, rows, swaps, probes)
        self.stats.blocking_verify_s += time.perf_counter() - t0

    def _launch(self, state, rows) -> None:
        """Start one batched verification of the listed rows' speculations on the worker;
        they move to `inflight`."""
        queries, spans = [], []
        for b in rows:
            recs, self.records[b] = self.records[b], []
            self.inflight[b] = recs
            spans.append((len(queries), len(recs)))
            queries += [r.query for r in recs]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ralmspec-verify")
        k = min(self.strat.prefetch, self.n_docs)
        # over several processes process 0's worker searches its own index (no collective
        # off the main thread) and `_collect` broadcasts the answer; the others have none
        retriever = self.retriever.inner if isinstance(self.retriever, ProcessZeroRetriever) else self.retriever

        def work():
            t0 = time.perf_counter()
            ids, _ = retriever.retrieve(queries, k)
            return np.asarray(ids), time.perf_counter() - t0

        mine = jax.process_index() == 0 or not multiprocess()
        self._pending = (self._pool.submit(work) if mine else None, list(rows), spans,
                         [self.epoch[b] for b in rows], sum(r.steps for r in state.rows), (len(queries), k))

    def _collect(self, state, swaps, why=None) -> None:
        """Wait for the verification in flight (if not done) and apply it: a wrong speculation
        rolls its row back and drops the speculations made since. why: what waits for it
        ("end": a finished row, "full": a row with s unverified or s = 0), for the stats."""
        future, rows, spans, epochs, steps, (n_q, k) = self._pending
        self._pending = None
        decoded = sum(r.steps for r in state.rows) > steps  # decoding went on while it ran
        t0 = time.perf_counter()
        if multiprocess():  # process 0's answer (its shape known to all: [queries, k], INVALID-padded)
            got, took = future.result() if future is not None else (None, 0.0)
            ids, seconds = broadcast_plan((padded(got, n_q, k, -1, np.int64), np.asarray([took], np.float64)))
            seconds = float(seconds[0])
        else:
            ids, seconds = future.result()
        wait = time.perf_counter() - t0
        self.stats.verify_wait_s += wait
        if why == "end":
            self.stats.verify_wait_end_s += wait
        self.retrieval_s += wait
        self.stats.verify_s += seconds
        self.stats.verify_calls += 1
        n = sum(k for _, k in spans)
        self._verify_cost.append((n, seconds))
        self.retrieval_calls += 1
        self.retrievals += n
        for b, (i0, n), epoch in zip(rows, spans, epochs):
            if epoch != self.epoch[b]:  # the row's request left (cancelled) while it was verified
                continue
            recs, self.inflight[b] = self.inflight[b], []
            self.stats.overlapped += len(recs) if decoded else 0
            self._apply(state, b, recs, ids[i0:i0 + n], False, swaps)
        self._choose_strides([b for b, e in zip(rows, epochs) if e == self.epoch[b]])

    def _lookup(self, state, rows) -> dict:
        """Each listed row's speculation at its boundary: {row: (query, cache top-1)}."""
        queries = [self._query(state, b, self.next_g[b]) for b in rows]
        t0 = time.perf_counter()
        ids, _ = self.retriever.retrieve_from(queries, [np.fromiter(self.cache[b], np.int64) for b in rows], 1)
        dt = time.perf_counter() - t0
        self.stats.spec_s += dt
        self.retrieval_s += dt
        self.stats.spec_calls += 1
        # INVALID (nothing cached) never happens: the passage in effect is cached
        return {b: (q, self.passage[b] if int(row[0]) < 0 else int(row[0])) for b, q, row in zip(rows, queries, ids)}

    def _record(self, b, query, pid) -> None:
        """Row b goes on past its boundary with the passage in effect; its lookup `pid` said
        so, or (async) said another passage (verified by the worker's next call; never a
        re-prefill on a guess)."""
        assert pid == self.passage[b] or self.strat.async_verify, "sync: a change is verified first"
        g = self.next_g[b]
        self.records[b].append(_Spec(g, query, self.passage[b], self.passage[b], pid))
        self.stats.speculations[b] += 1
        self.next_g[b] = g + self.strat.stride

    def _verify(self, state, rows, swaps, probes=None) -> None:
        """One batched retrieval: every listed row's speculated queries, plus the query at
        its current boundary when it is at one (its cache lookup there, `probes[b]`, is
        checked against it)."""
        probes = probes or {}
        queries, spans = [], []
        for b in rows:
            now = self._due(state, b)
            q = [r.query for r in self.records[b]] + ([self._query(state, b, self.next_g[b])] if now else [])
            spans.append((len(queries), len(q), now))
            queries += q
        t0 = time.perf_counter()
        ids = self._retrieve(queries, self.strat.prefetch)
        dt = time.perf_counter() - t0
        self.stats.verify_s += dt
        self.stats.verify_calls += 1
        self._verify_cost.append((len(queries), dt))
        for b, (i0, n, now) in zip(rows, spans):
            recs, self.records[b] = self.records[b], []
            if b in probes:
                self.stats.speculations[b] += 1
            self._apply(state, b, recs, ids[i0:i0 + n], now, swaps, probes.get(b))
        self._choose_strides(rows)

    def _apply(self, state, b, recs, got, now, swaps, probe=None) -> None:
        """A verification's answers for row b: its top-k enter the cache, the speculations
        are checked (a rollback also drops those made since: async); the caller then chooses
        the next s (`_choose_strides`)."""
        self._prefetched([b] * len(got), got)
        if not self._check(state, b, recs, got, now, swaps, probe):
            self.records[b] = []

    def _choose_strides(self, rows) -> None:
        """The next s of each verified row (`os3`). Over several processes process 0's, in one
        broadcast per verification: OS3 reads this process's timings, which differ."""
        s = [self.os3(b) for b in rows]
        if multiprocess() and rows:
            s = broadcast_plan(np.asarray(s, np.int32)).tolist()
        for b, x in zip(rows, s):
            self.s[b] = int(x)
            self.stats.strides.append(self.s[b])

    def _wait_on_change(self) -> bool:
        """Async, a lone row's lookup names another passage: wait for its verification (about
        b(1) seconds) rather than decode on, unless decoding on loses less: the steps run
        before the result is applied, ceil(b(1) / step) of them, lost when the passage
        really changes (chance p: (right + 1) / (checked + 2) of such lookups so far)."""
        if self._step_s is None or not self._verify_cost:
            return True
        b0, b1 = fit_verify_cost(self._verify_cost)
        b = b0 + b1
        p = (self._changes[1] + 1) / (self._changes[0] + 2)
        return b <= p * np.ceil(b / max(self._step_s, 1e-9)) * self._step_s

    def _check(self, state, b, recs, got, now, swaps, probe=None) -> bool:
        """Row b's speculations `recs` against the true top-1s `got` (plus, when `now`, the
        real retrieval at its current boundary, against which its lookup `probe` is checked).
        False: rolled back at the first wrong one. Each check enters the row's window: right
        and passage kept (the round could go on) or not."""
        for rec, row in zip(recs, got):
            true = int(row[0])
            if rec.looked != rec.before:
                self._changes[0] += 1
                self._changes[1] += true != rec.before
            self.stats.checks[b] += 1
            self.window.note(b, "change" if rec.looked != rec.before
                             else "keep" if true == rec.spec == rec.before else "miss")
            self.stats.hits[b] += true == rec.looked
            if true == rec.spec:
                continue
            # first wrong speculation: back to its boundary with the true passage
            self.stats.rolled_back(b, len(state.rows[b].ids) - rec.g)
            self.history[b] = [h for h in self.history[b] if h[0] < rec.g]
            if true != rec.before:
                self.history[b].append((rec.g, true))
            self.passage[b] = true
            self.next_g[b] = rec.g + self.strat.stride
            swaps.append((b, rec.g))
            return False
        if now:  # all right: the query at the current boundary was a real retrieval
            g, true = self.next_g[b], int(got[-1][0])
            if probe is not None and probe != self.passage[b]:
                self._changes[0] += 1
                self._changes[1] += true != self.passage[b]
            if probe is not None:
                self.stats.checks[b] += 1
                self.stats.hits[b] += probe == true
                self.window.note(b, "change" if probe != self.passage[b]
                                 else "keep" if probe == true else "miss")
            self.next_g[b] = g + self.strat.stride
            if true != self.passage[b]:
                self.passage[b] = true
                self.history[b].append((g, true))
                swaps.append((b, g))
        return True

    def row_stats(self, b: int) -> dict:
        return dict(super().row_stats(b), **self.stats.row_stats(b))

    def counters(self) -> dict:
        return dict(super().counters(), **self.stats.summary(self.strat.async_verify))
