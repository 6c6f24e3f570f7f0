"""Token selection: greedy, or sampling with temperature / top-k / top-p.

The random key of a sampled token is a pure function of (seed, row, absolute position of
the token being produced):

    key = fold_in(fold_in(PRNGKey(seed), row), position)

so any decoder that evaluates the model at the same prefix draws the same token: plain
decoding, tree verification (which samples at every tree node in parallel) and, later,
draft-model speculation all reproduce each other token for token.

Per-row values: `SamplingParams` and `Penalties` (`core/params.py`) are one request's values (static where a
step compiles one set in, e.g. `generate`'s defaults, knnlm's step). The decode state
passes each row's own values as arrays (`RowSampling`, `RowPenalties`: jit arguments, so
values never recompile). The sampling mode is data too: with a `RowSampling`, whether some
row samples and whether a sampled row cuts (top-k / top-p: one sort over the vocabulary)
are read on the device (`lax.cond`), so the decode loop passes every row's values
(`DecodeState.step_sampling`) and one compiled step serves greedy and sampled batches; an
all-greedy batch computes the argmax alone, no keys and no sort (static `filter=False`:
never cut). Static in `RowPenalties` is which penalty arrays are needed; no `RowPenalties`
without penalties. A greedy row of a sampling batch still takes the argmax, and a row with top_k 0 / top_p 1
/ repetition 1 / presence 0 / frequency 0 is computed exactly as without that filter or
penalty (`tests/test_row_sampling.py`), so a row's tokens are those it gives alone.
A request's logit_bias is data as well (`RowBias`: [B, MAX_LOGIT_BIAS] ids and values,
`add_bias`, which runs first).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..models import cpu_kernels
from .params import MAX_LOGIT_BIAS, Penalties, SamplingParams  # noqa: F401  (the values' types live with the request's checks)


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Each row's sampling values as arrays [B] (a pytree: a jit argument whose values
    never recompile). Static (its treedef, part of the compiled step) is only `filter`:
    False, no row cuts; True, a row may use top-k or top-p, which the step reads from the
    values (one descending sort over the vocabulary where one does).
    temperature 0 = a greedy row (the argmax), top_k 0 / top_p 1 = that filter off."""

    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] f32
    filter: bool = True

    @staticmethod
    def of(params: Sequence[SamplingParams], put=np.asarray) -> "RowSampling":
        """The rows' values (`put` places the arrays, e.g. `Engine.put`); `filter` as
        some sampled row needs it."""
        return RowSampling(put(np.array([p.temperature for p in params], np.float32)),
                           put(np.array([p.top_k for p in params], np.int32)),
                           put(np.array([p.top_p for p in params], np.float32)),
                           filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params))


@dataclasses.dataclass(frozen=True)
class RowPenalties:
    """Each row's penalties as arrays [B] (a pytree, as `RowSampling`); static are only
    `uses_context` / `uses_counts` (some row needs `seen` / `counts`). A row with
    repetition 1, presence 0 and frequency 0 is left exactly as it is."""

    repetition: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    uses_context: bool = False
    uses_counts: bool = False

    @property
    def on(self) -> bool:
        return self.uses_context or self.uses_counts

    @staticmethod
    def of(pens: Sequence[Penalties], put=np.asarray) -> "RowPenalties":
        """The rows' penalties (`put` places the arrays); the flags as the rows need them."""
        return RowPenalties(*(put(np.array([getattr(p, f) for p in pens], np.float32))
                              for f in ("repetition", "presence", "frequency")),
                            uses_context=any(p.uses_context for p in pens),
                            uses_counts=any(p.uses_counts for p in pens))


@dataclasses.dataclass(frozen=True)
class RowBias:
    """Each row's logit_bias as arrays [B,K] (a pytree, as `RowSampling`), K =
    MAX_LOGIT_BIAS always: one shape whatever a request biases, so a bias never compiles
    a program of its own where the step carries every row's (`DecodeState.penalty_rows`).
    A row biases ids[b, :n] by values[b, :n]; the rest is padding (id 0, bias 0: adds
    nothing). A row without a bias is all padding."""

    ids: jax.Array  # [B,K] int32
    values: jax.Array  # [B,K] f32

    @staticmethod
    def of(biases: Sequence[tuple], put=np.asarray) -> "RowBias":
        """The rows' biases (each a `GenerationParams.logit_bias`: (id, bias) pairs; `put`
        places the arrays)."""
        ids = np.zeros((len(biases), MAX_LOGIT_BIAS), np.int32)
        values = np.zeros((len(biases), MAX_LOGIT_BIAS), np.float32)
        for b, pairs in enumerate(biases):
            for j, (t, v) in enumerate(pairs):
                ids[b, j], values[b, j] = t, v
        return RowBias(put(ids), put(values))


for _cls, _data, _meta in ((RowSampling, ["temperature", "top_k", "top_p"], ["filter"]),
                           (RowPenalties, ["repetition", "presence", "frequency"], ["uses_context", "uses_counts"]),
                           (RowBias, ["ids", "values"], [])):
    jax.tree_util.register_dataclass(_cls, data_fields=_data, meta_fields=_meta)


def _per_row(x, like):
    """A python number as is; a per-row array [B] as [B,1,..] against `like` [B,...]."""
    if isinstance(x, (int, float)):
        return x
    return x.reshape(x.shape + (1,) * (like.ndim - 1))


def add_bias(logits, bias):
    """logits [B,T,V] plus each row's logit_bias (`RowBias`; None: unchanged) at every
    position: OpenAI / vLLM's logit_bias, added to the raw logits before the penalties,
    the filters and the argmax, so greedy picks and samples follow the biased distribution
    in plain decoding and at every node of a verified tree alike. The work runs under a
    `lax.cond` only when some row has a non-zero bias (a step that carries every row's
    padding costs nothing, and its logits are exactly as they were).
    # ids [[5, 0]], values [[100., 0.]] -> row 0's logit of id 5 + 100 at every position"""
    if bias is None:
        return logits

    def apply(logits):
        B, V = logits.shape[0], logits.shape[-1]
        dense = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], bias.ids].add(bias.values)  # [B,V]
        return logits + dense[:, None, :].astype(logits.dtype)

    return jax.lax.cond(jnp.any(bias.values != 0), apply, lambda x: x, logits)


def penalize(logits, pen, seen=None, counts=None, path=None):
    """logits [B,T,V] with the penalties `pen` (`Penalties`, or each row's: `RowPenalties`)
    applied (unchanged when pen is None / off).

    seen [B,V] bool: the ids of each row's context up to the block's root (root included);
    counts [B,V] int32: each id's count among the row's generated ids up to the root;
    path [B,T,V] int32, a function returning it, or None: each id's count among the nodes
    below the root on node t's own path (t included), which are all generated tokens. So
    node t is penalized by exactly the context plain decoding would have at its position.

    Each row's values (`RowPenalties`) are data: the work (and `path`, when a function)
    runs under a `lax.cond` only when some row's values are not neutral (repetition 1,
    presence and frequency 0, which leave a row's logits exactly as they are), so a step
    that carries every row's penalties costs nothing where nobody asked for any."""
    if pen is None or not pen.on:
        return logits

    def apply(logits):
        p = path() if callable(path) else path
        if pen.uses_context:
            hit = seen[:, None, :] if p is None else seen[:, None, :] | (p > 0)  # [B,T,V]
            r = jnp.asarray(_per_row(pen.repetition, logits), logits.dtype)
            logits = jnp.where(hit, jnp.where(logits > 0, logits / r, logits * r), logits)
        if pen.uses_counts:
            c = counts[:, None, :] if p is None else counts[:, None, :] + p  # [B,T,V]
            freq, pres = _per_row(pen.frequency, c), _per_row(pen.presence, c)
            sub = freq * c.astype(jnp.float32) + pres * (c > 0).astype(jnp.float32)
            logits = logits - sub.astype(logits.dtype)
        return logits

    if not isinstance(pen, RowPenalties):
        return apply(logits)
    some = jnp.any((pen.repetition != 1.0) | (pen.presence != 0.0) | (pen.frequency != 0.0))
    return jax.lax.cond(some, apply, lambda x: x, logits)


def position_keys(seed, row, position):
    """Keys [..., 2] for seed [B], row [B] (uint32/int32) and position [B, ...] (int32)."""

    def one(s, r, p):
        k = jax.random.fold_in(jax.random.PRNGKey(s), r)
        return jax.random.fold_in(k, p)

    def per_row(s, r, ps):  # ps [...]
        flat = ps.reshape(-1)
        ks = jax.vmap(lambda p: one(s, r, p))(flat)
        return ks.reshape(ps.shape + ks.shape[-1:])

    return jax.vmap(per_row)(seed, row, position)


def filter_logits(logits, sp):
    """Temperature, top-k, top-p applied to logits [..., V] (f32); returns filtered logits.
    sp: `SamplingParams` (static), or `RowSampling` (logits [B,...,V], each row its own;
    a greedy row is divided by 1)."""
    if isinstance(sp, RowSampling):
        return _filter_rows(logits, sp)
    logits = logits.astype(jnp.float32) / sp.temperature
    neg = jnp.finfo(jnp.float32).min
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if sp.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
        keep = (cum - probs) < sp.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, neg, logits)
    return logits


def _filter_rows(logits, rs: RowSampling):
    """`filter_logits` with each row's values: the same operations on the same values as
    the static path, so a row's filtered logits are bitwise those of its own
    `SamplingParams`. Top-k without a static k: the k-th largest is read off the
    descending sort that top-p needs anyway (k 0 or >= V: no cut).
    # sorted [5, 3, 3, 1], k = 2 -> kth = 3: the ids with 5, 3, 3 stay"""
    t = _per_row(rs.temperature, logits)
    logits = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    if not rs.filter:
        return logits
    V = logits.shape[-1]
    # whether a sampled row cuts is data: the sort runs only in a step where one does (a
    # branch on the device), and a step without one computes the same values without it
    cuts = (rs.temperature > 0) & (((rs.top_k > 0) & (rs.top_k < V)) | (rs.top_p < 1.0))
    return jax.lax.cond(jnp.any(cuts), functools.partial(_cut_rows, rs=rs), lambda x: x, logits)


def _cut_rows(logits, rs: RowSampling):
    """Top-k, then top-p, of each row of `logits` (divided by the temperature already)."""
    neg = jnp.finfo(jnp.float32).min
    V = logits.shape[-1]
    desc = jnp.sort(logits, axis=-1)[..., ::-1]  # [..., V] descending
    k = _per_row(rs.top_k, logits)  # [B,1,..]
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(jnp.clip(k - 1, 0, V - 1), desc.shape[:-1] + (1,)), axis=-1)
    cut_k = (k > 0) & (k < V)
    logits = jnp.where(cut_k & (logits < kth), neg, logits)
    desc = jnp.where(cut_k & (desc < kth), neg, desc)  # = the sort of the cut logits
    top_p = _per_row(rs.top_p, logits)
    probs = jax.nn.softmax(desc, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    keep = (cum - probs) < top_p  # as the static path; top_p 1 rows are skipped below
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1.0) & (logits < cutoff), neg, logits)


def select_tokens(logits, sp, seed, row, position):
    """Pick the token at each of logits [B, T, V].

    sp: `SamplingParams` (static), `RowSampling` (each row its own; greedy rows take the
    argmax) or None (every row greedy). position [B, T] is the absolute position the
    chosen token will occupy. Greedy ignores seed/row/position.
    """
    if sp is None or (isinstance(sp, SamplingParams) and sp.greedy):
        return cpu_kernels.argmax(logits)  # jnp.argmax; on CPU one kernel call (XLA's reduce is slow there)
    if isinstance(sp, RowSampling):  # the mode is data: the argmax unless some row samples
        greedy = cpu_kernels.argmax(logits)
        return jax.lax.cond(jnp.any(sp.temperature > 0), lambda: _sample(logits, sp, seed, row, position, greedy),
                            lambda: greedy)
    return _sample(logits, sp, seed, row, position)


def _sample(logits, sp, seed, row, position, greedy=None):
    """`select_tokens` of a step that samples (`greedy`: the argmax, for greedy rows)."""
    keys = position_keys(seed, row, position)  # [B,T,2]
    filtered = filter_logits(logits, sp)
    flat_k = keys.reshape(-1, keys.shape[-1])
    flat_l = filtered.reshape(-1, filtered.shape[-1])
    toks = jax.vmap(jax.random.categorical)(flat_k, flat_l)
    toks = toks.reshape(logits.shape[:-1]).astype(jnp.int32)
    if isinstance(sp, RowSampling):  # greedy rows: the argmax, exactly as alone
        toks = jnp.where(_per_row(sp.temperature, toks) > 0, toks, greedy)
    return toks
