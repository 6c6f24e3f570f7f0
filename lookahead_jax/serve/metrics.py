"""Prometheus metrics named as vLLM's, with the prefix `lookahead_jax:` (so dashboards
built for `vllm:` adapt by a rename):

    lookahead_jax:time_to_first_token_seconds    histogram  arrival -> first token
    lookahead_jax:inter_token_latency_seconds    histogram  between a request's outputs (one
                                                            per step; a speculative step may
                                                            bring several tokens, as in vLLM)
    lookahead_jax:e2e_request_latency_seconds    histogram  arrival -> finish
    lookahead_jax:request_queue_time_seconds     histogram  arrival -> prefill starts
    lookahead_jax:prompt_tokens_total, generation_tokens_total          counters
    lookahead_jax:request_success_total{finished_reason}                counter
    lookahead_jax:num_requests_running, num_requests_waiting            gauges
    lookahead_jax:spec_decode_num_drafts_total          rows verified with a non-empty draft
    lookahead_jax:spec_decode_num_draft_tokens_total    their draft tokens (tree nodes)
    lookahead_jax:spec_decode_num_accepted_tokens_total draft tokens accepted
    lookahead_jax:spec_decode_num_accepted_tokens_per_pos_total{position}

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts
(tokens per speculative step).

A retrieval strategy's run (ralm, ralmspec, knnlm) keeps its own counters
(`Run.summary()["retrieval"]`); they are exported as counters too (no vLLM equivalent):

    lookahead_jax:retrieval_calls_total            calls to the full index / datastore search
                                                   (batched: a call answers several queries)
    lookahead_jax:retrieval_queries_total          queries those calls answered
    lookahead_jax:retrieval_seconds_total          seconds in them
    lookahead_jax:retrieval_reprefills_total       rows re-prefilled with a new passage (ralm*)
    lookahead_jax:retrieval_speculations_total     speculated boundaries (ralmspec) / positions
                                                   (speculative knnlm)
    lookahead_jax:retrieval_speculation_checks_total  of those, checked by a verification
    lookahead_jax:retrieval_speculation_hits_total    checked and right
    lookahead_jax:retrieval_rollbacks_total        rollbacks to a wrong speculation
    lookahead_jax:retrieval_rollback_tokens_total  generated tokens they took back
    lookahead_jax:retrieval_verify_calls_total     batched verifications (part of retrieval_calls)

speculation accuracy = hits / checks (`speculation.SpeculationStats`).

The prefix cache (`--prefix-cache-mb`, `core.prefix_cache`), as vLLM's counters (tokens):

    lookahead_jax:prefix_cache_queries_total    prompt tokens looked up in the prefix cache
    lookahead_jax:prefix_cache_hits_total       of those, served from it (hit rate = hits / queries)
    lookahead_jax:prefix_cache_evictions_total  blocks evicted (least recently used)
    lookahead_jax:prefix_cache_bytes            bytes of K/V it holds now (gauge; its bound: the flag)
    lookahead_jax:prefix_cache_warm_jobs_total       warm jobs begun (a chat's answer for its next turn)
    lookahead_jax:prefix_cache_warm_tokens_total     tokens the warm jobs stored (whole blocks)
    lookahead_jax:prefix_cache_warm_cancelled_total  warm jobs cut short (a request needed the slot)

Each `Metrics` has its own registry (several servers in one process, as in the tests, do
not collide).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "lookahead_jax:"
LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0)
MAX_POSITIONS = 32  # accepted-per-position counters kept for positions 0..31
# metric name -> (the prefix cache's counter, help)
PREFIX = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache"),
    "prefix_cache_evictions": ("prefix_cache_evictions", "Prefix cache blocks evicted (least recently used)"),
    "prefix_cache_warm_jobs": ("prefix_cache_warm_jobs", "Prefix cache warm jobs begun (a chat's answer)"),
    "prefix_cache_warm_tokens": ("prefix_cache_warm_tokens", "Tokens prefix cache warm jobs stored"),
    "prefix_cache_warm_cancelled": ("prefix_cache_warm_cancelled", "Prefix cache warm jobs cut short by a request"),
}
# metric name (after "retrieval_") -> the run's counter names (ralm / ralmspec's, knnlm's)
RETRIEVAL = {
    "calls": ("retrieval_calls", "search_calls", "Calls to the full retrieval index or datastore search"),
    "queries": ("retrievals", "searches", "Queries answered by the full index or datastore search"),
    "seconds": ("retrieval_s", "search_s", "Seconds in retrieval"),
    "reprefills": ("reprefills", None, "Rows re-prefilled with a new passage"),
    "speculations": ("speculations", "speculations", "Speculated retrieval boundaries / positions"),
    "speculation_checks": ("speculation_checks", "speculation_checks", "Speculations checked by a verification"),
    "speculation_hits": ("speculation_hits", "speculation_hits", "Speculations checked and right"),
    "rollbacks": ("rollbacks", "rollbacks", "Rollbacks to a wrong speculation"),
    "rollback_tokens": ("rollback_tokens", "rollback_tokens", "Generated tokens taken back by rollbacks"),
    "verify_calls": ("verify_calls", "verify_calls", "Batched verifications of speculations"),
}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", lab, registry=r,
                              buckets=LATENCY)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between a request's outputs", lab,
                             registry=r, buckets=LATENCY)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency", lab, registry=r,
                             buckets=LATENCY)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time waiting for a slot", lab,
                                    registry=r, buckets=LATENCY)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefilled prompt tokens", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", lab, registry=r)
        self.success = Counter(P + "request_success", "Finished requests", lab + ["finished_reason"], registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in a slot", lab, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a slot", lab, registry=r)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Rows verified with a draft", lab, registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified", lab, registry=r)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", lab, registry=r)
        self.accepted_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                    "position", lab + ["position"], registry=r)
        self.retrieval_counters = {k: Counter(P + "retrieval_" + k, h, lab, registry=r)
                                   for k, (_, _, h) in RETRIEVAL.items()}
        self.prefix_counters = {k: Counter(P + k, h, lab, registry=r) for k, (_, h) in PREFIX.items()}
        self.prefix_bytes = Gauge(P + "prefix_cache_bytes", "Bytes of K/V the prefix cache holds", lab, registry=r)
        self.programs_compiled = Gauge(P + "programs_compiled", "Step programs of this configuration compiled",
                                       lab, registry=r)
        self.programs_total = Gauge(P + "programs_total", "Step programs of this configuration", lab, registry=r)
        self.compile_seconds = Gauge(P + "compile_seconds", "Seconds spent compiling step programs (background "
                                     "included)", lab, registry=r)
        self.name = model_name
        self._pos: dict = {}
        self._run, self._seen = None, {}  # the run last read, and its counters then
        self._prefix_seen: dict = {}  # the prefix cache's counters last read

    # ------------------------------------------------------------------ engine-thread hooks
    def admitted(self, job, t_prefill: float) -> None:
        self.queue_time.labels(self.name).observe(t_prefill - job.arrival)
        self.prompt_tokens.labels(self.name).inc(len(job.prompt_ids))

    def tokens(self, job, n: int, now: float) -> None:
        """n tokens reached `job` at `now` (before job.t_first / t_last are updated)."""
        if job.t_first is None:
            self.ttft.labels(self.name).observe(now - job.arrival)
        else:
            self.itl.labels(self.name).observe(now - job.t_last)
        self.generation_tokens.labels(self.name).inc(n)

    def finished(self, job, reason: str) -> None:
        self.success.labels(self.name, reason).inc()
        if reason not in ("abort", "error"):
            self.e2e.labels(self.name).observe(time.perf_counter() - job.arrival)

    def speculation(self, result, rows) -> None:
        """One step's StepResult over the drafting `rows`."""
        for b in rows:
            nodes = int(result.drafted[b])
            if nodes <= 0:
                continue
            acc = int(result.n_emit[b]) - 1
            self.drafts.labels(self.name).inc()
            self.draft_tokens.labels(self.name).inc(nodes)
            self.accepted.labels(self.name).inc(acc)
            for i in range(min(acc, MAX_POSITIONS)):
                if i not in self._pos:
                    self._pos[i] = self.accepted_pos.labels(self.name, str(i))
                self._pos[i].inc()

    def retrieval(self, run) -> None:
        """A retrieval run's counters after a step: what they gained since the last read
        (slots rebuilt with new values bring a new run, whose counters start at 0)."""
        if run is not self._run:
            self._run, self._seen = run, {}
        now = run.summary()["retrieval"]
        for k, names in RETRIEVAL.items():
            v = next((now[n] for n in names[:2] if n is not None and n in now), None)
            if v is None:
                continue
            gained = v - self._seen.get(k, 0)
            if gained > 0:
                self.retrieval_counters[k].labels(self.name).inc(gained)
            self._seen[k] = max(v, self._seen.get(k, 0))

    def prefix_cache(self, slots) -> None:
        """The prefix cache's counters (`Slots.prefix`; none: nothing): what they gained
        since the last read (the cache lives on the engine: its counters only grow)."""
        rows = getattr(slots, "prefix", None)
        if rows is None:
            return
        now = rows.cache.summary()
        for k, (name, _) in PREFIX.items():
            gained = now[name] - self._prefix_seen.get(k, 0)
            if gained > 0:
                self.prefix_counters[k].labels(self.name).inc(gained)
            self._prefix_seen[k] = max(now[name], self._prefix_seen.get(k, 0))
        self.prefix_bytes.labels(self.name).set(now["prefix_cache_bytes"])

    def programs(self, info: dict) -> None:
        """The step programs' compilation (`Scheduler.programs`)."""
        for gauge, key in ((self.programs_compiled, "programs_ready"), (self.programs_total, "programs_total"),
                           (self.compile_seconds, "compile_s")):
            if info.get(key) is not None:
                gauge.labels(self.name).set(info[key])

    def queue(self, running: int, waiting: int) -> None:
        self.running.labels(self.name).set(running)
        self.waiting.labels(self.name).set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
