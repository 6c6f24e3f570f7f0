"""The engine loop: one thread owns a `core.slots.Slots` and does continuous batching.

    sched = Scheduler(engine, tokenizer, strategy, max_batch=8, max_len=2048)
    sched.start()
    sched.submit([job, ...])     # from any thread; QueueFull when the waiting queue is full
    ...                          # job.sink(Output) is called from the engine thread
    sched.shutdown()             # drains: running and waiting jobs finish first

Between two `Slots.step()`s the thread frees the slots of cancelled jobs, inserts waiting
jobs into free slots (a prefill each, as JetStream does: blocks of 1..max_batch rows would
each compile for every prompt bucket; with `prefill_chunk` a long prompt's first block
only, the rest one block per step, so running jobs keep decoding) and, after the step, hands
each job its tokens, text delta (the row's own streaming text: stop strings held back,
EOS and stop cut), log-probabilities and finish reason, freeing finished slots at once.

What one step compiles in (sampling parameters, penalties) is per request on `Slots`
that accept it per request; on `Slots` that refuse another request's values (a
`NeedsOwnSlots` from `insert`), such a job waits until the running
ones finish and the slots are rebuilt with its values (correct, only slower).

Prefix-cache warm jobs (`warm(ids)`, any thread; the server queues one when a chat request
ends: the next turn's prompt up to the end of the answer): with the slots' prefix cache on,
the engine thread forwards a warm job's blocks through a free slot (`Slots.warming`,
`core.prefix_warm`: the programs a prompt's own prefill runs, so the cached K/V are exact)
only while no job runs or waits, one block per turn of its loop (so a job arriving waits
one block at most; a running job's steps never carry one: a block costs several decode
steps, and a warm job is worth only the next turn's TTFT); a job that needs its slot
preempts it: the warm job is cancelled (its stored blocks stay) and queued again, and
started again it forwards only the rest. At most `WARM_QUEUE` warm jobs wait (the oldest
is dropped); shutting down drops them.

Failures stay local: a job whose insert raises is failed (400 for a ValueError, its own
bad input; 500 otherwise) and its slot freed; an exception in a step fails the jobs of
that step and rebuilds the slots; the thread keeps serving. Host-side only besides the
`Slots` calls (the engine knows nothing of HTTP).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional

from ..core.multihost import multiprocess
from ..core.sampling import Penalties, SamplingParams
from ..core.slots import NeedsOwnSlots, Slots
from .jobs import Job, Output, Speculation  # noqa: F401 (the scheduler's API: imported from here too)

log = logging.getLogger("lookahead_jax.serve")

# Slots take each request's sampling and penalties (`Request.sampling` / `.penalties`),
# except a retrieval run's slots, which refuse other values: such a job waits for slots of
# its own (probed once per Slots by a real insert, `per_request_sampling`)


WARM_QUEUE = 64  # prefix-cache warm jobs kept waiting (the oldest dropped first)


class QueueFull(Exception):
    """The waiting queue holds max_waiting jobs (HTTP 429)."""


class ShuttingDown(Exception):
    """The scheduler drains and takes no new jobs (HTTP 503)."""


class Scheduler:
    """Continuous batching over one `Slots` of `max_batch` rows and `max_len` cache slots
    (module docstring). metrics: a `metrics.Metrics` (or None); max_waiting: jobs that may
    wait for a slot before `submit` raises QueueFull; logprobs: build the slots with
    log-probabilities on (a job may then ask for them); prefill_chunk: prompt tokens forwarded
    per block (`Slots(prefill_chunk=)`; None: whole prompts at insert); step_budget: the
    prefill blocks a step carries, in decode steps of the running batch (`Slots(step_budget=)`;
    None: one block a step); prefix_cache: bytes of prompt-block K/V the slots keep for later
    prompts that begin alike (`Slots(prefix_cache=)`, on the engine: slots rebuilt keep it;
    None / 0: off; needs prefill_chunk). A prefilling job holds
    its slot (not free) and gets its first output, TTFT included, when its last block is out.
    replicate: over several processes, process 0's `replica.Recorder`: every call on the
    slots is recorded for the other processes, which `replica.follow` a scheduler built
    alike (over several processes slots never do without a program: `fallback` off)."""

    def __init__(self, engine, tokenizer, strategy=None, *, max_batch: int = 8, max_len: int = 2048,
                 max_waiting: int = 256, eos_ids=(), logprobs: bool = True, metrics=None,
                 sampling: SamplingParams = SamplingParams(), penalties: Penalties = Penalties(),
                 prefill_chunk: Optional[int] = None, step_budget: Optional[float] = None,
                 prefix_cache: Optional[int] = None, replicate=None):
        self.engine, self.tokenizer, self.strategy = engine, tokenizer, strategy
        self.replicate = replicate  # over several processes, process 0's `replica.Recorder` (else None)
        self.prefix_cache = prefix_cache
        self.prefill_chunk, self.step_budget = prefill_chunk, step_budget
        self.max_batch, self.max_len, self.max_waiting = max_batch, max_len, max_waiting
        self.eos_ids, self.logprobs, self.metrics = tuple(eos_ids), logprobs, metrics
        self.slots = self._new_slots(sampling, penalties)
        self.max_nodes = self.slots.max_nodes
        self.waiting: collections.deque = collections.deque()
        self.warm_waiting: collections.deque = collections.deque()  # prefix-cache warm jobs (token ids)
        self._warm_starting = False  # one taken off warm_waiting, not yet in `warming.rows` (`warm_pending`)
        self.running: dict = {}  # slot -> Job
        self._cond = threading.Condition()
        self._stop = False
        self._drain = True
        self.ready = threading.Event()  # set once the minimum set is compiled (`warm_up`), or with none
        self.ready.set()
        self._thread: Optional[threading.Thread] = None
        self.per_request_sampling: Optional[bool] = None  # learnt from the first insert that needs it
        self.warm_compilations = 0  # programs the warm-up compiled in place (a rehearsal's)
        self.steps = 0
        self.errors = 0

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lookahead-jax-engine", daemon=True)
        self._thread.start()

    def warm_up_in_background(self, wait: str = "minimum"):
        """`warm_up` in a daemon thread: the engine thread admits nothing until the minimum
        set of step programs is compiled (/health: 503 with the progress, then 200), and the
        rest compile while it serves. Returns the thread."""
        self.ready.clear()  # before the thread starts: no request is admitted meanwhile

        def work():
            try:
                self.warm_up(wait=wait)
            except Exception:  # noqa: BLE001 - the steps then compile at first use; the log says why
                log.exception("warm-up failed: the step programs compile at first use")
                self.ready.set()

        thread = threading.Thread(target=work, name="lookahead-jax-warm-up", daemon=True)
        thread.start()
        return thread

    def warm_up(self, sampled: bool = False, wait: str = "all") -> int:
        """Compile the step programs the slots run (`Slots.programs`) before the thread
        serves, logging progress: returns once `wait` ("all"; "minimum": the set every
        request can be served with, the rest compiling in the background while the thread
        serves, the steps doing without what is not compiled yet). Until it returns the
        engine thread admits nothing (`ready`; /health answers 503 with the progress). The
        number of programs queued (0 when an earlier warm-up on this engine had them)."""
        if self.alive and self.ready.is_set():
            raise RuntimeError("warm_up() runs before start(), or before the thread serves")
        self.ready.clear()  # (a warm-up thread clears it before it starts: `warm_up_in_background`)
        t0, shown = time.perf_counter(), [0]

        def progress(done, total):
            if done * 10 // total > shown[0] or done == total:
                shown[0] = done * 10 // total
                log.info("warm-up: %d / %d programs (%.0f s)", done, total, time.perf_counter() - t0)

        log.info("warm-up: the step programs of this configuration, minimum set first:\n  %s",
                 "\n  ".join(map(str, self.slots.programs())))
        try:
            n = self.slots.warm_up(sampled=sampled, progress=progress, wait=wait)
            if self.slots.rehearses:  # a run's own jitted steps: one short request on slots of their own
                rehearsal = self._build_slots(self.slots.state.sampling, self.slots.state.penalties)
                try:
                    log.info("warm-up: the %s run's own steps (a rehearsal request): %d programs compiled",
                             self.slots.strategy.name, rehearsal.rehearse())
                finally:
                    rehearsal.close()
        finally:
            self.warm_compilations = len(self.engine.compiled.compilations)  # (not in requests)
            self.ready.set()
        warm = self.slots.warm
        log.info("warm-up: %d of %d programs compiled in %.0f s (minimum set: %d)%s", warm.ready, warm.total,
                 time.perf_counter() - t0, warm.minimum, "; the rest compile while serving" if warm.ready < warm.total
                 else "")
        return n

    def programs(self) -> dict:
        """The step programs' compilation so far (/health, /metrics): how many are
        compiled of how many, whether the engine thread serves, compile seconds."""
        warm = self.slots.warm
        if warm is not None:
            from ..core.programs import track

            track(self.slots, warm)
        c = self.engine.compiled
        return dict(ready=self.ready.is_set(), programs_ready=warm.ready if warm else None,
                    programs_total=warm.total if warm else None, programs_minimum=warm.minimum if warm else None,
                    warm_up_s=round(time.perf_counter() - warm.t0, 1) if warm else None,
                    compile_s=round(c.compile_s + c.background_s, 1),
                    compiled_in_requests=len(c.compilations) - self.warm_compilations)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, jobs: list) -> None:
        with self._cond:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (at most {self.max_waiting}): "
                                "retry later")
            now = time.perf_counter()
            for j in jobs:
                j.arrival = now
            self.waiting.extend(jobs)
            self._gauges()
            self._cond.notify()

    @property
    def warms(self) -> bool:
        """Whether `warm` does anything: the slots have a prefix cache."""
        return getattr(self.slots, "warming", None) is not None

    def warm(self, ids) -> bool:
        """Queue a prefix-cache warm job (module docstring) for the token ids `ids` (any
        thread). False, nothing queued: the slots have no prefix cache, or shutting down."""
        ids = [int(t) for t in ids]
        V = int(self.engine.config.vocab_size)
        if ids and (min(ids) < 0 or max(ids) >= V):
            raise ValueError(f"warm: token ids must be in [0, {V})")
        with self._cond:
            if self._stop or not self.warms or not ids:
                return False
            self.warm_waiting.append(ids)
            while len(self.warm_waiting) > WARM_QUEUE:
                self.warm_waiting.popleft()
            self._cond.notify()
        return True

    @property
    def warm_pending(self) -> bool:
        """Warm jobs queued or running."""
        warming = getattr(self.slots, "warming", None)
        return warming is not None and (bool(self.warm_waiting) or self._warm_starting or bool(warming.rows))

    def cancel(self, jobs) -> None:
        """Cancel jobs (a client went away): waiting ones are dropped, running ones freed
        before the next step."""
        with self._cond:
            for j in jobs:
                j.cancelled = True
            self._cond.notify()

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop taking jobs; with `drain`, finish the waiting and running ones first."""
        with self._cond:
            self._stop, self._drain = True, drain
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self.ready.wait(0.5):  # a warm-up compiles what every request needs
            if self._stop:
                break
        while True:
            with self._cond:
                while not self._stop and not self.running and not any(not j.cancelled for j in self.waiting) \
                        and not self.warm_pending:
                    self._drop_cancelled_waiting()
                    self._cond.wait(0.5)
                if self._stop and (not self._drain or (not self.running and not self.waiting)):
                    break
                self._drop_cancelled_waiting()
            try:
                self._free_cancelled()
                self._admit()
                if self.running:
                    self._step()
                self._warm()
            except Exception:  # a bug of our own: never take the thread down
                log.exception("engine loop error: failing the running requests and rebuilding the slots")
                self._fail_all("internal error in the engine loop", 500)
        for job in list(self.running.values()) + list(self.waiting):
            self._finish(job, "abort", error="the server shut down", status=503)
        self.running.clear()
        self.waiting.clear()
        self.warm_waiting.clear()
        if self.slots.run is not None:  # e.g. ralmspec's verification worker
            self.slots.run.close()
        if self.replicate is not None:  # the other processes' schedulers end too
            self.replicate.stop()

    def _drop_cancelled_waiting(self) -> None:  # under the lock
        if any(j.cancelled for j in self.waiting):
            for j in [j for j in self.waiting if j.cancelled]:
                self._finish(j, "abort")
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)
            self._gauges()

    def _free_cancelled(self) -> None:
        freed = False
        for slot, job in list(self.running.items()):
            if job.cancelled:
                self.slots.free(slot)
                del self.running[slot]
                self._finish(job, "abort")
                freed = True
        if freed:
            with self._cond:
                self._gauges()

    def _admit(self) -> None:
        """Waiting jobs into free slots, in arrival order (only this thread pops); warm
        jobs give up the slots they need (`_preempt_warm`)."""
        self._preempt_warm()
        free = self.slots.free_slots
        batch = []
        while free:
            with self._cond:
                job = self.waiting.popleft() if self.waiting else None
            if job is None:
                break
            if job.cancelled:
                self._finish(job, "abort")
                continue
            st = self.slots.state
            if job.params.sampling == st.sampling and job.params.penalties == st.penalties or self.per_request_sampling:
                batch.append((free.pop(0), job))
                continue
            if self.per_request_sampling is None:  # do these slots take it? try it alone
                try:
                    if self._insert([(free[0], job)], probe=True):
                        self.per_request_sampling = True
                    free = [s for s in self.slots.free_slots if s not in {b for b, _ in batch}]
                    continue
                except NeedsOwnSlots:
                    self.per_request_sampling = False
            if self.running or batch:  # FIFO: it waits until the batch drains
                with self._cond:
                    self.waiting.appendleft(job)
                break
            self.slots = self._new_slots(job.params.sampling, job.params.penalties)
            free = self.slots.free_slots
            batch.append((free.pop(0), job))
        for item in batch:  # one prefill each: fewer shapes to compile than blocks of 1..max_batch rows
            self._insert([item])
        with self._cond:  # (after the inserts: the running count includes them)
            self._gauges()

    def _preempt_warm(self) -> None:
        """Cancel the warm jobs holding slots that waiting jobs need (newest first), each
        queued again at the front (started again, it forwards only what is not stored)."""
        warming = getattr(self.slots, "warming", None)
        if warming is None or not warming.rows:
            return
        with self._cond:
            need = sum(not j.cancelled for j in self.waiting) - len(self.slots.free_slots)
        if need <= 0:
            return
        for s in reversed(warming.rows[-need:]):
            with self._cond:
                self.warm_waiting.appendleft(warming.sequence(s))
            warming.cancel(s)
        if self.metrics is not None:
            self.metrics.prefix_cache(self.slots)

    def _warm(self) -> None:
        """One block of a warm job (module docstring), when no job runs or waits: the one
        begun, else the next queued one started in a free slot."""
        warming = getattr(self.slots, "warming", None)
        if warming is None or self.running:
            return
        while not warming.rows and self.slots.free_slots:
            with self._cond:
                if any(not j.cancelled for j in self.waiting) or not self.warm_waiting:
                    return
                self._warm_starting = True  # (before the pop: another thread sees the job queued or starting)
                ids = self.warm_waiting.popleft()
            try:  # (`start` makes the slot WARMING before the job is in `warming.rows`)
                warming.start(self.slots.free_slots[0], ids)
            except ValueError as e:  # (`warm` checked the ids: not expected)
                log.warning("prefix-cache warm job dropped: %s", e)
            finally:
                self._warm_starting = False
        with self._cond:
            if any(not j.cancelled for j in self.waiting):
                return
        if warming.rows:
            warming.advance()
            if self.metrics is not None:
                self.metrics.prefix_cache(self.slots)

    def _insert(self, batch: list, probe: bool = False) -> bool:
        slots = [s for s, _ in batch]
        jobs = [j for _, j in batch]
        t0 = time.perf_counter()
        try:
            events = self.slots.insert(slots, [j.request() for j in jobs])
        except Exception as e:
            if probe and isinstance(e, NeedsOwnSlots):  # the caller's answer: slots of its own
                raise
            self._clear(slots)
            if len(batch) > 1:  # find the culprit: each alone
                for item in batch:
                    self._insert([item])
                return True
            bad = isinstance(e, ValueError)
            if not bad:
                log.exception("insert failed")
                self.errors += 1
            self._finish(jobs[0], "error", error=str(e) if bad else f"internal error: {type(e).__name__}: {e}",
                         status=400 if bad else 500)
            return False
        if self.metrics is not None:
            for j in jobs:
                self.metrics.admitted(j, t0)
            self.metrics.prefix_cache(self.slots)
        for s, j in batch:
            self.running[s] = j
        self._deliver(events)
        return True

    def _clear(self, slots) -> None:
        for s in slots:
            if s not in self.slots.free_slots:
                try:
                    self.slots.free(s)
                except Exception:
                    self._rebuild()
                    return

    def _step(self) -> None:
        try:
            events = self.slots.step()
        except Exception as e:
            log.exception("step failed: failing its %d requests", len(self.running))
            self.errors += 1
            self._fail_all(f"internal error in the decode step: {type(e).__name__}: {e}", 500)
            return
        self.steps += 1
        result = getattr(self.slots, "last_step", None)
        if result is not None and result.drafted is not None:
            drafting = [s for s, j in self.running.items() if j.strategy is None]
            for s in drafting:  # each job's own count (a step with no drafts for it is a plain one)
                if result.drafted[s] > 0:
                    self.running[s].spec.add(int(result.drafted[s]), int(result.n_emit[s]) - 1)
            if self.metrics is not None:
                self.metrics.speculation(result, drafting)
        if self.metrics is not None and self.slots.run is not None:  # a retrieval run's counters
            self.metrics.retrieval(self.slots.run)
        if self.metrics is not None:  # blocks stored as prompts are prefilled
            self.metrics.prefix_cache(self.slots)
        self._deliver(events)

    def _deliver(self, events) -> None:
        now = time.perf_counter()
        for ev in events:
            job = self.running.get(ev.slot)
            if job is None:
                continue
            row = self.slots.row(ev.slot)
            lps = tops = None
            if job.params.logprobs and row.logprobs is not None and ev.tokens:
                lps = row.logprobs[len(row.ids) - len(ev.tokens):len(row.ids)]
            if row.tops is not None and ev.tokens:
                tops = row.tops[len(row.ids) - len(ev.tokens):len(row.ids)]
            text = "".join(job._text)
            job._text.clear()
            if ev.tokens and self.metrics is not None:
                self.metrics.tokens(job, len(ev.tokens), now)
            if ev.tokens:
                job.t_first = job.t_first or now
                job.t_last = now
            job.n_out += len(ev.tokens)
            scored = (None, None)
            if ev.finish:
                freed = self.slots.free(ev.slot)
                job.retrieval, scored = freed.retrieval, (freed.prompt_logprobs, freed.prompt_top)
                del self.running[ev.slot]
            if ev.tokens or text or ev.finish:
                job.sink(Output(job.index, list(ev.tokens), text, lps, prompt_logprobs=scored[0],
                                prompt_top=scored[1], tops=tops))
            if ev.finish:
                self._finish(job, ev.finish)
        if any(ev.finish for ev in events):  # the running count went down
            with self._cond:
                self._gauges()

    def _finish(self, job: Job, reason: str, error: Optional[str] = None, status: int = 200) -> None:
        if job.done:
            return
        job.done = True
        if self.metrics is not None:
            self.metrics.finished(job, reason)
        try:
            drafting = self.slots.drafter is not None and job.strategy is None
            job.sink(Output(job.index, [], "", None, reason, error, status, job.retrieval,
                            speculation=job.spec.record() if drafting else None))
        except Exception:  # a sink whose loop has gone (shutdown): nothing to tell
            log.debug("sink failed", exc_info=True)

    def _fail_all(self, message: str, status: int) -> None:
        jobs = list(self.running.values())
        self._rebuild()  # the cache may be half-written (and donated): fresh slots before answering
        for job in jobs:
            self._finish(job, "error", error=message, status=status)

    def rebuild(self) -> None:
        """Fresh slots (and drafter) between loads, e.g. a benchmark's warm-up and its
        measurement; only while idle."""
        with self._cond:
            if self.running or self.waiting:
                raise RuntimeError("rebuild() needs an idle scheduler")
            self._rebuild()

    def _rebuild(self) -> None:
        st = self.slots.state
        self.slots = self._new_slots(st.sampling, st.penalties)
        self.running.clear()

    def _new_slots(self, sampling: SamplingParams, penalties: Penalties) -> Slots:
        old = getattr(self, "slots", None)
        if old is not None:  # its drafter ends every row, its run stops its workers
            try:
                old.close()
            except Exception:  # noqa: BLE001 - slots a failed step left half-written: new ones follow
                log.exception("closing the old slots failed")
        return self._build_slots(sampling, penalties)

    def _build_slots(self, sampling: SamplingParams, penalties: Penalties) -> Slots:
        """Slots as this scheduler serves with (the slots it serves with are untouched);
        recorded for the other processes where it `replicate`s."""
        slots = Slots(self.engine, self.tokenizer, self.max_batch, self.max_len, self.strategy,
                      sampling=sampling, penalties=penalties, logprobs=self.logprobs, eos_ids=self.eos_ids,
                      prefill_chunk=self.prefill_chunk, fallback=not multiprocess(), step_budget=self.step_budget,
                      penalty_rows=True, prefix_cache=self.prefix_cache)
        return slots if self.replicate is None else self.replicate.built(slots, sampling, penalties)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(len(self.running), len(self.waiting))

