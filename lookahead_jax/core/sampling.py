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

from ..models import cpu_kernels


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


@dataclasses.dataclass(frozen=True)
class Penalties:
    """Static repetition / presence / frequency penalties (hashable: a static jit argument).

    repetition (HF `repetition_penalty`, > 0; 1 = off): every id that occurs in the context
    (prompt + generated) has its logit divided by it where positive, multiplied where not.
    presence / frequency (vLLM / OpenAI, in [-2, 2]; 0 = off): over the *generated* ids
    only, logit -= presence * (count > 0) + frequency * count. Applied in that order, to
    the raw logits (before temperature, top-k/p and the min_new_tokens ban)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self):
        if not 0.0 < self.repetition < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition!r}")
        for name in ("presence", "frequency"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}_penalty must be a number in [-2, 2] (0 = off), got {v!r}")

    @property
    def on(self) -> bool:
        return self.uses_context or self.uses_counts

    @property
    def uses_context(self) -> bool:
        """Needs `seen` (the ids of the context)."""
        return self.repetition != 1.0

    @property
    def uses_counts(self) -> bool:
        """Needs `counts` (how often each id was generated)."""
        return self.presence != 0.0 or self.frequency != 0.0


def penalize(logits, pen, seen=None, counts=None, path=None):
    """logits [B,T,V] with the penalties `pen` applied (unchanged when pen is None / off).

    seen [B,V] bool: the ids of each row's context up to the block's root (root included);
    counts [B,V] int32: each id's count among the row's generated ids up to the root;
    path [B,T,V] int32 or None: each id's count among the nodes below the root on node t's
    own path (t included), which are all generated tokens. So node t is penalized by
    exactly the context plain decoding would have at its position."""
    if pen is None or not pen.on:
        return logits
    if pen.uses_context:
        hit = seen[:, None, :] if path is None else seen[:, None, :] | (path > 0)  # [B,T,V]
        r = jnp.asarray(pen.repetition, logits.dtype)
        logits = jnp.where(hit, jnp.where(logits > 0, logits / r, logits * r), logits)
    if pen.uses_counts:
        c = counts[:, None, :] if path is None else counts[:, None, :] + path  # [B,T,V]
        sub = pen.frequency * c.astype(jnp.float32) + pen.presence * (c > 0).astype(jnp.float32)
        logits = logits - sub.astype(logits.dtype)
    return logits


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
