"""One jitted decode step that verifies a token tree: shared by every drafter.

Input per row b: the root (last emitted token, not yet in the cache) followed by T draft
nodes, packed by `tree.py` into a block of 1+T:

    tokens [B,1+T]   root then nodes (pad token where invalid)
    parent [B,1+T]   index of each node's parent in the block (root: -1, padding: -2)
    depth  [B,1+T]   0 for the root, 1 for its children, ...
    anc    [B,1+T,1+T] anc[i, j] = j is i or an ancestor of i; the root is everyone's
                     ancestor (padding sees the root and itself, and is never accepted)

Algorithm (one forward, no shape depends on the outcome):
1. Forward the block at positions `length + depth`, slots `length .. length+T`; each query
   sees the committed prefix and its own ancestors.
2. At every node i choose the model's token `c[i]` for position `length + depth[i] + 1`
   (argmax, or a sample keyed by (seed, row, position): see sampling.py). Because the
   choice at a node depends only on its own logits and position, this is exactly what
   plain decoding would choose after the root-to-i path.
3. Node i is correct if tokens[i] == c[parent[i]]; it is accepted if it and all its
   ancestors are correct. The deepest accepted node `best` (lowest index on ties) gives
   the accepted path root -> best, of n = depth[best] drafts.
4. Emit the n drafted tokens on the path plus the bonus `c[best]`: n + 1 tokens, which
   are exactly the tokens plain decoding would emit over the same n + 1 steps.
5. Compact the path's K/V into slots length .. length+n and advance length by n + 1
   (inactive rows: by 0). Rejected nodes are simply not committed.

    # parents [-1, 0, 0, 1] (root, a, b, a's child c); c = model choices
    # correct = [T, tok[1]==c[0], tok[2]==c[0], tok[3]==c[1]]; if a and c are correct:
    # best = 3, path = [0, 1, 3], emitted = [tok[1], tok[3], c[3]], length += 3

With T = 0 (no drafts) the step is plain decoding: one token per forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .models import KVCache, advance, commit, forward
from .models.config import ModelConfig
from .sampling import SamplingParams, select_tokens


def tree_mask(length, anc, n_slots):
    """attn mask [B,1+T,S]: all committed slots, plus the ancestors within the block."""
    B, T1, _ = anc.shape
    s = jnp.arange(n_slots)[None, None, :]  # [1,1,S]
    prefix = s < length[:, None, None]  # [B,1,S]
    rel = s - length[:, None, None]  # slot offset inside the block
    in_block = (rel >= 0) & (rel < T1)
    block = jnp.take_along_axis(
        anc, jnp.broadcast_to(jnp.clip(rel, 0, T1 - 1), (B, T1, n_slots)), axis=2
    )
    return prefix | (in_block & block)


def verify_step(params, cache: KVCache, tokens, parent, depth, anc, active, seed, row,
                *, config: ModelConfig, sampling: SamplingParams, window: int = 0):
    """Returns (emitted [B,1+T] int32 (-1 past n+1), n_emitted [B] int32, cache).

    window: static number of cache slots attention reads (0: all). Every active row needs
    length + 1 + T <= window; `generate` picks it from `window_for`."""
    B, T1 = tokens.shape
    length = cache.length
    positions = length[:, None] + depth  # [B,1+T]
    mask = tree_mask(length, anc, window or cache.max_len)
    logits, cache = forward(params, tokens, positions, cache, mask, config)
    choice = select_tokens(logits, sampling, seed, row, positions + 1)  # [B,1+T]
    active = active.astype(bool)

    if T1 == 1:  # plain decoding
        n_emit = active.astype(jnp.int32)
        return choice, n_emit, advance(cache, n_emit)

    parent_choice = jnp.take_along_axis(choice, jnp.clip(parent, 0, T1 - 1), axis=1)
    correct = (tokens == parent_choice) & (parent >= 0)  # [B,1+T]
    correct = correct.at[:, 0].set(True)
    ok = jnp.all(jnp.where(anc, correct[:, None, :], True), axis=-1)  # [B,1+T]
    best = jnp.argmax(jnp.where(ok, depth, -1), axis=-1)  # [B], first max
    n_acc = jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0]  # [B]

    # path[d] = index of the accepted node at depth d (d = 0..n_acc); rest 0
    on_path = jnp.take_along_axis(anc, best[:, None, None], axis=1)[:, 0, :]  # [B,1+T]
    slot = jnp.where(on_path, depth, T1)  # out-of-range -> dropped
    idx = jnp.broadcast_to(jnp.arange(T1, dtype=jnp.int32), (B, T1))
    path = jax.vmap(lambda s, i: jnp.zeros((T1,), jnp.int32).at[s].set(i, mode="drop"))(slot, idx)

    emitted = jnp.take_along_axis(choice, path, axis=1)  # choice at path[d] = token d+1
    d = jnp.arange(T1)[None, :]
    emitted = jnp.where(d <= n_acc[:, None], emitted, -1)
    n_emit = jnp.where(active, n_acc + 1, 0).astype(jnp.int32)
    cache = commit(cache, path, n_emit)
    return emitted, n_emit, cache


@functools.lru_cache(maxsize=None)
def jitted_verify_step(config: ModelConfig, sampling: SamplingParams):
    """jit(verify_step) for one (config, sampling); the cache (argument 1) is donated and
    `window` (keyword) is static: one compilation per (tree bucket, window)."""
    return jax.jit(
        functools.partial(verify_step, config=config, sampling=sampling), donate_argnums=(1,),
        static_argnames=("window",),
    )


WINDOW_MIN = 128


def window_for(needed: int, max_len: int) -> int:
    """Smallest attention window (a power of two >= WINDOW_MIN, or the whole cache) that
    covers `needed` slots; windows keep a step's attention proportional to the length.
    # window_for(100, 1024) -> 128; window_for(129, 1024) -> 256; window_for(700, 768) -> 768
    """
    if needed > max_len:
        raise ValueError(f"a step needs {needed} cache slots but the cache holds {max_len}")
    w = max(WINDOW_MIN, 1 << max(needed - 1, 0).bit_length())
    return max_len if w >= max_len else w
