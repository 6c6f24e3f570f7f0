"""SpecInfer's drafter: a small model ("SSM") grows a token tree on device, one level per
forward, over its own KV cache.

Tree shape (expansion-based, SpecInfer's): per-depth widths, e.g. (1, 1, 3, 1, 1, 1, 1, 1):
the root gets 1 child, that node 1, the next 3, and each of those a chain of 5 more: 20
nodes. Nodes are laid out level by level (children of one parent contiguous, in the
order they were drawn), which is topological and best-first within a level:

    expansion (2, 2) -> parents [-1, -1, 0, 0, 1, 1]   (levels [1, 1, 2, 2, 2, 2])

One jitted call per decode step (`draft_tree_step`) does, for every row at once:
1. commit the draft K/V of the previous step's accepted path (`models.cache.commit`, the
   path the target accepted: block index i is node i - 1, as in the target's block);
2. catch up: forward the (at most 2) context tokens the draft cache lacks: the root,
   and the accepted node of the deepest level when it was accepted (that level is never
   forwarded: nothing is drawn from it);
   (a row further behind, e.g. a prompt not yet forwarded: the draft forwards context only
   when a step drafts, so a budget that decodes plainly costs it nothing, is caught up
   first by a prefill-like forward of what it lacks, `_catch_up`; with the prefix cache a
   row with an empty draft cache goes in the target's prefill blocks, cached units first:
   `drafters.draft_prefix`);
3. for each level d: draw w_d children of every node of level d - 1 from the draft's
   distribution there, then forward the new level (positions length + d, written after the
   committed slots at the node's block slot, a tree mask over its ancestors) to get the
   distributions of the next level.
Returns the tokens [B, N] and, for speculative sampling, the distribution every node's
children were drawn from, `q [B, 1+N, V]` (block order: the root first; zeros for the
last level), which stays on device and goes straight to the verify step.

How children are drawn (`mode`, per step: "greedy" when every live row is greedy, else
the drafter's sampler; each row with its own sampling values, `sampling.RowSampling`,
and a greedy row among sampled ones draws as in "greedy"):
- "greedy" (temperature 0): the top-w_d tokens; verified by `TokenMatch`: the output is
  plain greedy decoding's.
- "mss": w_d tokens drawn *without replacement* from q (Gumbel-top-k: the top w_d of
  log q + Gumbel noise, keyed by (seed, row, root position) and the parent node), so that
  `acceptance.SpecSampling` is exact.
- "invariant": the top w_d of log q + the Gumbel noise the *target* uses at that position
  (`sampling.position_keys`: `jax.random.categorical` is argmax(logits + gumbel(key))).
  Verified by `TokenMatch`: the output is token for token what plain sampling with that
  seed gives, for any draft; when the draft's distribution is close to the target's its
  first child is the target's own sample, so acceptance stays high.

Sliding-window layers (Gemma 3) see tree slots at slightly wrong positions in the draft
(`key_positions` assumes a compact cache); that only changes the draft's proposals, never
the output, which the target verifies.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..core.drafts import EMPTY, Draft, DraftBatch
from ..models import advance, commit, hidden_states, logits_from_hidden
from ..models.config import ModelConfig
from ..core.inputs import StepInputs, StepMode
from ..core.multihost import multiprocess, to_host
from ..core.sharding import replicate
from ..core.sampling import RowSampling, filter_logits, position_keys
from ..core.verify import window_for

# a depth-4 chain: on a 2-core CPU the draft's forwards (one per level) dominate a step, and
# this beat SpecInfer's 20-node tree (1, 1, 3, 1, 1, 1, 1, 1) by 2x (bench/results/README.md);
# wider trees pay where a level costs little (GPUs: not measured yet)
DEFAULT_EXPANSION = (1, 1, 1, 1)
MAX_WIDTH = 16
MAX_DEPTH = 32
SALT_DRAFT = 0x5EC3  # the "mss" draft's key stream (apart from the acceptance streams)
CATCH_UP = 2  # context tokens the draft forwards before its tree in a step


def expansion_tree(expansion: Sequence[int]) -> tuple:
    """(parents, levels) of the expansion-based tree (module docstring).

    # expansion_tree((2, 2)) -> ([-1, -1, 0, 0, 1, 1], [1, 1, 2, 2, 2, 2])
    """
    parents, levels, prev = [], [], [-1]
    for d, w in enumerate(expansion, 1):
        level = []
        for p in prev:
            for _ in range(w):
                level.append(len(parents))
                parents.append(p)
                levels.append(d)
        prev = level
    return parents, levels


def check_expansion(expansion, max_nodes: int = 128) -> tuple:
    """The expansion as a tuple of ints, or a ValueError naming the allowed ranges."""
    try:
        exp = tuple(int(w) for w in expansion)
    except (TypeError, ValueError):
        raise ValueError(f"expansion must be a sequence of per-depth widths like (1, 1, 3, 1), got {expansion!r}") from None
    if not 1 <= len(exp) <= MAX_DEPTH:
        raise ValueError(f"expansion needs 1 to {MAX_DEPTH} depths, got {len(exp)}")
    if any(not 1 <= w <= MAX_WIDTH for w in exp):
        raise ValueError(f"expansion widths must be in [1, {MAX_WIDTH}], got {exp}")
    n = len(expansion_tree(exp)[0])
    if n > max_nodes:
        raise ValueError(f"expansion {exp} makes a tree of {n} nodes; at most {max_nodes} are verified in one step")
    return exp


def _ancestors(parents) -> np.ndarray:
    """anc [N, N]: anc[i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    anc = np.zeros((n, n), bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def _gumbel(keys, V):
    """Gumbel noise [..., V] for keys [..., 2], as `jax.random.categorical` draws it."""
    flat = keys.reshape(-1, keys.shape[-1])
    g = jax.vmap(lambda k: jax.random.gumbel(k, (V,)))(flat)
    return g.reshape(keys.shape[:-1] + (V,))


def draw_children(logits, width: int, sampling, mode: str, noise=None):
    """Children of nodes with draft logits [..., V]: (tokens [..., width], q [..., V]).

    greedy: the top `width` tokens. "mss"/"invariant": the top `width` of the filtered
    logits + `noise` (Gumbel, [..., V]): for "mss" that is `width` draws without replacement
    from q (Gumbel-top-k), in draw order. q = the filtered softmax (zeros when greedy).
    sampling: `SamplingParams`, or each row's `RowSampling` (logits [B,...,V]; its greedy
    rows draw as "greedy")."""
    top = jax.lax.top_k(logits, width)[1].astype(jnp.int32)
    if mode == "greedy":
        return top, jnp.zeros_like(logits)
    filt = filter_logits(logits, sampling)
    toks = jax.lax.top_k(filt + noise, width)[1].astype(jnp.int32)
    q = jax.nn.softmax(filt, axis=-1)
    if isinstance(sampling, RowSampling):
        sampled = (sampling.temperature > 0).reshape((-1,) + (1,) * (logits.ndim - 1))  # [B,1,..]
        toks, q = jnp.where(sampled, toks, top), jnp.where(sampled, q, 0.0)
    return toks, q


def draft_tree_step(params, cache, catch, n_catch, commit_src, commit_n, seed, row, sampling=None, *,
                    config: ModelConfig, expansion: tuple, mode: str, window: int):
    """The draft's step (module docstring). Returns (tokens [B,N], q [B,1+N,V], cache);
    the cache's length ends after the root (the tree's slots are written, uncommitted).
    sampling: each row's `RowSampling` (None with mode "greedy")."""
    parents, levels = expansion_tree(expansion)
    N, D = len(parents), len(expansion)
    anc = jnp.asarray(_ancestors(parents))
    cache = commit(cache, commit_src, commit_n)
    B, C = catch.shape
    pos = cache.length[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    s = jnp.arange(window)[None, None, :]
    h, cache = hidden_states(params, catch, pos, cache, s <= pos[:, :, None], config)
    last = jnp.take_along_axis(h, jnp.maximum(n_catch - 1, 0)[:, None, None], axis=1)
    logits = logits_from_hidden(params, last, config)  # [B,1,V] at the root
    cache = advance(cache, n_catch)
    base = cache.length  # the root sits at slot base - 1, position L = base - 1
    L = base - 1
    V = logits.shape[-1]
    root_keys = position_keys(seed, row, L[:, None])[:, 0]  # [B,2]

    toks_all, q_all = [], [None] * (1 + N)
    prev = [0]  # block indices of the previous level (the root)
    first = 0  # node index of the level's first node
    for d, w in enumerate(expansion, 1):
        noise = None
        if mode == "mss":  # per parent node: its own draws
            pk = jax.vmap(lambda k: jax.vmap(
                lambda i: jax.random.fold_in(jax.random.fold_in(k, SALT_DRAFT), i))(jnp.asarray(prev)))(root_keys)
            noise = _gumbel(pk, V)  # [B,n_prev,V]
        elif mode == "invariant":  # the target's own noise at the children's position
            noise = _gumbel(position_keys(seed, row, (L + d)[:, None]), V)  # [B,1,V]
        toks, q = draw_children(logits, w, sampling, mode, noise)  # [B,n_prev,w], [B,n_prev,V]
        for j, blk in enumerate(prev):
            q_all[blk] = q[:, j]
        level = toks.reshape(B, -1)  # [B,n_prev*w], parents contiguous
        toks_all.append(level)
        n = level.shape[1]
        if d < D:  # forward the level: the next level's distributions
            nodes = np.arange(first, first + n)
            rel = s - base[:, None, None]  # slot offset inside the tree
            in_tree = (rel >= 0) & (rel < N)
            seen = jnp.take(anc[nodes], jnp.clip(rel, 0, N - 1)[:, 0, :], axis=1)  # [n,B,W]
            mask = (rel < 0) | (in_tree & jnp.transpose(seen, (1, 0, 2)))
            positions = jnp.broadcast_to((L + d)[:, None], (B, n))
            hl, written = hidden_states(params, level, positions, cache.replace(length=base + first), mask, config)
            cache = written.replace(length=base)
            logits = logits_from_hidden(params, hl, config)  # [B,n,V]
            prev = list(range(first + 1, first + n + 1))
        first += n
    tokens = jnp.concatenate(toks_all, axis=1)  # [B,N]
    zeros = jnp.zeros((B, V), jnp.float32)
    q = jnp.stack([zeros if x is None else x for x in q_all], axis=1)  # [B,1+N,V]
    return tokens, q, cache


@functools.lru_cache(maxsize=None)
def jitted_draft_tree(config: ModelConfig, expansion: tuple, mode: str):
    return jax.jit(functools.partial(draft_tree_step, config=config, expansion=expansion, mode=mode),
                   donate_argnums=(1,), static_argnames=("window",))


@jax.jit
def _commit_only(params, cache, src, n):
    """The draft's pending commit alone (a catch-up's, before its prefill). `params` is not
    read: the engine's compiled steps (`CompiledFunctions`) take the params first, so this
    one is compiled, checked and queued in the background as the draft's other steps are."""
    del params
    return commit(cache, src, n)


# how the draft's children are drawn under sampling: "mss" (its own distribution, for
# multi-step speculative sampling) or "invariant" (the target's position-keyed noise)
SAMPLERS = ("mss", "invariant")


class ModelDrafter:
    """The draft-model drafter (module docstring); implements `drafters.base.Drafter`.

    engine: the draft model's `Engine` (`engine_for(draft_model)`). sampler: how children
    are drawn when the call samples ("mss" or "invariant"; greedy calls draw the top-k)."""

    def __init__(self, engine, expansion: Sequence[int] = DEFAULT_EXPANSION, sampler: str = "mss"):
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.engine = engine
        self.expansion = check_expansion(expansion)
        self.parents, self.levels = expansion_tree(self.expansion)
        self.max_nodes = len(self.parents)
        self.sampler = sampler
        self.mode = "greedy"
        self.cache = None
        self.draft_s = 0.0  # host wall time inside propose (the draft's forwards included)
        self.steps = 0
        self._proposed = False  # this step verifies a tree of ours (`update` commits its path)
        self.compile_s = 0.0  # the draft's compilations in this request
        self.catch_up_s = 0.0  # host seconds of `propose` spent forwarding context the draft missed
        # set by a budget for one step (a probe): active rows whose draft context lags by more
        # than this many tokens get no draft (the one that lags least always does), so the
        # step's catch-up stays small; None: every active row drafts
        self.probe_lag = None
        self.drafted = np.zeros(0, bool)  # the rows the last propose drafted for
        self._ready: set = set()  # (mode, window, rows) of tree steps found compiled (`_compiled`)
        self.prefix = None  # the draft's prefix cache (`use_prefix`; None: a new row's context in one block)

    def use_prefix(self, state, chunk: int, capacity: int) -> None:
        """Forward a row whose draft cache is empty in the target's prefill blocks of `chunk`
        tokens (`drafters.draft_prefix`), taking units cached in its engine's prefix cache
        first and storing its own (capacity bytes; 0: no cache, the blocks alone). `Slots`
        calls it with prefill_chunk, so the draft runs the same programs with the prefix
        cache on or off."""
        from .draft_prefix import DraftPrefix

        self.prefix = DraftPrefix(self.engine, state.batch, state.max_len, state.block, chunk, capacity)

    # ------------------------------------------------------------------ protocol
    def begin(self, state, references=None, rows=None) -> None:
        if rows is not None and self.cache is not None:  # new requests on these rows only
            self.seeds, self.rowids = state.seeds, state.rowids  # the state's, with the rows' seeds
            self.rollback(rows, 0)  # their prompts are forwarded by the first step that drafts
            return  # (`propose`): none while a budget keeps decoding plainly
        B, S = state.batch, state.max_len
        self.seeds, self.rowids = state.seeds, state.rowids
        self.cache = self.engine.init_cache(B, S)
        self.base = np.zeros(B, np.int64)  # the device cache's length (before pending commits)
        self.commit_src = np.zeros((B, len(self.expansion)), np.int32)
        self.commit_n = np.zeros(B, np.int32)
        self.draft_s, self.steps = 0.0, 0
        self.compile_s = self.catch_up_s = 0.0  # the prompts: forwarded by the first step that drafts

    def propose(self, state, budget: int) -> DraftBatch:
        t0, c_start, u_start = time.perf_counter(), self.engine.compiled.compile_s, self.catch_up_s
        B, S = state.batch, state.max_len
        L = np.asarray(state.lengths)
        active = state.active
        if self.probe_lag is not None and active.any():  # a probe: the rows that lag little
            lag = np.where(active, L + 1 - self.dlen, np.iinfo(np.int64).max)
            active = active & (lag <= CATCH_UP + self.probe_lag)
            active[int(np.argmin(lag))] = True
        self.probe_lag = None
        behind = active & (L + 1 - self.dlen > CATCH_UP)  # a new request, plain steps or a rollback
        upto = np.where(behind, L, self.dlen)
        e = self.engine
        sampling = state.row_sampling()  # each row's own values (None: every live row greedy)
        mode = "greedy" if sampling is None else self.sampler
        window = window_for(int(L[active].max()) + 2 + self.max_nodes, S)
        if state.fallback and not self._compiled(state, upto if behind.any() else None, sampling, mode, window):
            self.drafted = np.zeros(B, bool)  # no tree this step (the target decodes plainly): never
            return DraftBatch.empty(B)  # wait for the draft's programs, which compile meanwhile
        self.drafted = active
        if behind.any():  # those rows only (the others catch up inside the step): a prefill of what they missed
            t1, c1 = time.perf_counter(), self.engine.compiled.compile_s
            self._catch_up(state, upto)
            c2 = self.engine.compiled.compile_s
            state.compile_s += c2 - c1  # compilation is not decode time
            self.compile_s += c2 - c1
            self.catch_up_s += time.perf_counter() - t1 - (c2 - c1)
        catch = np.zeros((B, CATCH_UP), np.int32)
        n_catch = np.zeros(B, np.int32)
        dlen = self.dlen  # (a property: computed once, not once per row)
        for b in np.flatnonzero(active):
            new = state.context(b)[int(dlen[b]):int(L[b]) + 1]
            catch[b, :len(new)] = new
            n_catch[b] = len(new)
        self.mode = mode
        fn, args = self._tree_step(catch, n_catch, sampling, mode)
        c0 = e.compiled.compile_s
        tokens, q, self.cache = e.compiled("draft", fn, *args, window=window)
        state.compile_s += e.compiled.compile_s - c0  # compilation is not decode time
        self.compile_s += e.compiled.compile_s - c0
        self.base = self.base + self.commit_n + n_catch
        self.commit_n = np.zeros(B, np.int32)
        tokens = to_host(tokens)  # (a global array over several processes: all-gathered where split)
        n = min(budget, self.max_nodes)
        drafts = tuple(Draft(tokens[b, :n].tolist(), self.parents[:n]) if live and n else EMPTY
                       for b, live in enumerate(active))
        self.draft_s += time.perf_counter() - t0 - (e.compiled.compile_s - c_start) - (self.catch_up_s - u_start)
        self.steps += 1
        self._proposed = True
        if self.mode == "mss" and multiprocess():  # the verify step takes its inputs whole on every device
            q = replicate(q, e.mesh)  # (over several processes jit does not reshard an argument itself)
        return DraftBatch(drafts, probs=q if self.mode == "mss" else None)

    def update(self, state, step) -> None:
        if not self._proposed:  # a step without this drafter's tree (the budget's
            return  # choice): the commit pending from the last tree stays, the next propose catches up
        self._proposed = False
        D = len(self.expansion)
        for b in range(state.batch):
            n_acc = int(step.n_emit[b]) - 1
            if n_acc < 0:
                continue
            nodes = [int(i) - 1 for i in step.path[b, 1:1 + n_acc]]
            fwd = [i for i in nodes if self.levels[i] < D]  # the deepest level has no K/V
            self.commit_src[b, :len(fwd)] = fwd
            self.commit_n[b] = len(fwd)

    def rollback(self, rows, length) -> None:
        rows, dlen = list(rows), self.dlen
        for b in rows:
            keep = min(int(dlen[b]), int(length))
            self.commit_n[b] = max(0, min(int(self.commit_n[b]), keep - int(self.base[b])))
            self.base[b] = min(int(self.base[b]), keep)
        self.cache = self.cache.replace(length=self.cache.length.at[np.asarray(rows)].set(
            jnp.asarray(self.base[rows], jnp.int32)))

    def end(self, rows=None) -> None:
        if rows is None:
            self.cache = None

    def summary(self) -> dict:
        """For the call's stats: the draft's time per step (its forwards included)."""
        out = dict(draft_s=self.draft_s, draft_ms_per_step=1e3 * self.draft_s / max(self.steps, 1),
                   draft_catch_up_s=self.catch_up_s, draft_compile_s=self.compile_s,
                   expansion=list(self.expansion), sampler=self.mode)
        if self.prefix is not None and self.prefix.cache is not None:  # its engine's, every request so far
            out.update({"draft_" + k: v for k, v in self.prefix.cache.summary().items()})
        return out

    # ------------------------------------------------------------------ helpers
    @property
    def dlen(self) -> np.ndarray:
        """Context tokens of each row in the draft cache, pending commits included."""
        return self.base + self.commit_n

    def _tree_step(self, catch, n_catch, sampling, mode: str) -> tuple:
        """The draft's tree step (`draft_tree_step` of `mode`) and its arguments."""
        e = self.engine
        fn = jitted_draft_tree(e.config, self.expansion, mode)
        return fn, (e.params, self.cache, e.arg(catch), e.arg(n_catch), e.arg(self.commit_src),
                    e.arg(self.commit_n), self.seeds, self.rowids) + (() if sampling is None else (sampling,))

    def _compiled(self, state, upto, sampling, mode: str, window: int) -> bool:
        """Whether the programs this step's drafting runs are compiled (`DecodeState.fallback`):
        the catch-up of the rows behind (`upto`; None: none) and the tree step of `mode` at
        `window`. The ones that are not are queued in the background (the target decodes
        without drafts until they are: the same tokens)."""
        e, B = self.engine, state.batch
        ready = True
        if upto is not None and self.commit_n.any() and not e.compiled.ready("draft_commit", *self._commit_args()):
            e.compiled.prefetch("draft_commit", *self._commit_args(), compile=True)
            ready = False
        if upto is not None:
            for b in self._fresh(upto):  # (with the prefix cache: blocks of the chunk)
                ready = self.prefix.ready(self.cache, state.context(b), int(upto[b]), b, self.seeds,
                                          self.rowids) and ready
            step = self._catch_up_inputs(state, self._whole(upto))
            if step is not None and not e.extend(self.cache, *step, ahead="check"):
                e.extend(self.cache, *step, ahead="compile")
                ready = False
        if (mode, window, B) in self._ready:
            return ready
        fn, args = self._tree_step(np.zeros((B, CATCH_UP), np.int32), np.zeros(B, np.int32), sampling, mode)
        if e.compiled.ready("draft", fn, *args, window=window):
            self._ready.add((mode, window, B))
        else:
            e.compiled.prefetch("draft", fn, *args, compile=True, window=window)
            ready = False
        return ready

    def _commit_args(self) -> tuple:
        """`_commit_only` and its arguments (the pending commit of every row)."""
        e = self.engine
        return _commit_only, e.params, self.cache, e.arg(self.commit_src), e.arg(self.commit_n)

    def _catch_up_inputs(self, state, upto):
        """The prefill that forwards context[dlen:upto] of the rows behind into the draft
        cache: (`StepInputs`, `StepMode`), or None when no row is behind."""
        from ..core.decode import prompt_bucket

        B, S = state.batch, state.max_len
        dlen = self.dlen
        n_new = np.maximum(np.asarray(upto, np.int64) - dlen, 0).astype(np.int32)
        if not n_new.any():
            return None
        rows = np.flatnonzero(n_new)  # only these rows are forwarded (a new request: its own row)
        whole = len(rows) == B
        n = n_new if whole else n_new[rows]
        P = prompt_bucket(int(n.max()), S)
        block = np.zeros((len(n), P), np.int32)
        for i, b in enumerate(range(B) if whole else rows):
            block[i, :n[i]] = state.context(b)[int(dlen[b]):int(upto[b])]
        start = dlen if whole else dlen[rows]
        window = P if not start.any() else window_for(int((dlen + n_new)[rows].max()), S)
        x = StepInputs(block, self.seeds, self.rowids, n_new=n)  # greedy: the draft's own picks are not used
        if not whole:
            x = x.rows(rows)  # (the block and n_new have these rows already)
        return x, StepMode(window=window)

    def _catch_up(self, state, upto) -> None:
        """Forward context[dlen:upto] of every row into the draft cache (prefill)."""
        B = state.batch
        if self.commit_n.any():  # (dlen = base + commit_n stays: the catch-up's block is the same)
            self.cache = self.engine.compiled("draft_commit", *self._commit_args())
            self.base = self.base + self.commit_n
            self.commit_n = np.zeros(B, np.int32)
        for b in self._fresh(upto):  # (with the prefix cache) cached units, then blocks of the chunk
            self.cache = self.prefix.catch_up(self.cache, state.context(b), int(upto[b]), b, self.seeds, self.rowids)
            self.base[b] = int(upto[b])
        upto = self._whole(upto)
        n_new = np.maximum(np.asarray(upto, np.int64) - self.dlen, 0).astype(np.int32)
        step = self._catch_up_inputs(state, upto)
        if step is None:
            return
        _, self.cache = self.engine.extend(self.cache, *step)
        self.base = self.base + n_new

    def _fresh(self, upto) -> list:
        """Rows behind whose draft cache is empty, which the prefix cache serves (none
        without it)."""
        if self.prefix is None:
            return []
        return [int(b) for b in np.flatnonzero((self.dlen == 0) & (np.asarray(upto) > 0))]

    def _whole(self, upto):
        """`upto` less the rows `_fresh` serves: what the one-block catch-up forwards."""
        fresh = self._fresh(upto)
        if not fresh:
            return upto
        upto = np.asarray(upto).copy()
        upto[fresh] = self.dlen[fresh]
        return upto
