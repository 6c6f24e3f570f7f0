"""Token selection: greedy, or sampling with temperature / top-k / top-p.

The random key of a sampled token is a pure function of (seed, row, absolute position of
the token being produced):

    key = fold_in(fold_in(PRNGKey(seed), row), position)

so any decoder that evaluates the model at the same prefix draws the same token: plain
decoding, tree verification (which samples at every tree node in parallel) and, later,
draft-model speculation all reproduce each other token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .models import cpu_kernels


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling configuration (hashable: a static jit argument).

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


def filter_logits(logits, sp: SamplingParams):
    """Temperature, top-k, top-p applied to logits [..., V] (f32); returns filtered logits."""
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


def select_tokens(logits, sp: SamplingParams, seed, row, position):
    """Pick the token at each of logits [B, T, V].

    position [B, T] is the absolute position the chosen token will occupy.
    Greedy ignores seed/row/position.
    """
    if sp.greedy:  # jnp.argmax; on CPU one kernel call (XLA's reduce is slow there)
        return cpu_kernels.argmax(logits)
    keys = position_keys(seed, row, position)  # [B,T,2]
    filtered = filter_logits(logits, sp)
    flat_k = keys.reshape(-1, keys.shape[-1])
    flat_l = filtered.reshape(-1, filtered.shape[-1])
    toks = jax.vmap(jax.random.categorical)(flat_k, flat_l)
    return toks.reshape(logits.shape[:-1]).astype(jnp.int32)
