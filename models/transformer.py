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
* The mask may be narrower than the cache: `attn_mask[B,T,W]` with W <= S makes attention
  read only slots 0..W-1 (a static window; every visible slot and the T new slots must lie
  below W). Decode steps pass the smallest bucketed W that covers the rows' lengths, so a
  step's attention costs O(length), not O(S) (on CPU, S=1024 vs W=256 is ~5 ms a step).
* `positions` are free per token (a tree node's position is its depth, not its slot).
* Masked scores use a finite large negative value so fully padded rows stay finite.

Axis legend: B batch, T new tokens, S cache slots, N query heads, K kv heads, G = N/K,
H head dim, D model dim, F mlp dim, V vocab.

Params layout (all leaves arrays; per-layer dicts in a list, layers Python-unrolled: on
XLA:CPU that beat a lax.scan over stacked layers, 25.1 vs 36.5 ms a SmolLM2-shaped greedy
step):

    embed [V,D]; final_norm [D]; lm_head [D,V] (untied only)
    layers[i]: attn_norm [D], qkv [D,K,G+2,H], o [N*H,D],
               (qkv_bias [K,G+2,H])                                qwen2 / attention_bias
               (q_norm [H], k_norm [H], post_attn_norm [D], post_mlp_norm [D])  gemma3
               mlp_norm [D], gate_up [D,2,F], down [F,D]
Norm weights are the effective multipliers (Gemma's `1 + w` is folded in at conversion).

q, k and v are one matrix, grouped per kv head: qkv[:, k, :G] are the G query heads that
share kv head k (query head n = k*G + g, as HF's repeat_kv), qkv[:, k, G] its key and
qkv[:, k, G+1] its value; gate and up are one matrix too. One dot instead of three (and
two) per layer made the SmolLM2 decode step ~15% faster on XLA:CPU (fewer, larger ops;
bench/results/README.md), and grouping by kv head keeps a "model"-axis split of K whole.
The weight products go through `cpu_kernels.matmul` (a skinny-matmul kernel when lowering
for CPU with f32 and few rows, plain dot otherwise). Checkpoints name the pieces separately: `fuse_layer` / `split_layer` convert a layer
between that "split" layout (q [D,N*H], k/v [D,K*H], q/k/v_bias, gate/up [D,F]) and this one.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_kernels
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


def rope_tables(positions, inv_freq):
    """(cos, sin) [B,T,H/2] f32 for positions [B,T]; computed once per forward and RoPE."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, tables):
    """x [B,T,...,H] rotated by tables = rope_tables(positions, inv_freq) (HF "rotate_half")."""
    cos, sin = tables
    extra = (1,) * (x.ndim - 3)  # head axes between T and H
    cos = cos.reshape(cos.shape[:2] + extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + extra + sin.shape[2:])
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _write_rows(buf, new, length, rows=None):
    """buf [C,K,S,H] <- new [B,K,T,H] at slots length[b] .. length[b]+T-1 of cache row
    rows[b] (rows None: row b, C == B).

    A scatter rather than a vmapped dynamic_update_slice: the latter made XLA:CPU copy
    the donated cache (0.2 ms per layer at B=1, S=512). Slots past S are dropped (the
    generate loop sizes the cache so that never happens, and says so when it would).
    """
    B, K, T, _ = new.shape
    slots = length[:, None] + jnp.arange(T)[None, :]  # [B,T]
    at = jnp.arange(B) if rows is None else rows
    return buf.at[
        at[:, None, None], jnp.arange(K)[None, :, None], slots[:, None, :]
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


def _dense(x, w):
    """x [B,T,D] @ w [D,...] -> [B,T,...] as one 2-D matmul (the fused weights' layout).
    On CPU, f32 and few rows (any rows for a `PackedWeight`, see `pack_params`) this is
    the matmul kernel (`cpu_kernels`)."""
    w2 = w if isinstance(w, cpu_kernels.PackedWeight) else w.reshape(w.shape[0], -1)
    y = cpu_kernels.matmul(x.reshape(-1, x.shape[-1]), w2)
    return y.reshape(*x.shape[:2], *w.shape[1:])


PACKED_LEAVES = ("qkv", "o", "gate_up", "down")  # per layer; plus an untied lm_head


def pack_params(params, dtype=None, *, consume: bool = False):
    """The params with every layer weight (and an untied lm_head) as a
    `cpu_kernels.PackedWeight`: the layout the CPU matmul kernel reads fastest. For f32
    inference on one CPU device (`lookahead_jax.runtime_params` decides and caches it);
    the forward computes bitwise the same values from either form. Weights whose column
    count no tile width divides stay plain.
        packed = pack_params(params); forward(packed, ...) == forward(params, ...)
    `dtype=jnp.bfloat16`: the packed weights stored in bf16, computed in f32 (half the
    bytes per step; NOT the same values: for draft models only, `Engine.weight_dtype`).
    consume=True: `params` is the caller's to give up (e.g. just loaded): each weight is
    dropped from its dict (`params` and its layer dicts) as soon as its packed copy exists,
    so packing needs one weight of extra memory, not a second copy of the model (`params`
    is left holding only the leaves that are not packed). Without it `params` is unchanged.
    """
    def one(w):
        return cpu_kernels.pack(w, dtype) if cpu_kernels.pack_width(int(np.prod(w.shape[1:]))) else w

    take = (lambda d, k: d.pop(k)) if consume else (lambda d, k: d[k])
    out = dict(params, layers=[{k: one(take(p, k)) if k in PACKED_LEAVES else p[k] for k in list(p)}
                               for p in params["layers"]])
    if "lm_head" in params:
        out["lm_head"] = one(take(params, "lm_head"))
    elif cpu_kernels.pack_width(params["embed"].shape[0]):
        # tied: the output layer as a packed e.T beside the embedding table (lookups keep
        # reading `embed`). One sequential pass over columns of e.T reads the 49k x 576
        # table ~1.4x faster at one row, and 2-3x faster at 4-16 rows, than the nt kernel.
        out["packed_head"] = cpu_kernels.pack(params["embed"].T, dtype)
    return out


def pack_leaf(key: str, w, config: ModelConfig, dtype=None) -> dict:
    """One leaf of the params, by its checkpoint key ("embed", "layers.3.qkv", ...), as
    `pack_params` leaves it: {key: packed or plain leaf}, plus {"packed_head": ...} beside
    a tied `embed`. For params read leaf by leaf (`loading.load`): each weight is packed
    as it arrives, so the model is never held twice. A numpy `w` is packed on the host
    (`cpu_kernels.pack`) and a plain one handed to the device without a copy where it is
    64-byte aligned; the values are those of `pack_params`."""
    name = key.rsplit(".", 1)[-1]
    if (key == "lm_head" or (key.startswith("layers.") and name in PACKED_LEAVES)) \
            and cpu_kernels.pack_width(int(np.prod(w.shape[1:]))):
        return {key: cpu_kernels.pack(w, dtype)}
    out = {key: jax.device_put(w)}
    if key == "embed" and config.tie_embeddings and cpu_kernels.pack_width(w.shape[0]):
        out["packed_head"] = cpu_kernels.pack(w.T, dtype)  # see pack_params
    return out


def cast_packed(params, dtype):
    """`params` with every `cpu_kernels.PackedWeight` stored as `dtype` (e.g. bf16 from an
    f32 packed copy; see `pack_params`); other leaves unchanged."""
    def one(w):
        if isinstance(w, cpu_kernels.PackedWeight) and w.dtype != dtype:
            return cpu_kernels.PackedWeight(w.data.astype(dtype), w.shape)
        return w

    return jax.tree.map(one, params, is_leaf=lambda w: isinstance(w, cpu_kernels.PackedWeight))


def unpack_params(params):
    """Inverse of `pack_params` (plain arrays everywhere)."""
    params = {k: v for k, v in params.items() if k != "packed_head"}
    return jax.tree.map(lambda w: w.unpacked() if isinstance(w, cpu_kernels.PackedWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, cpu_kernels.PackedWeight))


def _mlp(p, x, cfg: ModelConfig):
    gu = _dense(x, p["gate_up"])  # [B,T,2,F]
    gate, up = gu[:, :, 0], gu[:, :, 1]
    if cfg.act == "silu":
        h = jax.nn.silu(gate) * up
    else:
        h = jax.nn.gelu(gate, approximate=True) * up
    return _dense(h, p["down"])


def _attention(p, x, rope, k_cache, v_cache, length, mask, cfg: ModelConfig, rows=None):
    """One attention block (rope: its layer's rope_tables; rows: x's cache rows, see
    `hidden_states`). Returns (out [B,T,D], k_cache, v_cache)."""
    B, T, _ = x.shape
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = N // K
    qkv = _dense(x, p["qkv"])  # [B,T,K,G+2,H]
    if "qkv_bias" in p:
        qkv = qkv + p["qkv_bias"]
    q, k, v = qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1]  # [B,T,K,G,H], [B,T,K,H] x2
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope)

    k_cache = _write_rows(k_cache, k.transpose(0, 2, 1, 3), length, rows)  # [B,K,S,H]
    v_cache = _write_rows(v_cache, v.transpose(0, 2, 1, 3), length, rows)
    # q stays [B,T,K,G,H] (query head n = k*G + g): on CPU one kernel call reads it as
    # laid out and writes the output projection's input [B,T,N*H] (`cpu_kernels.attention`)
    out = cpu_kernels.attention(q, k_cache, v_cache, mask, cfg.attn_scale,
                                functools.partial(grouped_attention, scale=cfg.attn_scale), rows)
    out = _dense(out.reshape(B, T, N * H), p["o"])
    return out, k_cache, v_cache


def grouped_attention(q, k_cache, v_cache, mask, rows=None, *, scale):
    """q [B,T,K,G,H] over cache slots < W of k/v [B,K,S,H], mask [B,T,W] -> [B,T,K,G,H]
    in v's dtype (the jnp definition; `cpu_kernels.attention` on CPU). Each kv head's G
    query heads attend as one batched matmul. rows [B] (optional): q's row b attends over
    cache row rows[b] of a k/v of any number of rows."""
    W = mask.shape[-1]
    if rows is None:
        k_seen, v_seen = k_cache[:, :, :W], v_cache[:, :, :W]  # static window
    else:
        k_seen, v_seen = k_cache[rows, :, :W], v_cache[rows, :, :W]
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k_seen, preferred_element_type=jnp.float32,
                        precision=cpu_kernels.precision(q, k_seen)) * scale  # [B,K,G,T,W]
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    return jnp.einsum("BKGTS,BKSH->BTKGH", probs, v_seen, precision=cpu_kernels.precision(probs, v_seen))


# ----------------------------------------------------------------------------- forward
def hidden_states(params, tokens, positions, cache: KVCache, attn_mask, config: ModelConfig, rows=None):
    """Final-normed hidden states [B,T,D] and the cache with the T new K/V written.

    rows [B] int32 (optional, distinct): the tokens' rows are cache rows `rows` of a cache
    of any number of rows (a prefill block of a few rows of the server's cache): their
    K/V are read and written in place, the other rows untouched, and no copy of the rows'
    windows is made (a 2,048-slot window copied out and back cost ~0.03 s of a 0.1-0.14 s
    64-token block). The values are those of a cache of those rows alone."""
    cfg = config
    x = jnp.take(params["embed"], tokens, axis=0)  # [B,T,D]
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.d_model), dtype=x.dtype)
    W = attn_mask.shape[-1]
    if W > cache.max_len:
        raise ValueError(f"attn_mask spans {W} slots but the cache holds {cache.max_len}")
    length = cache.length if rows is None else cache.length[rows]
    if any(cfg.layer_window(i) is not None for i in range(cfg.n_layers)):
        kpos = key_positions(length, positions, W)  # [B,W]
        dist = positions[:, :, None] - kpos[:, None, :]  # [B,T,W]
    tables = {}  # one (cos, sin) per distinct RoPE (Gemma: local and global theta)
    new_k, new_v = [], []
    for i, p in enumerate(params["layers"]):
        key = (cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i))
        if key not in tables:
            # computed once ([B,T,H/2]): fused into every q and k rotation, XLA:CPU would
            # evaluate cos and sin per element (~9k of each a layer at 16 tokens)
            cos, sin = rope_tables(positions, jnp.asarray(rope_inv_freq(cfg.head_dim, *key)))
            tables[key] = (cpu_kernels.materialize(cos), cpu_kernels.materialize(sin))
        mask = attn_mask
        w = cfg.layer_window(i)
        if w is not None:
            mask = attn_mask & (dist < w)
        h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
        a, kc, vc = _attention(p, h, tables[key], cache.k[i], cache.v[i], length, mask, cfg, rows)
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
    return x, KVCache(k=tuple(new_k), v=tuple(new_v), length=cache.length)


def logits_from_hidden(params, h, config: ModelConfig):
    """h [...,D] -> logits [...,V] in f32."""
    w = params["embed"] if config.tie_embeddings else params["lm_head"]
    w = params.get("packed_head", w)  # a tied head packed as e.T (`pack_params`)
    if isinstance(w, cpu_kernels.PackedWeight):  # x @ w; `matmul` unpacks it off the kernel
        flat = h.reshape(-1, h.shape[-1])
        logits = cpu_kernels.matmul(flat, w).astype(jnp.float32).reshape(*h.shape[:-1], -1)
    elif h.dtype == w.dtype == jnp.float32:  # f32: the CPU kernel where it applies
        flat = h.reshape(-1, h.shape[-1])
        logits = (cpu_kernels.matmul_nt(flat, w) if config.tie_embeddings
                  else cpu_kernels.matmul(flat, w)).reshape(*h.shape[:-1], -1)
    elif config.tie_embeddings:
        logits = jnp.einsum("...D,VD->...V", h, w, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...D,DV->...V", h, w, preferred_element_type=jnp.float32)
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
        layers.append(fuse_layer(p, cfg))
    params = dict(embed=dense((V, D), 1.0), layers=layers, final_norm=norm(D))
    if not cfg.tie_embeddings:
        params["lm_head"] = dense((D, V))
    return params


def fuse_layer(p: dict, config: ModelConfig) -> dict:
    """A layer in the split layout (q, k, v, gate, up, q/k/v_bias) -> ours (qkv, gate_up,
    qkv_bias); other leaves pass through. numpy in, numpy out; jax in, jax out."""
    xp = jnp if any(isinstance(x, jax.Array) for x in p.values()) else np
    K, H = config.n_kv_heads, config.head_dim
    G = config.n_heads // K
    p = dict(p)
    q, k, v = p.pop("q"), p.pop("k"), p.pop("v")
    D = q.shape[0]
    p["qkv"] = xp.concatenate(
        [q.reshape(D, K, G, H), k.reshape(D, K, 1, H), v.reshape(D, K, 1, H)], axis=2)
    if "q_bias" in p:
        qb, kb, vb = p.pop("q_bias"), p.pop("k_bias"), p.pop("v_bias")
        p["qkv_bias"] = xp.concatenate(
            [qb.reshape(K, G, H), kb.reshape(K, 1, H), vb.reshape(K, 1, H)], axis=1)
    p["gate_up"] = xp.stack([p.pop("gate"), p.pop("up")], axis=1)
    return p


def split_layer(p: dict, config: ModelConfig) -> dict:
    """Inverse of `fuse_layer`."""
    K, H = config.n_kv_heads, config.head_dim
    G = config.n_heads // K
    p = dict(p)
    qkv = p.pop("qkv")
    D = qkv.shape[0]
    p.update(q=qkv[:, :, :G].reshape(D, K * G * H), k=qkv[:, :, G].reshape(D, K * H),
             v=qkv[:, :, G + 1].reshape(D, K * H))
    if "qkv_bias" in p:
        b = p.pop("qkv_bias")
        p.update(q_bias=b[:, :G].reshape(-1), k_bias=b[:, G].reshape(-1), v_bias=b[:, G + 1].reshape(-1))
    gu = p.pop("gate_up")
    p.update(gate=gu[:, 0], up=gu[:, 1])
    return p


def split_param_shapes(config: ModelConfig):
    """Like `param_shapes`, in the split layout that checkpoints use (see `fuse_layer`)."""
    def split():
        params = init_params(config, jax.random.PRNGKey(0))
        return dict(params, layers=[split_layer(p, config) for p in params["layers"]])

    return jax.tree.map(lambda x: tuple(x.shape), jax.eval_shape(split))


def param_shapes(config: ModelConfig):
    """Expected shape of every leaf, as the same pytree structure as init_params."""
    return jax.tree.map(
        lambda x: tuple(x.shape),
        jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0))),
    )
