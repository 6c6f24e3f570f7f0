"""`strategy="ralmspec"`: RaLM's outputs with speculative retrieval (RaLMSpec, Zhang et al.
ICML'24), on ralm.py's run.

The same outputs, token for token, with fewer calls to the full index (speculated
boundaries are checked in one batched call). Each row keeps a speculation cache of corpus
positions (every real retrieval adds its top-`prefetch`). At a boundary the *speculated*
top-1 is the best cached passage (`retriever.retrieve_from`, which scores a subset exactly
as the full index does and ranks ties the same way); the row goes on with it. After `s`
speculated boundaries, at the next boundary g', one batched `retriever.retrieve` takes the
s speculated queries plus the query at g': the first speculated boundary whose true top-1
differs is rolled back (generated ids cut to it, prompt replaced by the true passage,
later speculation dropped); when all s were right the query at g' is a real retrieval,
whose passage takes effect like RaLM's. A row that ends with unverified boundaries is
verified before it is final (a mismatch revives it).

Why the outputs are RaLM's: a verified boundary has RaLM's passage, so the tokens up to the
next boundary are RaLM's (greedy, or sampling keyed by (seed, row, absolute position)); a
passage change re-prefills exactly the context RaLM re-prefills. With an exact retriever a
rollback always changes the passage (the passage in effect is cached, so when it is still
the true top-1 the cache's top-1 is it too), i.e. RaLM re-prefilled there as well. A
retriever whose `retrieve_from` disagrees with `retrieve` (tests force this) can make a
rollback return to the passage it left: the row is then re-prefilled where RaLM kept
decoding, which gives RaLM's tokens as far as a block forward computes the K/V of an
incremental one (the property lookahead == greedy rests on). Rows are edited and
re-prefilled in different groupings by the two strategies, so identity also rests on a
row's logits not depending on the other rows of a forward, as for every strategy here.

OS3 (`speculation_stride="auto"`, `speculation.os3_stride`): a round decodes s + 1 strides
(one after the round's real boundary, one after each of its s speculated boundaries) and
ends with one batched retrieval. With per-boundary speculation accuracy gamma
(independent), the round resolves
E(s) = sum_{i=0..s} gamma^i = (1 - gamma^(s+1)) / (1 - gamma) boundaries (all s right:
s+1, the last by the real retrieval; first miss at i: i) in (s + 1) * a + b seconds, a = one stride of decoding plus one cache lookup, b = one
verification retrieval. Each round picks

    s = argmax_{1 <= s <= MAX_SPECULATION_STRIDE}  E(s) / ((s + 1) * a + b)

from measured a (decode seconds per step * steps per stride + seconds per cache lookup), b
(seconds per verification call) and the row's running gamma ((hits + 1) / (checks + 2)).
Until a and b are measured, s = RALM_DEFAULT_STRIDE (3).

Asynchronous verification (`async_verify=True`): when a row has s speculated boundaries
and reaches the next one, its batched verification goes to a worker thread and the row
speculates that boundary too and decodes on (XLA, numpy, bm25s and faiss release the GIL,
so the retrieval overlaps decoding). The result is applied at the next pause after it is
ready: a wrong speculation rolls the row back as above, dropping the speculations made
since. One verification is in flight at a time; a row that needs the next one, or ends
with unverified boundaries, waits for it. OS3's async form (the verification of a round
overlaps the first stride of the next; a miss wastes that stride):
E(s) = (1 - gamma^s) / (1 - gamma) boundaries (all s right: s; first miss at i: i) in
T(s) = s * a + gamma^s * max(0, b - a) + (1 - gamma^s) * max(a, b) seconds. Stats (`speculation.SpeculationStats`):
`verify_s` is the worker's retrieval time, `verify_wait_s` (counted in `retrieval_s`) the
time decoding waited for it, `speculations_while_verifying` the boundaries speculated
while a verification was in flight."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Optional

import numpy as np

from .ralm import RaLM, RalmRun
from .speculation import (RALM_DEFAULT_STRIDE, SpeculationStats, auto_or_int, check_speculation_stride, number_in,
                          os3_stride)


@dataclasses.dataclass(frozen=True)
class RaLMSpec(RaLM):
    """RaLM's outputs with speculative retrieval (module docstring).

    speculation_stride: speculated boundaries per verification: "auto" (OS3) or 1..16.
    prefetch: top-k of each real retrieval that enter the row's speculation cache.
    async_verify: run each batched verification on a worker thread while the rows decode on
        (module docstring, "Asynchronous verification")."""

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
    spec: int  # speculated passage (cache top-1)
    before: int  # passage in effect before the boundary


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
        self._step_s = self._tokens_per_step = None  # OS3 measurements
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
        """The speculation stride of row b's next round (module docstring)."""
        fixed = self._fixed_s()
        if fixed is not None:
            return fixed
        st = self.stats
        if self._step_s is None or not st.verify_calls:
            return RALM_DEFAULT_STRIDE
        a = self._step_s * self.strat.stride / self._tokens_per_step
        a += st.spec_s / max(st.spec_calls, 1)
        bt = st.verify_s / st.verify_calls
        return os3_stride(st.accuracy(b), a, bt, asynchronous=self.strat.async_verify)

    def _resolve(self, engine, state, drafter) -> None:
        asynchronous = self.strat.async_verify
        while True:
            spec, verify = [], []
            for b in self._held(state):
                if self._due(state, b):
                    (verify if len(self.records[b]) >= self.s[b] else spec).append(b)
                elif self._unverified_end(state, b):
                    verify.append(b)
            if self._pending is not None and (verify or self._pending[0].done()):
                swaps = []
                self._collect(state, swaps)
                self._swap(engine, state, drafter, swaps)
                continue  # rolled-back rows have new boundaries; verified ones fewer records
            if not spec and not verify:
                return
            swaps = []
            if asynchronous:
                launch = [b for b in verify if self._due(state, b)]
                ended = [b for b in verify if not self._due(state, b)]
                if ended:  # nothing decodes on for a finished row: verify it now
                    self._verify(state, ended, swaps)
                if launch:
                    self._launch(launch)
                    spec += launch
            elif verify:
                self._verify(state, verify, swaps)
            if spec:
                self._speculate(state, sorted(spec), swaps)
            self._swap(engine, state, drafter, swaps)

    # ---- asynchronous verification
    def _launch(self, rows) -> None:
        """Start one batched verification of the listed rows' speculations on the worker;
        they move to `inflight` (the rows then speculate their current boundary)."""
        queries, spans = [], []
        for b in rows:
            recs, self.records[b] = self.records[b], []
            self.inflight[b] = recs
            spans.append((len(queries), len(recs)))
            queries += [r.query for r in recs]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ralmspec-verify")
        k = min(self.strat.prefetch, self.n_docs)

        def work():
            t0 = time.perf_counter()
            ids, _ = self.retriever.retrieve(queries, k)
            return np.asarray(ids), time.perf_counter() - t0

        self._pending = (self._pool.submit(work), list(rows), spans, [self.epoch[b] for b in rows])

    def _collect(self, state, swaps) -> None:
        """Wait for the verification in flight (if not done) and apply it: a wrong speculation
        rolls its row back and drops the speculations made since."""
        future, rows, spans, epochs = self._pending
        self._pending = None
        t0 = time.perf_counter()
        ids, seconds = future.result()
        wait = time.perf_counter() - t0
        self.stats.verify_wait_s += wait
        self.retrieval_s += wait
        self.stats.verify_s += seconds
        self.stats.verify_calls += 1
        self.retrieval_calls += 1
        self.retrievals += sum(n for _, n in spans)
        for b, (i0, n), epoch in zip(rows, spans, epochs):
            if epoch != self.epoch[b]:  # the row's request left (cancelled) while it was verified
                continue
            recs, self.inflight[b] = self.inflight[b], []
            self._apply(state, b, recs, ids[i0:i0 + n], False, swaps)

    def _speculate(self, state, rows, swaps) -> None:
        queries = [self._query(state, b, self.next_g[b]) for b in rows]
        t0 = time.perf_counter()
        ids, _ = self.retriever.retrieve_from(queries, [np.fromiter(self.cache[b], np.int64) for b in rows], 1)
        dt = time.perf_counter() - t0
        self.stats.spec_s += dt
        self.retrieval_s += dt
        self.stats.spec_calls += 1
        for b, q, row in zip(rows, queries, ids):
            g, pid = self.next_g[b], int(row[0])
            pid = self.passage[b] if pid < 0 else pid  # INVALID: nothing cached (never: the passage is)
            if not self.records[b]:
                self.stats.strides.append(self.s[b])
            self.records[b].append(_Spec(g, q, pid, self.passage[b]))
            self.stats.speculations[b] += 1
            self.stats.overlapped += self._pending is not None
            self.next_g[b] = g + self.strat.stride
            if pid != self.passage[b]:
                self.passage[b] = pid
                self.history[b].append((g, pid))
                swaps.append((b, g))

    def _verify(self, state, rows, swaps) -> None:
        """One batched retrieval: every listed row's speculated queries, plus the query at
        its current boundary when it is at one."""
        queries, spans = [], []
        for b in rows:
            now = self._due(state, b)
            q = [r.query for r in self.records[b]] + ([self._query(state, b, self.next_g[b])] if now else [])
            spans.append((len(queries), len(q), now))
            queries += q
        t0 = time.perf_counter()
        ids = self._retrieve(queries, self.strat.prefetch)
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.verify_calls += 1
        for b, (i0, n, now) in zip(rows, spans):
            recs, self.records[b] = self.records[b], []
            self._apply(state, b, recs, ids[i0:i0 + n], now, swaps)

    def _apply(self, state, b, recs, got, now, swaps) -> None:
        """A verification's answers for row b: its top-k enter the cache, the speculations
        are checked (a rollback also drops those made since: async), the next s is chosen."""
        self._prefetched([b] * len(got), got)
        if not self._check(state, b, recs, got, now, swaps):
            self.records[b] = []
        self.s[b] = self.os3(b)

    def _check(self, state, b, recs, got, now, swaps) -> bool:
        """Row b's speculations `recs` against the true top-1s `got` (plus, when `now`, the
        real retrieval at its current boundary). False: rolled back at the first wrong one."""
        for rec, row in zip(recs, got):
            true = int(row[0])
            self.stats.checks[b] += 1
            if true == rec.spec:
                self.stats.hits[b] += 1
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
