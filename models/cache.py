"""KV cache: an explicit pytree with per-layer K/V and a per-row length.

    k[i], v[i]: [B,K,S,H]   one array per layer, layers Python-unrolled (on XLA:CPU 25.1 ms
                            a SmolLM2-shaped greedy step, against 36.5 ms for a lax.scan
                            over one stacked cache); heads before slots so attention is a
                            plain batched matmul over (B,K) (2-9x faster than [B,S,K,H]
                            on CPU)
    length:     [B] int32   number of committed slots of each row

Slots `0 .. length-1` are committed and compact (slot s holds position s). A forward
writes its T new tokens at `length .. length+T-1` without committing them. Committing:

* plain decoding keeps all T: `advance(cache, T)`;
* a verifier keeps a subset (the accepted path of a token tree): `commit(cache, src, n)`
  moves the kept slots into contiguous order and advances length by n per row.

Rollback is "don't advance": uncommitted slots are simply overwritten later.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: tuple  # L x [B,K,S,H]
    v: tuple  # L x [B,K,S,H]
    length: jax.Array  # [B] int32

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, config.n_kv_heads, max_len, config.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(
        k=tuple(zeros() for _ in range(config.n_layers)),
        v=tuple(zeros() for _ in range(config.n_layers)),
        length=jnp.zeros((batch,), jnp.int32),
    )


def advance(cache: KVCache, n) -> KVCache:
    """Commit the next n (scalar or [B]) written slots of each row."""
    return cache.replace(length=cache.length + jnp.asarray(n, jnp.int32))


def commit(cache: KVCache, src, n) -> KVCache:
    """Keep a subset of the slots written by the last forward, compacted, and commit them.

    src [B,M] int32: offsets (relative to `length`) of the slots to keep, in order; entry j
    moves slot `length+src[j]` to slot `length+j`. Only the first n[b] entries of row b are
    committed; the rest are written but stay uncommitted (harmless).
    # length=5, src=[0,2,3], n=3: slots 5,7,8 -> 5,6,7; length -> 8
    """
    def move(buf):  # [B,K,S,H]
        def row(b, l, s):  # b [K,S,H]
            picked = jnp.take(b, l + s, axis=1, mode="clip")  # [K,M,H]
            return jax.lax.dynamic_update_slice(b, picked, (0, l, 0))

        return jax.vmap(row)(buf, cache.length, src)

    return KVCache(
        k=tuple(move(b) for b in cache.k),
        v=tuple(move(b) for b in cache.v),
        length=cache.length + jnp.asarray(n, jnp.int32),
    )
