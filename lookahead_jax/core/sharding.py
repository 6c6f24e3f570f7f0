"""Device mesh and partition rules: every sharding decision of the project, in one place.

A 2-axis mesh ("data", "model"):

* "data" splits the batch B (activations, the KV cache); params are replicated over it.
* "model" is tensor parallelism (Megatron style): each attention block shards heads and
  each MLP shards F, so a block needs one all-reduce (after `o` / `down`), and the KV
  cache of a device holds only its own kv heads.

The rules map param paths ("embed", "layers.3.q", ... as in `models/transformer.py`) to a
PartitionSpec, together with what each dimension is in the axis legend (V vocab, D model,
NH = N*H query heads x head dim, K kv heads, C = G+2 (a kv head's G query heads, its key
and its value), H head dim, F mlp, "2" gate/up). A dimension is split only whole heads at
a time: when the "model" axis does not divide the unit it splits (N for NH, K, F, V), that
tensor is replicated along it instead (logged once per call), e.g. a GQA model with K=2 kv
heads on model=4 keeps qkv and the cache's kv heads replicated while o and the MLP are
still split. qkv is split by kv head (models/transformer.py groups each kv head with its
query heads), so a K-split gives every device whole GQA groups and the matching cache.

embed [V,D] is split over V, not D: with tied embeddings (Gemma, SmolLM2) the same matrix
is the LM head, and a V-split head gives each device its own slice of the logits with no
reduction over D, whereas a D-split one would all-reduce the largest activation of the
step, [B,T,V]. The lookup itself (`take` over V) costs one all-reduce of [B,T,D].

The mesh uses `AxisType.Auto` (jax.make_mesh defaults to Explicit axes in jax 0.10): the
model code is sharding-agnostic, so the params' and inputs' NamedShardings are the only
annotations and XLA's propagation (Shardy) partitions the rest. On an Explicit mesh the
unchanged model fails to trace: the embedding `take` from a V-split table already raises
ShardingTypeError asking for an `out_sharding`.

    mesh = make_mesh(data=2, model=4)
    params = shard_params(params, config, mesh)     # jax.device_put by the rules
    cache = init_sharded_cache(config, B, S, jnp.float32, mesh)   # or shard_cache(cache, mesh)
    tokens = shard_batch(tokens, mesh)                 # [B, ...] over "data"
    config, params = restore_checkpoint(path, sharding=checkpoint_sharding(mesh))
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models import KVCache, init_cache, init_params
from ..models.config import ModelConfig

log = logging.getLogger("lookahead_jax")

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# path pattern (re.fullmatch) -> (legend of each dim, spec). Every param leaf must match
# exactly one rule; an unmatched path is an error, never silently replicated.
PARAM_RULES = (
    (r"embed", "V D", P(MODEL, None)),  # vocab-split: see the module docstring
    (r"lm_head", "D V", P(None, MODEL)),  # columns = vocab
    (r"final_norm", "D", P(None)),
    (r"layers\.\d+\.(attn_norm|mlp_norm|post_attn_norm|post_mlp_norm)", "D", P(None)),
    (r"layers\.\d+\.(q_norm|k_norm)", "H", P(None)),
    (r"layers\.\d+\.qkv", "D K C H", P(None, MODEL, None, None)),  # kv heads with their query heads
    (r"layers\.\d+\.o", "NH D", P(MODEL, None)),  # rows = query heads
    (r"layers\.\d+\.qkv_bias", "K C H", P(MODEL, None, None)),  # biases follow their columns
    (r"layers\.\d+\.gate_up", "D 2 F", P(None, None, MODEL)),  # columns = F
    (r"layers\.\d+\.down", "F D", P(MODEL, None)),  # rows = F
)

# KV cache: k[i], v[i] [B,K,S,H], length [B].
CACHE_KV_DIMS, CACHE_KV_SPEC = "B K S H", P(DATA, MODEL, None, None)
CACHE_LENGTH_DIMS, CACHE_LENGTH_SPEC = "B", P(DATA)


# ----------------------------------------------------------------------------- mesh
def make_mesh(data: int = 1, model: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ("data", "model") mesh of data x model devices (Auto axes).

    model=None takes every device left: len(devices) // data.
    """
    devices = list(jax.devices() if devices is None else devices)
    if model is None:
        if len(devices) % data:
            raise ValueError(f"data={data} does not divide the {len(devices)} devices")
        model = len(devices) // data
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
    if data * model > len(devices):
        raise ValueError(f"a data={data} x model={model} mesh needs {data * model} devices; "
                         f"{len(devices)} available")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices[: data * model])


def _axis_sizes(mesh) -> dict:
    """{"data": n, "model": m} of a Mesh or AbstractMesh (checked to have both axes)."""
    sizes = dict(mesh.shape)
    if set(AXES) - set(sizes):
        raise ValueError(f"mesh axes {tuple(sizes)} must include {AXES} (see make_mesh)")
    return sizes


# ----------------------------------------------------------------------------- rules
def _units(config: ModelConfig) -> dict:
    """What a split of each param legend dim must divide (whole heads, not N*H columns)."""
    c = config
    return {"V": c.vocab_size, "D": c.d_model, "NH": c.n_heads, "K": c.n_kv_heads,
            "C": c.n_heads // c.n_kv_heads + 2, "H": c.head_dim, "F": c.d_ff, "2": 2}


def _sizes(config: ModelConfig) -> dict:
    """The size of each legend dim, for shape checks."""
    c = config
    return {"V": c.vocab_size, "D": c.d_model, "NH": c.n_heads * c.head_dim,
            "K": c.n_kv_heads, "C": c.n_heads // c.n_kv_heads + 2, "H": c.head_dim,
            "F": c.d_ff, "2": 2}


def path_str(path) -> str:
    """jax key path -> "layers.3.q" (the names the rules match)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def rule_for(path: str):
    """(dims, spec) of the one rule matching `path`; ValueError when none does."""
    hits = [(dims, spec) for pat, dims, spec in PARAM_RULES if re.fullmatch(pat, path)]
    if len(hits) != 1:
        raise ValueError(f"param {path!r} matches {len(hits)} partition rules (need exactly 1); "
                         "add it to lookahead_jax.core.sharding.PARAM_RULES")
    dims, spec = hits[0]
    return tuple(dims.split()), spec


def _fit(path: str, dims: tuple, spec: P, units: dict, sizes: dict, fallbacks: dict) -> P:
    """`spec` with every split that does not divide its unit replaced by None (recorded)."""
    out = []
    for dim, axis in zip(dims, tuple(spec) + (None,) * (len(dims) - len(spec))):
        n = units.get(dim)  # None: unknown (the cache's batch) -> assumed to divide
        if axis is not None and n is not None and n % sizes[axis]:
            fallbacks.setdefault((axis, sizes[axis], dim, n), set()).add(
                re.sub(r"\.\d+\.", ".*.", path))  # layers.3.k -> layers.*.k
            axis = None
        out.append(axis)
    return P(*out)


_UNIT_NAMES = {"V": "vocab_size", "NH": "n_heads", "K": "n_kv_heads",
               "F": "d_ff", "D": "d_model", "H": "head_dim", "B": "batch"}


def _log_fallbacks(fallbacks: dict) -> None:
    for (axis, size, dim, n), paths in sorted(fallbacks.items()):
        log.warning("sharding: the %r axis (%d) does not divide %s=%d; replicating %s along it",
                    axis, size, _UNIT_NAMES[dim], n, ", ".join(sorted(paths)))


@functools.lru_cache(maxsize=32)
def _param_structure(config: ModelConfig):
    """ShapeDtypeStructs (f32) of the params pytree of `config`: no arrays allocated."""
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def param_specs(config: ModelConfig, mesh):
    """Pytree of PartitionSpec matching the params of `config` (Mesh or AbstractMesh)."""
    sizes = _axis_sizes(mesh)
    units, dim_sizes, fallbacks = _units(config), _sizes(config), {}

    def spec(path, leaf):
        p = path_str(path)
        dims, s = rule_for(p)
        want = tuple(dim_sizes[d] for d in dims)
        if want != tuple(leaf.shape):  # the rule table and transformer.py disagree
            raise ValueError(f"param {p} has shape {tuple(leaf.shape)}, rule says {dims} = {want}")
        return _fit(p, dims, s, units, sizes, fallbacks)

    specs = jax.tree_util.tree_map_with_path(spec, _param_structure(config))
    _log_fallbacks(fallbacks)
    return specs


def param_shardings(config: ModelConfig, mesh):
    """Pytree of NamedSharding matching the params of `config`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def _cache_specs(mesh, n_layers: int, kv_heads: int, batch: Optional[int]) -> KVCache:
    sizes = _axis_sizes(mesh)
    units, fallbacks = {"B": batch, "K": kv_heads, "S": None, "H": None}, {}
    kv = _fit("cache.k/v", tuple(CACHE_KV_DIMS.split()), CACHE_KV_SPEC, units, sizes, fallbacks)
    length = _fit("cache.length", (CACHE_LENGTH_DIMS,), CACHE_LENGTH_SPEC, units, sizes, fallbacks)
    _log_fallbacks(fallbacks)
    return KVCache(k=(kv,) * n_layers, v=(kv,) * n_layers, length=length)


def cache_specs(config: ModelConfig, mesh, batch: Optional[int] = None) -> KVCache:
    """KVCache of PartitionSpec: batch over "data", kv heads over "model" when they divide.

    batch=None assumes the batch divides the data axis (it must, to be split)."""
    return _cache_specs(mesh, config.n_layers, config.n_kv_heads, batch)


def _named(mesh, specs: KVCache) -> KVCache:
    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    return KVCache(k=tuple(map(ns, specs.k)), v=tuple(map(ns, specs.v)), length=ns(specs.length))


def cache_shardings(config: ModelConfig, mesh, batch: Optional[int] = None) -> KVCache:
    """KVCache of NamedSharding (see `cache_specs`)."""
    return _named(mesh, cache_specs(config, mesh, batch))


# ----------------------------------------------------------------------------- placing arrays
def shard_params(params, config: ModelConfig, mesh):
    """`params` placed on `mesh` by the rules (jax.device_put; checks structure and shapes)."""
    want = _param_structure(config)
    got_paths = {path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want_paths = {path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(want)}
    if got_paths.keys() != want_paths.keys():
        raise ValueError(
            f"params do not match the config: missing {sorted(want_paths.keys() - got_paths.keys())[:6]}, "
            f"unexpected {sorted(got_paths.keys() - want_paths.keys())[:6]}")
    bad = [f"{p}: {tuple(got_paths[p])} != {tuple(s)}" for p, s in want_paths.items()
           if tuple(got_paths[p]) != tuple(s)]
    if bad:
        raise ValueError(f"params do not match the config's shapes: {bad[:6]}")
    shardings = param_shardings(config, mesh)
    if jax.process_count() > 1:  # each process places its own devices' shards from its own copy
        def put(x, sharding):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # placed over the processes already
                # (`load(mesh=)`, then the engine): it may hold only this process's shards, which
                # np.asarray cannot read (a 'model' axis spanning processes)
                return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return jax.tree.map(put, params, shardings)
    return jax.device_put(params, shardings)


def shard_cache(cache: KVCache, mesh) -> KVCache:
    """`cache` placed on `mesh`: batch over "data", kv heads over "model" when they divide."""
    B, K = cache.k[0].shape[:2]
    return jax.device_put(cache, _named(mesh, _cache_specs(mesh, len(cache.k), K, B)))


def init_sharded_cache(config: ModelConfig, batch: int, max_len: int, dtype, mesh) -> KVCache:
    """`models.init_cache` created in place on `mesh` (each device allocates only its shard;
    `shard_cache(init_cache(...))` would first build the whole cache on one device)."""
    out = cache_shardings(config, mesh, batch)
    return jax.jit(lambda: init_cache(config, batch, max_len, dtype), out_shardings=out)()


def batch_spec(ndim: int, batch: Optional[int], mesh) -> P:
    """Spec of an activation [B, ...] (tokens, positions, masks): B over "data" if it divides."""
    data = _axis_sizes(mesh)[DATA]
    split = batch is None or batch % data == 0
    return P(DATA if split else None, *([None] * (ndim - 1)))


def shard_batch(xs, mesh):
    """Every array leaf [B, ...] of `xs` placed with B over "data" (replicated if it doesn't
    divide; a scalar, e.g. the row a one-row prefill block selects, replicated)."""
    def put(x):
        x = jnp.asarray(x)
        spec = batch_spec(x.ndim, x.shape[0], mesh) if x.ndim else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, xs)


def replicate(xs, mesh):
    """Every array leaf of `xs` placed whole on every device of `mesh`. A host value goes
    from each process to its own devices (`make_array_from_callback`: no cross-process
    check that every process passed the same value, which `jax.device_put` makes with a
    collective per array; over several processes the values are equal by construction,
    `core.multihost`)."""
    whole = NamedSharding(mesh, P())

    def put(x):
        if isinstance(x, jax.Array):
            return jax.device_put(x, whole)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, whole, lambda index: x[index])

    return jax.tree.map(put, xs)


# ----------------------------------------------------------------------------- checkpoints
def abstract_params(config: ModelConfig, mesh, dtype=jnp.float32):
    """Pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` of the params: the
    target an orbax restore reads straight into shards (or `jax.jit(...).lower` input)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=s),
        _param_structure(config), param_shardings(config, mesh),
    )


def checkpoint_sharding(mesh):
    """The `sharding` argument of `convert.checkpoint.restore_checkpoint` for `mesh`:

        config, params = restore_checkpoint(path, dtype, sharding=checkpoint_sharding(mesh))

    a function of the config (only the checkpoint knows it) returning the param
    NamedShardings; restore_checkpoint builds the sharded ShapeDtypeStructs from them and
    the stored metadata, so every device reads only its own shards."""
    def shardings(config: ModelConfig):
        return param_shardings(config, mesh)

    return shardings


__all__ = [
    "AXES", "CACHE_KV_SPEC", "CACHE_LENGTH_SPEC", "DATA", "MODEL", "PARAM_RULES",
    "abstract_params", "batch_spec", "cache_shardings", "cache_specs", "checkpoint_sharding",
    "init_sharded_cache", "make_mesh", "param_shardings", "param_specs", "path_str", "replicate", "rule_for",
    "shard_batch",
    "shard_cache", "shard_params",
]
