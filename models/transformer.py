"""Decoder-only transformer (Llama / Mistral / SmolLM2 / Qwen2 / Gemma-3) as pure functions.

Why pure functions over a params pytree rather than NNX modules: the decode loop jits one
function of (params, cache, tokens), donates the cache, and shards params with a
NamedSharding per leaf. A plain dict pytree needs no split/merge at every call and makes
the sharding rules (`lookahead_jax/sharding.py`) a simple path -> PartitionSpec map.

Contract (shared by plain decoding and every speculative verifier):

    forward(params, tokens[B,T], positions[B,T], cache, attn_mask[B,T,S], config)
        -> (logits[B,T,V], cache)

* New keys/values of the T tokens are written at cache slots `length[b] .. length[b]+T-1`
  of each row b. `cache.length` is NOT advanced: the caller commits what it keeps
  (`models.cache.advance` / the verifier's compaction). Rollback = not advancing.
* `attn_mask[b, t, s]` (bool) says whether query t may see slot s. Slots of the new tokens
  are part of S, so a tree mask is just "cached prefix + ancestors in the tree".
* `positions` are free per token (a tree node's position is its depth, not its slot).
* Masked scores use a finite large negative value so fully padded rows stay finite.

Axis legend: B batch, T new tokens, S cache slots, N query heads, K kv heads, G = N/K,
Q = G*T (queries grouped per kv head),
H head dim, D model dim, F mlp dim, V vocab.

Params layout (all leaves arrays; per-layer dicts in a list, layers Python-unrolled, which
measured fastest on CPU, see PERF-NOTES):

    embed [V,D]; final_norm [D]; lm_head [D,V] (untied only)
    layers[i]: attn_norm [D], q [D,N*H], k [D,K*H], v [D,K*H], o [N*H,D],
               (q_bias [N*H], k_bias [K*H], v_bias [K*H])      qwen2 / attention_bias
               (q_norm [H], k_norm [H], post_attn_norm [D], post_mlp_norm [D])  gemma3
               mlp_norm [D], gate [D,F], up [D,F], down [F,D]
Norm weights are the effective multipliers (Gemma's `1 + w` is folded in at conversion).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache
from .config import ModelConfig, RopeScaling

MASK_VALUE = -1e30  # finite: a row with nothing visible gives a uniform softmax, not NaN


# ----------------------------------------------------------------------------- pieces
def rms_norm(x, w, eps):
    """RMSNorm computed in f32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> np.ndarray:
    """Inverse frequencies [H/2] (numpy, static), with HF's linear / llama3 scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: low frequencies scaled by 1/factor, high kept, a smooth ramp in between.
    lo_wl = scaling.original_max_position / scaling.low_freq_factor
    hi_wl = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > lo_wl, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= hi_wl) & (wavelen <= lo_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x [B,T,N,H] rotated by positions [B,T] (HF "rotate_half" layout)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _write_rows(buf, new, length):
    """buf [B,K,S,H] <- new [B,K,T,H] at slots length[b] .. length[b]+T-1 of each row.

    A scatter rather than a vmapped dynamic_update_slice: the latter made XLA:CPU copy
    the donated cache (0.2 ms per layer at B=1, S=512). Slots past S are dropped (the
    generate loop sizes the cache so that never happens, and says so when it would).
    """
    B, K, T, _ = new.shape
    slots = length[:, None] + jnp.arange(T)[None, :]  # [B,T]
    return buf.at[
        jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], slots[:, None, :]
    ].set(new.astype(buf.dtype), mode="drop")


def key_positions(cache_len, positions, n_slots):
    """Position of every cache slot [B,S] as seen by this forward.

    Committed slots s < length hold position s (the cache is always compact); the new
    tokens sit at slots length..length+T-1 with the caller's free positions.
    # length=3, positions=[[3,4,4]], S=8 -> [[0,1,2,3,4,4,6,7]]
    """
    T = positions.shape[1]
    s = jnp.arange(n_slots)[None, :]  # [1,S]
    idx = s - cache_len[:, None]  # [B,S]
    new = (idx >= 0) & (idx < T)
    taken = jnp.take_along_axis(positions, jnp.clip(idx, 0, T - 1), axis=1)
    return jnp.where(new, taken, s)


def _mlp(p, x, cfg: ModelConfig):
    gate = x @ p["gate"]
    up = x @ p["up"]
    if cfg.act == "silu":
        h = jax.nn.silu(gate) * up
    else:
        h = jax.nn.gelu(gate, approximate=True) * up
    return h @ p["down"]


def _attention(p, x, positions, k_cache, v_cache, length, mask, cfg: ModelConfig, layer: int):
    """One attention block. Returns (out [B,T,D], k_cache, v_cache)."""
    B, T, _ = x.shape
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = N // K
    q = x @ p["q"]
    k = x @ p["k"]
    v = x @ p["v"]
    if "q_bias" in p:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    q = q.reshape(B, T, N, H)
    k = k.reshape(B, T, K, H)
    v = v.reshape(B, T, K, H)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    inv_freq = jnp.asarray(
        rope_inv_freq(H, cfg.layer_rope_theta(layer), cfg.layer_rope_scaling(layer))
    )
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)

    k_cache = _write_rows(k_cache, k.transpose(0, 2, 1, 3), length)  # [B,K,S,H]
    v_cache = _write_rows(v_cache, v.transpose(0, 2, 1, 3), length)

    # queries grouped per kv head: [B,K,G*T,H], so both einsums are batched matmuls
    qg = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores = jnp.einsum("BKQH,BKSH->BKQS", qg, k_cache, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, K, G, T, -1) * cfg.attn_scale  # [B,K,G,T,S]
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(B, K, G * T, -1)
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, v_cache)  # [B,K,G*T,H]
    out = out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N * H) @ p["o"]
    return out, k_cache, v_cache


# ----------------------------------------------------------------------------- forward
def hidden_states(params, tokens, positions, cache: KVCache, attn_mask, config: ModelConfig):
    """Final-normed hidden states [B,T,D] and the cache with the T new K/V written."""
    cfg = config
    x = jnp.take(params["embed"], tokens, axis=0)  # [B,T,D]
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.d_model), dtype=x.dtype)
    S = cache.max_len
    length = cache.length
    if any(cfg.layer_window(i) is not None for i in range(cfg.n_layers)):
        kpos = key_positions(length, positions, S)  # [B,S]
        dist = positions[:, :, None] - kpos[:, None, :]  # [B,T,S]
    new_k, new_v = [], []
    for i, p in enumerate(params["layers"]):
        mask = attn_mask
        w = cfg.layer_window(i)
        if w is not None:
            mask = attn_mask & (dist < w)
        h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
        a, kc, vc = _attention(p, h, positions, cache.k[i], cache.v[i], length, mask, cfg, i)
        new_k.append(kc)
        new_v.append(vc)
        if cfg.sandwich_norm:
            a = rms_norm(a, p["post_attn_norm"], cfg.rms_eps)
        x = x + a
        h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
        m = _mlp(p, h, cfg)
        if cfg.sandwich_norm:
            m = rms_norm(m, p["post_mlp_norm"], cfg.rms_eps)
        x = x + m
    x = rms_norm(x, params["final_norm"], cfg.rms_eps)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v), length=length)


def logits_from_hidden(params, h, config: ModelConfig):
    """h [...,D] -> logits [...,V] in f32."""
    if config.tie_embeddings:
        logits = jnp.einsum("...D,VD->...V", h, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...D,DV->...V", h, params["lm_head"], preferred_element_type=jnp.float32)
    if config.final_logit_softcap:
        c = config.final_logit_softcap
        logits = jnp.tanh(logits / c) * c
    return logits


def forward(params, tokens, positions, cache: KVCache, attn_mask, config: ModelConfig):
    """The model contract: (logits [B,T,V] f32, cache with new K/V written, length unchanged)."""
    h, cache = hidden_states(params, tokens, positions, cache, attn_mask, config)
    return logits_from_hidden(params, h, config), cache


# ----------------------------------------------------------------------------- init
def init_params(config: ModelConfig, key, dtype=jnp.float32):
    """Random parameters (tests and benchmarks of shapes only)."""
    cfg = config
    D, N, K, H, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    keys = iter(jax.random.split(key, 16 + 16 * cfg.n_layers))

    def dense(shape, scale=None):
        scale = scale if scale is not None else shape[0] ** -0.5
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    def norm(n):
        return (1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)

    layers = []
    for _ in range(cfg.n_layers):
        p = dict(
            attn_norm=norm(D), q=dense((D, N * H)), k=dense((D, K * H)), v=dense((D, K * H)),
            o=dense((N * H, D)), mlp_norm=norm(D), gate=dense((D, F)), up=dense((D, F)),
            down=dense((F, D)),
        )
        if cfg.qkv_bias:
            p.update(q_bias=dense((N * H,), 0.1), k_bias=dense((K * H,), 0.1), v_bias=dense((K * H,), 0.1))
        if cfg.qk_norm:
            p.update(q_norm=norm(H), k_norm=norm(H))
        if cfg.sandwich_norm:
            p.update(post_attn_norm=norm(D), post_mlp_norm=norm(D))
        layers.append(p)
    params = dict(embed=dense((V, D), 1.0), layers=layers, final_norm=norm(D))
    if not cfg.tie_embeddings:
        params["lm_head"] = dense((D, V))
    return params


def param_shapes(config: ModelConfig):
    """Expected shape of every leaf, as the same pytree structure as init_params."""
    return jax.tree.map(
        lambda x: tuple(x.shape),
        jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0))),
    )
