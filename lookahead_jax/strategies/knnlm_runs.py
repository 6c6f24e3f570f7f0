"""The runs of `strategy="knnlm"` (its options: `KNNLM`, knnlm.py): KNN-LM decoding, plain or
speculative (RaLMSpec), on the decode state.

Plain KNN-LM, one token per step for every row:

    h, logits = forward(root)               # final hidden state and logits at the root
    ids = search(h)                         # k nearest datastore entries (search.py)
    token = pick(log(lam p_kNN(ids) + (1 - lam) softmax(logits)))   # greedy or sampling

Speculative KNN-LM (`speculative=True`; RaLMSpec, Zhang et al. ICML'24): each row keeps a
cache of datastore ids: for every neighbour a real search returned, the entries after it,
id+1 .. id+n (n = knn_cache_next), since the text that follows a neighbour is likely to
follow here too (entries of a passage are consecutive). The newest `SPEC_CACHE` ids are
kept. A speculative step searches only the cache (`cache_search`: ranked by the same
canonical distances and (d, id) order) and picks its token with those neighbours. After s
speculative steps (`speculation_stride`, or "auto": OS3 below), one batched real search
over the s stored hidden states gives the true neighbours of each position; per row, in
order: where the speculated list equals the true one the token stands; at the first
position where it differs the token is picked again from the stored logits with the true
neighbours; if that changes the token, the row is cut back there (cache length set back to
the position + 1: the slot of the position's own input was written from a correct prefix)
and decodes on from the new token; if it gives the same token, the later positions stand
and are checked in turn. Every verified position's true neighbours feed the cache. The
first token of every row is picked with a real search (the caches start empty); a row that
ends with unverified positions ends the round (revived if verification changes a token).
knn_speculate="ivf" adds to a step's candidates the 2k + 8 that an approximate faiss IVF
index over the whole datastore proposes (search.py): where the text leaves the cached
passages, that keeps speculation right (1M entries: 99.7% of tokens kept).

Why the outputs are plain KNN-LM's, token for token. Induction over a row's positions:
if its tokens up to position p are plain's, its cache slots 0..p-1 hold the K/V plain
computed (the same forward, tokens and positions, the whole cache as the attention window,
a row's values not depending on the other rows; the one-program step's forward gives the
forward alone's bits: the tests compare log-probabilities bitwise), so h_p and the logits
at p are plain's; the true search of h_p returns plain's neighbours (exact search: the
exact top-k under the canonical distance, however batched; faiss: one query's answer does
not depend on the others); `choose` of (h_p, logits_p, true ids), one executable whose row
values depend on that row alone, is plain's pick (sampling keyed by (seed, row, position)).
A position keeps its token only if that pick equals it (a speculated list equal to the true
one, from `choose` alone, is that pick; the one-program step's pick is picked again), and
tokens after p stand only when the token at p is plain's. Log-probabilities are the pick's.

OS3 (`speculation_stride="auto"`, speculation.py's KNN-LM form): a round of s speculative
steps and one verification resolves E(s) = (1 - g^s) / (1 - g) positions (g: the measured
chance that a position keeps its token, over the last checks) in s a + b(s B) seconds (a: a
speculative step, b(n) = b0 + b1 n: a verification of n queries, B active rows), and
s = argmax_{0..16} E(s) / T(s), s = 0 being plain KNN-LM (a real step and search per
position), taken unless a stride is predicted 5% faster; s = 4 until a and b are measured.

speculative="auto" (knnlm_decision.py): the first DECIDE_AFTER positions are real steps, then
the costs measured there (`measure_costs`) decide once whether the run speculates or goes on
as plain KNN-LM (`KnnRun.step`).

Host logic; the device work is search.py's (`forward_fn`, the searches, `choose`, a
speculative step as one program: `spec_step_fn`), dispatched back to back within a round. The
decode state is edited only through decode.py's public edits: `accept` (the roots this
run's own step forwarded are committed, the picked tokens appended), `rollback` (back to
a wrong token's position, then `accept` of the right one), `set_logprob`, `accept_steps`.
Over several processes the lists a search returns, faiss's candidates, OS3's stride and the
"auto" decision are process 0's, broadcast (docs/multihost.md); the rest follows from them.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from ..core.decode import accept, call_compiled, rollback, set_logprob
from ..core.multihost import agree_choice, broadcast_plan, multiprocess
from ..knnlm.search import KnnlmStore, resolve_speculate
from .base import StrategyBase
from .knnlm_decision import DECIDE_AFTER, MIN_OUTCOMES, KnnCosts, SpeculationDecision, decide
from .speculation import (KNNLM_DEFAULT_STRIDE, SHADOW_EVERY, FinalTextStream, KnnMeasures, SpeculationStats,
                          SuccessorCache, os3_stride_knnlm)

__all__ = ["KnnRun", "KnnSpecRun"]
log = logging.getLogger(__name__)

SPEC_CACHE = 1024  # ids per row in the speculation cache (at least k)


# ----------------------------------------------------------------------------- runs
@dataclasses.dataclass
class _Step:
    """One speculative step of a round (device arrays stay on the device)."""
    h: object  # [B,D]
    logits: object  # [B,V]
    spec: object  # [B,k] speculated neighbour ids
    tok: np.ndarray  # [B]
    active: np.ndarray  # [B] rows that stepped
    pos: np.ndarray  # [B] position of each row's root (its input)
    nids: list  # generated ids of each row before this step's token
    lp: np.ndarray = None  # [B] log-probabilities of the tokens


class KnnRun:
    """Plain KNN-LM over the rows of a decode state (`strategies.base.Run`): requests enter
    rows with `add` (the prefill leaves each prompt's last token as the row's root:
    `picks_first_token`) and leave with `remove`; `step` is one forward, search and pick
    for every active row."""

    picks_first_token = True
    extra_tokens = 0
    extra_note = ""

    def __init__(self, strat: StrategyBase, tokenizer, n_rows: int, engine):
        # strat: a KNNLM (knnlm.py, which imports this module: not imported here)
        self.strat, self.tok, self.engine = strat, tokenizer, engine
        from ..knnlm.search import engine_index

        self.index = engine_index(engine, strat.datastore, strat.corpus)
        self.k = min(strat.knn_k, self.index.size)
        self.row_searches = np.zeros(int(n_rows), np.int64)  # real-search queries per row
        self.searches = 0  # of the requests that have left
        self.search_s = 0.0
        self.search_calls = 0
        self.fallbacks = 0

    def add(self, state, rows, prompt_ids, spans=None) -> list:
        for b in rows:
            self._reset(int(b))
        return [list(x) for x in prompt_ids]

    def _reset(self, b: int) -> None:
        self.searches += int(self.row_searches[b])
        self.row_searches[b] = 0

    def remove(self, rows) -> None:
        for b in rows:
            self._reset(int(b))

    def close(self) -> None:
        pass

    def final_upto(self, state, b: int) -> int:
        return len(state.rows[b].ids)

    # ---- device calls (`call_compiled`: compilations kept out of decode time)
    def _call(self, state, name, fn, *args, **static):
        return call_compiled(self.engine, state, name, fn, *args, **static)

    def _clock(self) -> float:
        """Seconds on the host clock less the compilation seen so far (timers exclude it)."""
        return time.perf_counter() - self.engine.compiled.compile_s

    def _forward(self, state, active):
        """Forward every row's root: (h [B,D] waited for, logits [B,V], the new cache, advanced
        for the active rows: `state.cache` is donated, the new one goes to `accept`)."""
        from ..knnlm.search import forward_fn

        eng = self.engine
        h, logits, cache = self._call(state, "knn_forward", forward_fn(eng.config, eng.mesh), eng.params,
                                      state.cache, eng.arg(state.root), eng.arg(active))
        h.block_until_ready()
        return h, logits, cache

    def _search(self, state, h, need=None):
        """True neighbour ids [Q,k] of the queries h [Q,D] (device or host array); `need`
        [Q]: the queries whose answer is used (others may be skipped)."""
        from ..knnlm.search import brute_search, exact_search, subset_search

        idx, k = self.index, self.k
        t0 = self._clock()
        if self.strat.knn_search == "exact":
            ids, ok = self._call(state, "knn_search", exact_search, idx.keys, h, idx.norms, idx.n_valid,
                                 idx.xmax, k=k)
            if multiprocess():  # process 0's lists and fallbacks (one buffer): every process redoes the same
                got = broadcast_plan(np.concatenate([np.asarray(ids), np.asarray(ok, np.int32)[:, None]], axis=1))
                ids, ok = got[:, :k], got[:, k].astype(bool)
            ok = np.asarray(ok) | (False if need is None else ~np.asarray(need))
            if not ok.all():  # a near-tie over the whole shortlist: redo by brute force
                ids = np.array(ids)
                for q in np.flatnonzero(~ok):
                    ids[q] = np.asarray(self._call(state, "knn_brute", brute_search, idx.keys, h[q:q + 1],
                                                   idx.n_valid, k=k))[0]
                self.fallbacks += int((~ok).sum())
                idx.fallbacks += int((~ok).sum())
        else:
            hq = np.asarray(h)
            cand = np.full((len(hq), 2 * k + 8), -1, np.int32)
            rows = np.arange(len(hq)) if need is None else np.flatnonzero(need)
            if len(rows):
                cand[rows] = idx.faiss_candidates(hq[rows], self.strat.knn_search, k)
            ids = self._call(state, "knn_subset", subset_search, idx.keys, h, self.engine.arg(cand),
                             idx.n_valid, k=k)
        ids = np.asarray(ids)
        self.search_s += self._clock() - t0
        self.search_calls += 1
        return ids

    def _choose_options(self, state):
        """(the arguments after the positions, the static options) of `choose` for this state."""
        s, suppress = self.strat, state.suppress()
        args = () if suppress is None else (self.engine.arg(suppress),)
        static = dict(lam=float(s.knn_lambda), temperature=float(s.knn_temperature), sampling=state.sampling,
                      logprobs=bool(state.logprobs))
        if suppress is not None:
            static["ban"] = tuple(int(t) for t in state.ban)
        return args, static

    def _choose(self, state, h, logits, ids, pos, opts=None, host: bool = True):
        """(tokens [B], log-probabilities [B]) of search.choose (host=False: on the device)."""
        from ..knnlm.search import choose

        eng = self.engine
        extra, static = self._choose_options(state) if opts is None else opts
        ids = ids if isinstance(ids, jax.Array) else eng.arg(np.asarray(ids, np.int32))  # device ids stay there
        args = (self.index.keys, h, logits, ids, self.index.values, state.seeds,
                state.rowids, eng.arg(np.asarray(pos, np.int32))) + extra
        tok, lp = self._call(state, "knn_choose", choose, *args, **static)
        return (np.asarray(tok), np.asarray(lp)) if host else (tok, lp)

    def _accept(self, state, active, tok, lp, cache) -> None:
        rows = np.flatnonzero(active)
        accept(state, rows, tok[rows], lp[rows], cache=cache)

    def _real_step(self, state, active):
        """A step with a real search for every active row: returns (its true ids [B,k], and
        for a look at what else could have been picked: h, logits, the roots' positions,
        the tokens picked)."""
        pos = state.lengths.copy()
        h, logits, cache = self._forward(state, active)
        ids = self._search(state, h, need=active)
        self.row_searches += active
        tok, lp = self._choose(state, h, logits, ids, pos)
        self._accept(state, active, tok, lp, cache)
        return ids, h, logits, pos, tok

    # ---- the loop
    def step(self, engine, state, drafter=None, rule=None, budget=None) -> None:
        """One real step (forward, search, pick) of every active row."""
        state.mark_finished()
        active = state.active
        if active.any():
            self._real_step(state, active)
        state.mark_finished()

    def row_stats(self, b: int) -> dict:
        return {"searches": int(self.row_searches[b])}

    def summary(self) -> dict:
        ds = self.index.datastore
        return {"retrieval": dict(
            datastore=str(ds.path), entries=ds.size, k=self.k, knn_lambda=self.strat.knn_lambda,
            knn_temperature=self.strat.knn_temperature, search=self.strat.knn_search,
            speculative=self.strat.speculative, searches=self.searches + int(self.row_searches.sum()),
            search_calls=self.search_calls, search_s=round(self.search_s, 4), brute_force_fallbacks=self.fallbacks,
        )}


class KnnSpecRun(KnnRun):
    """Speculative KNN-LM over the rows of a decode state (module docstring): KnnRun plus per
    row the speculation cache, the round's steps and the counters (`SpeculationStats`, as
    ralmspec's; `row_kept`: checks whose token stood, OS3's g). `step` is one round (a
    request's first token: one real step of the rows that have none)."""

    def __init__(self, strat: StrategyBase, tokenizer, n_rows: int, engine):
        super().__init__(strat, tokenizer, n_rows, engine)
        B = int(n_rows)
        self.M = max(SPEC_CACHE, self.k)
        self.cache = SuccessorCache(B, self.index.size, strat.knn_cache_next, self.M)
        self.stats = SpeculationStats(B)
        self.row_kept = np.zeros(B, np.int64)  # checks whose token stood
        self.kept = 0  # of the requests that have left
        self._pending = [None] * B  # generated ids before the row's first unverified token
        self._stream = FinalTextStream(tokenizer)
        s = self.strat  # OS3's measurements: kept on the engine across calls
        self.speculate = resolve_speculate(s.knn_speculate, self.index.size)  # "cache" or "ivf"
        store = engine.stores.of(KnnlmStore)
        key = (store.index[0], self.k, s.knn_lambda, s.knn_temperature, s.knn_cache_next,
               self.speculate, s.knn_nprobe)
        self.m = store.os3.setdefault(key, KnnMeasures())
        self.plain_rounds = 0  # rounds with s = 0 (this call)
        self._plain_hold = 0  # real steps left before OS3 is asked again (s = 0 chosen)
        self.ivf_s = 0.0  # host time in the IVF index (knn_speculate="ivf")
        self.plain = False  # speculative="auto" chose plain KNN-LM: `KnnRun.step` from then on
        self.decision = None if s.speculative == "auto" else SpeculationDecision(
            mode="forced", speculate=True, stride=s.speculation_stride)
        self.decision_s = 0.0  # the measurement and decision (speculative="auto")
        self._real, self._last = [], None  # the real steps' (forward, search, upkeep) s; the last's arrays
        if self.speculate == "ivf" and jax.process_index() == 0:  # (the only process that searches it)
            self.index.faiss_index("ivf")  # built (or read) now, not inside a timed step

    def add(self, state, rows, prompt_ids, spans=None) -> list:
        out = super().add(state, rows, prompt_ids, spans)
        for b in rows:
            self._stream.add(state.rows[int(b)])
        return out

    def _reset(self, b: int) -> None:
        super()._reset(b)
        self.cache.reset(b)
        self.stats.retire(b)
        self.kept += int(self.row_kept[b])
        self.row_kept[b] = 0
        self._pending[b] = None

    def remove(self, rows) -> None:
        super().remove(rows)
        for b in rows:
            self._stream.drop(int(b))

    def final_upto(self, state, b: int) -> int:
        return len(state.rows[b].ids) if self._pending[b] is None else self._pending[b]

    def _candidates(self) -> np.ndarray:
        return self.cache.ids()

    def _spec_cands(self, h, active, base: np.ndarray, dev=None):
        """What a speculative pick ranks, on the device: the caches' ids `base` [B,M] (`dev`:
        already there), with knn_speculate="ivf" followed by the IVF index's 2k + 8
        candidates for the active rows' hidden states h (this waits for h), those already
        in the row's cache dropped (the candidates of a row are distinct)."""
        if self.speculate != "ivf":
            return self.engine.arg(base) if dev is None else dev
        h = np.asarray(h)  # waits for the forward: timed as the step's, not the IVF's
        t0 = time.perf_counter()
        cand = self.index.with_ivf(base, h, active, self.k, self.strat.knn_nprobe)
        self.ivf_s += time.perf_counter() - t0
        return self.engine.arg(cand)

    def warm_up(self, state) -> int:
        """Queue the compilation, in the background, of the round's verification search for
        every round length it may run (1 .. the stride, or OS3's largest with "auto"): its
        T x B queries are one program per T (`_verify`, not padded). For `Slots.rehearse`;
        returns how many were queued."""
        from ..knnlm.search import exact_search, subset_search
        from .speculation import MAX_SPECULATION_STRIDE

        s, idx, eng, B = self.strat.speculation_stride, self.index, self.engine, state.batch
        D = int(eng.config.d_model)
        n = 0
        for T in range(1, (MAX_SPECULATION_STRIDE if s == "auto" else int(s)) + 1):
            h = eng.put(np.zeros((T * B, D), np.float32))  # the stacked steps' h: on the device, f32
            if self.strat.knn_search == "exact":
                n += eng.compiled.prefetch("knn_search", exact_search, idx.keys, h, idx.norms, idx.n_valid,
                                           idx.xmax, compile=True, k=self.k)
            else:
                cand = eng.arg(np.full((T * B, 2 * self.k + 8), -1, np.int32))
                n += eng.compiled.prefetch("knn_subset", subset_search, idx.keys, h, cand, idx.n_valid,
                                           compile=True, k=self.k)
        return n

    # ---- OS3
    def _stride(self, rows: int) -> int:
        s = self.strat.speculation_stride
        if s != "auto":
            return int(s)
        if not self.m.spec_steps and self.decision.mode == "auto":  # OS3's pick from the start's costs
            return int(self.decision.stride)
        return agree_choice(self.m.stride(rows, os3_stride_knnlm))[0]  # timed: process 0's

    # ---- speculative="auto": the decision (knnlm_decision.py)
    def _timed(self, fn, times: int = 2) -> float:
        """The least of `times` timed calls of fn (compilation excluded)."""
        best = float("inf")
        for _ in range(times):
            t0 = self._clock()
            fn()
            best = min(best, self._clock() - t0)
        return best

    def measure_costs(self, state) -> KnnCosts:
        """The costs speculative="auto" decides from (knnlm_decision.py): of the real steps so
        far the least forward (the step less its search), search and cache upkeep, and, timed
        now on the last real step's arrays, a search of s x B queries (its hidden states
        tiled), a speculative step's cache search and a re-pick. Tests replace it to decide
        from given costs. The run's counters do not count these calls."""
        from ..knnlm.search import cache_search

        h, logits, pos, active, true = self._last
        fwd, srch, upkeep = (min(x) for x in zip(*self._real))
        s = self.strat.speculation_stride
        s = KNNLM_DEFAULT_STRIDE if s == "auto" else int(s)
        ix, saved = self.index, (self.search_s, self.search_calls, self.fallbacks, self.index.fallbacks, self.ivf_s)
        probe_h, need = self.engine.put(np.tile(np.asarray(h), (s, 1))), np.tile(active, s)  # as a round's stack
        probe = self._timed(lambda: self._search(state, probe_h, need=need))
        spec = self._timed(lambda: np.asarray(self._call(
            state, "knn_cache", cache_search, ix.keys, h, self._spec_cands(h, active, self._candidates()), ix.norms,
            ix.n_valid, k=self.k)))
        repick = self._timed(lambda: self._choose(state, h, logits, true, pos))
        self.search_s, self.search_calls, self.fallbacks, ix.fallbacks, self.ivf_s = saved
        return KnnCosts(rows=state.batch, forward_s=fwd, search_s=srch, probe_queries=s * state.batch, probe_s=probe,
                        spec_s=spec, repick_s=repick, upkeep_s=upkeep)

    def _decide(self, state) -> None:
        """speculative="auto": decide once, from the costs measured now or by an earlier call
        of this engine with the same datastore, settings and batch (logged once, when measured)."""
        t0 = self._clock()
        costs = self.m.costs.get(state.batch)
        reused = costs is not None
        if costs is None:
            costs = self.m.costs[state.batch] = self.measure_costs(state)
        n = len(self.m.outcomes)
        g = (sum(self.m.outcomes) + 1) / (n + 2) if n >= MIN_OUTCOMES else None
        self.decision = decide(costs, self.strat.speculation_stride, g, reused=reused)
        if multiprocess():  # from this process's timings: process 0's choice on every process
            go, stride = agree_choice(self.decision.speculate, self.decision.stride)
            self.decision = dataclasses.replace(self.decision, speculate=bool(go), stride=stride)
        (log.debug if reused else log.info)(self.decision.line())
        self.plain = not self.decision.speculate
        self._last = None
        self.decision_s += self._clock() - t0

    # ---- steps
    def _spec_round(self, state, active, s: int, base, dev) -> list:
        """Up to s speculative steps of the active rows, dispatched back to back, each one
        program (`spec_step_fn`; "ivf": forward, then faiss on the host, search and pick) whose
        tokens are the next step's roots on the device; the host reads them two steps later,
        so the device never waits for it. A row that ends (EOS seen, max_new_tokens) ends the
        round; `accept_steps` drops what a row ran past its end (e.g. a stop string)."""
        from ..core.decode import accept_steps
        from ..knnlm.search import cache_search, forward_fn, next_roots, spec_step_fn

        eng, t0 = self.engine, self._clock()
        lengths, nids = state.lengths.copy(), np.array([len(r.ids) for r in state.rows])
        left = np.array([r.max_new - len(r.ids) for r in state.rows])
        opts, act = self._choose_options(state), eng.arg(active)
        root, cache, steps = eng.arg(state.root), state.cache, []
        for t in range(s):
            if t >= 2:  # the tokens of step t - 2 (step t - 1 is queued behind it)
                st = steps[t - 2]
                st.tok, st.lp = np.asarray(st.tok), np.asarray(st.lp)
                if any(int(st.tok[b]) in state.rows[b].eos_ids for b in np.flatnonzero(active)):
                    break
            if t and (left[active] <= t).any():
                break
            pos, ix = lengths + np.where(active, t, 0), self.index
            if self.speculate == "cache":  # one program (`spec_step_fn`)
                h, logits, cache, spec, tok, lp, root = self._call(
                    state, "knn_spec_step", spec_step_fn(eng.config, eng.mesh), eng.params, cache, root, act, ix.keys,
                    dev, ix.norms, ix.n_valid, ix.values, state.seeds, state.rowids, eng.arg(pos.astype(np.int32)),
                    *opts[0], k=self.k, **opts[1])
            else:  # faiss proposes on the host, from h
                h, logits, cache = self._call(state, "knn_forward", forward_fn(eng.config, eng.mesh), eng.params,
                                              cache, root, act)
                spec = self._call(state, "knn_cache", cache_search, ix.keys, h, self._spec_cands(h, active, base, dev),
                                  ix.norms, ix.n_valid, k=self.k)
                tok, lp = self._choose(state, h, logits, spec, pos, opts, host=False)
                root = self._call(state, "knn_roots", next_roots, root, tok, act)
            steps.append(_Step(h, logits, spec, tok, active, pos, list(nids + t), lp))
        for st in steps:  # the wait for the last tokens
            st.tok, st.lp = np.asarray(st.tok), np.asarray(st.lp)
        for b in np.flatnonzero(active):
            if self._pending[b] is None:
                self._pending[b] = int(nids[b])
        accept_steps(state, [st.active for st in steps], [st.tok for st in steps], [st.lp for st in steps], cache)
        self.stats.speculations += len(steps) * active
        dt = self._clock() - t0
        self.m.step_s += dt
        self.stats.spec_s += dt  # the cache searches are not timed apart (no sync): the steps' time
        self.stats.spec_calls += len(steps)
        self.m.spec_steps += len(steps)
        return steps

    def _plain_step(self, state, active, shadow: bool) -> None:
        """A real step (forward, search, pick) of the active rows; their true neighbours
        feed the caches. Timed for OS3: a0 (the step less its search and shadow) and a
        verification sample (the search of the active rows' queries). shadow: also the pick
        speculation would have made from each row's cache, noted as a check outcome (kept or
        not) and otherwise unused."""
        from ..knnlm.search import cache_search

        t0, s0 = self._clock(), self.search_s
        true, h, logits, pos, tok = self._real_step(state, active)
        searched = self.search_s - s0
        t1 = self._clock()
        forward = t1 - t0 - searched
        if shadow:  # reads h and logits only (the step donated the cache, not these)
            spec = self._call(state, "knn_cache", cache_search, self.index.keys, h,
                              self._spec_cands(h, active, self._candidates()), self.index.norms,
                              self.index.n_valid, k=self.k)
            stok, _ = self._choose(state, h, logits, spec, pos)
            for b in np.flatnonzero(active):
                self.m.outcomes.append(bool(stok[b] == tok[b]))
        t2 = self._clock()
        for b in np.flatnonzero(active):
            self.cache.insert(b, true[b])
        if self.decision is None:  # speculative="auto" before its decision: what it is measured from
            self._real.append((forward, searched, self._clock() - t2))
            self._last = (h, logits, pos, active, true)
        self.m.verify_log.append((int(active.sum()), searched))
        self.m.plain_s += self._clock() - t0 - searched - (t2 - t1)
        self.m.plain_steps += 1

    def _verify(self, state, steps: list) -> None:
        """One batched real search over the round's stored hidden states; per row the first
        position whose token changes is cut back (module docstring): `rollback` to that
        position (its slot holds the K/V of a correct prefix), then `accept` of the token
        picked with the true neighbours."""
        import jax.numpy as jnp

        t0 = self._clock()
        st_ = self.stats
        T, B = len(steps), state.batch
        # T x B queries, not padded to a power of two of rounds: on CPU the search's cost grows
        # with every query (the shortlist kernel computes them all), a compile per T is ~1 s
        need = np.concatenate([st.active for st in steps])
        true = self._search(state, jnp.concatenate([st.h for st in steps], axis=0), need=need).reshape(T, B, self.k)
        st_.verify_calls += 1
        spec = np.stack([st.spec for st in steps])  # [T,B,k]
        checking = set(np.flatnonzero(np.any([st.active for st in steps], axis=0)).tolist())
        self.row_searches += np.sum([st.active for st in steps], axis=0)
        for t, st in enumerate(steps):
            fix = []  # rows whose pick is taken again with the true neighbours
            for b in sorted(checking):
                r = state.rows[b]
                if not st.active[b] or st.nids[b] >= len(r.ids):  # the row had ended before t
                    checking.discard(b)
                    continue
                st_.checks[b] += 1
                self.cache.insert(b, true[t, b])
                hit = np.array_equal(spec[t, b], true[t, b])
                st_.hits[b] += int(hit)
                if hit and self.speculate != "cache":  # the pick was `choose` alone's: plain's
                    self.row_kept[b] += 1
                    self.m.outcomes.append(True)
                else:  # other neighbours, or the one-program step's pick (`spec_step_fn`)
                    fix.append(b)
            if not fix:
                continue
            tok, lp = self._choose(state, st.h, st.logits, true[t], st.pos)
            for b in fix:
                self.m.outcomes.append(bool(tok[b] == st.tok[b]))
                if tok[b] == st.tok[b]:  # the same token: later positions stand
                    self.row_kept[b] += 1
                    set_logprob(state, b, st.nids[b], lp[b])
                    continue
                st_.rolled_back(b, len(state.rows[b].ids) - st.nids[b])
                rollback(state, [b], int(st.pos[b]))  # the position's own input is the root again
                accept(state, [b], [tok[b]], [lp[b]])  # its slot was written from a correct prefix
                checking.discard(b)
        self._pending = [None] * B
        state.mark_finished()
        dt = self._clock() - t0
        st_.verify_s += dt
        self.m.verify_log.append((int(need.sum()), dt))

    def step(self, engine, state, drafter=None, rule=None, budget=None) -> None:
        """One turn: the rows that have no token yet (new requests: their caches are empty)
        take a real step; otherwise one round of s speculative steps and its verification,
        ended early when a row ends (it is verified before it is final), or, where OS3
        picks s = 0, one real step of every active row. speculative="auto": real steps until
        the decision, then, where it chose plain KNN-LM, `KnnRun.step`."""
        if self.plain:
            KnnRun.step(self, engine, state)
            self._stream.flush(state, self.final_upto)
            return
        state.mark_finished()
        active = state.active
        fresh = active & np.array([not r.ids for r in state.rows])
        if fresh.any():  # a request's first token: a real search
            self._plain_step(state, fresh, shadow=False)
        elif active.any() and self.decision is None:  # speculative="auto", undecided: a real step
            self._plain_step(state, active, shadow=False)
        elif active.any():
            s = 0 if self._plain_hold else self._stride(int(active.sum()))
            if s == 0:  # plain KNN-LM pays more here (OS3): SHADOW_EVERY real steps, then ask again
                if not self._plain_hold:
                    self._plain_hold = SHADOW_EVERY
                shadow = self._plain_hold == SHADOW_EVERY  # the first of them checks in the shadow
                self._plain_hold -= 1
                self.plain_rounds += 1
                self._plain_step(state, active, shadow=shadow)
                self.stats.strides.append(0)
                state.mark_finished()
                self._stream.flush(state, self.final_upto)
                return
            base = self._candidates()
            dev = None if self.speculate == "ivf" else self.engine.arg(base)
            steps = self._spec_round(state, active, s, base, dev)
            self.stats.strides.append(s)
            self._verify(state, steps)
        if self.decision is None and len(self._real) >= DECIDE_AFTER:
            self._decide(state)
        state.mark_finished()
        self._stream.flush(state, self.final_upto)

    def row_stats(self, b: int) -> dict:
        return dict(super().row_stats(b), **self.stats.row_stats(b))

    def summary(self) -> dict:
        out = super().summary()
        d = self.decision.as_dict() if self.decision is not None else dict(mode="auto", speculate=None, stride=None)
        out["retrieval"].update(self.stats.summary(), tokens_kept=self.kept + int(self.row_kept.sum()),
                                speculate=self.speculate, speculation_decision=d, decision_s=round(self.decision_s, 4))
        if self.speculate == "ivf":
            out["retrieval"].update(ivf_s=round(self.ivf_s, 4), nprobe=self.strat.knn_nprobe)
        return out
