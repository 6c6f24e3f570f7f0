"""Copying a block of a cache row's K/V out and writing it into a row: the prefix cache's
two device programs (`core.prefix_cache`).

A block is `size` consecutive slots of one row, every layer: k, v as L x [K, size, H]
(the cache's layout, `models.KVCache`: L x [B, K, S, H]). The row and the first slot are
data (int32 scalars), the size static, so each program compiles ONCE per cache shape,
whatever row or position it is used at:

    kv = copy_out(engine, cache, row=2, start=126, size=63)   # slots 126..188 of row 2
    cache = write_in(engine, cache, kv, row=0, start=126)     # into row 0 (cache donated)

Both go through the engine's compiled-function table (`engine.compiled`: names
"kv_copy" and "kv_write"; counted and logged as every step's compilation). The copy is a
new array (the next step may donate the cache); writing donates the cache, as a step
does. Neither touches `cache.length` (the caller sets the row's length). On a mesh a
block is placed as the cache's rows are, less the row axis (kv heads split over "model",
the same on every "data" row: `block_sharding`), and the write returns the cache placed
as the steps take it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..models import KVCache


def _copy_out(_, cache: KVCache, row, start, *, size: int):
    """(k, v): L x [K, size, H] each, slots start..start+size-1 of cache row `row`."""
    def cut(x):  # [B,K,S,H] -> [K,size,H]
        return jax.lax.dynamic_slice(x, (row, 0, start, 0), (1, x.shape[1], size, x.shape[3]))[0]

    return tuple(cut(x) for x in cache.k), tuple(cut(x) for x in cache.v)


def _write_in(_, cache: KVCache, k, v, row, start) -> KVCache:
    """`cache` with (k, v) (L x [K, size, H]) at slots start.. of row `row`."""
    def put(x, blk):  # [B,K,S,H] <- [1,K,size,H] at (row, 0, start, 0)
        return jax.lax.dynamic_update_slice(x, blk[None].astype(x.dtype), (row, 0, start, 0))

    return KVCache(k=tuple(map(put, cache.k, k)), v=tuple(map(put, cache.v, v)), length=cache.length)


# the first argument stands where a step has its params (`CompiledFunctions` keys on it): None
COPY = jax.jit(_copy_out, static_argnames=("size",))
WRITE = jax.jit(_write_in, donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def _mesh_write(config, mesh, batch: int):
    """WRITE on a mesh: the cache comes back placed as the steps take it (their explicit
    in-shardings, `sharding.cache_shardings`)."""
    from .sharding import cache_shardings

    return jax.jit(_write_in, donate_argnums=(1,), out_shardings=cache_shardings(config, mesh, batch))


def block_sharding(cache: KVCache):
    """Where a block of `cache` goes: on a mesh the cache layer's NamedSharding less its
    row axis ([B,K,S,H] -> [K,size,H]), else None (the compiler's choice: one device)."""
    s = cache.k[0].sharding
    if not isinstance(s, NamedSharding):
        return None
    return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]))


@functools.lru_cache(maxsize=None)
def _mesh_copy(sharding, layers: int):
    """COPY on a mesh: every block placed by `sharding` (`block_sharding`)."""
    return jax.jit(_copy_out, static_argnames=("size",), out_shardings=((sharding,) * layers,) * 2)


def _copier(cache: KVCache):
    sharding = block_sharding(cache)
    return COPY if sharding is None else _mesh_copy(sharding, len(cache.k))


def _writer(engine, cache: KVCache):
    return WRITE if engine.mesh is None else _mesh_write(engine.config, engine.mesh, int(cache.length.shape[0]))


def _index(x) -> np.ndarray:
    return np.asarray(x, np.int32)


def copy_out(engine, cache: KVCache, row: int, start: int, size: int):
    """A copy of slots start..start+size-1 of `row` (module docstring)."""
    return engine.compiled("kv_copy", _copier(cache), None, cache, _index(row), _index(start),
                           size=int(size))


def write_in(engine, cache: KVCache, kv, row: int, start: int) -> KVCache:
    """`cache` (donated) with the block `kv` (from `copy_out`) at slots start.. of `row`."""
    k, v = kv
    return engine.compiled("kv_write", _writer(engine, cache), None, cache, k, v, _index(row), _index(start))


def prefetch(engine, cache: KVCache, size: int) -> None:
    """Queue both programs' compilation in the background (`CompiledFunctions.prefetch`:
    only shapes are read; a block placed as `copy_out` places it)."""
    sharding = block_sharding(cache) or cache.k[0].sharding
    one = jax.ShapeDtypeStruct((cache.k[0].shape[1], int(size), cache.k[0].shape[3]), cache.k[0].dtype,
                               sharding=sharding)
    kv = tuple(one for _ in cache.k)
    zero = _index(0)
    engine.compiled.prefetch("kv_copy", _copier(cache), None, cache, zero, zero, compile=True,
                             size=int(size))
    engine.compiled.prefetch("kv_write", _writer(engine, cache), None, cache, kv, kv, zero, zero, compile=True)


def block_bytes(config, size: int, dtype) -> int:
    """Bytes of one block of `size` slots (k and v, every layer)."""
    return 2 * int(config.n_layers) * int(config.n_kv_heads) * int(size) * int(config.head_dim) * \
        np.dtype(dtype).itemsize
