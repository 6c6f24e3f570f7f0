"""Packing for the CPU kernels: every decision about it, and every operation on params
above the kernels' own layout functions.

On one CPU device in float32 with the CPU kernels on, the layer weights (and an untied
lm_head) run packed for the matmul kernel (`models.transformer.pack_params`: ~2x faster
weight reads, bitwise the same logits; `LOOKAHEAD_JAX_CPU_KERNELS=0` turns kernels and
packing off). This module decides where that applies and does it; `loading.load` and
`engine.Engine` call it and hold no packing logic of their own. The layout itself
(`pack_params`, `pack_leaf`, `cast_packed`, `unpack_params` in `models/transformer.py`,
`cpu_kernels.pack` / `PackedWeight`) stays in `models/`.

* whether: `packs(params)` (params as placed: f32 on one CPU device, kernels on),
  `is_packed` / `packed_dtype` (packed already, and how the packed weights are stored);
* at load: `on_load` -> a `LoadPacking` (or None where nothing packs): each weight packed
  as the checkpoint is read (`LoadPacking.put`), then whatever the model still holds plain
  (`LoadPacking.finish` = `pack_for_cpu`, in place): one copy of the weights, never a plain
  and a packed one at once;
* the engine's copy (`Engine.params`): `packed_copy` (plain params packed into a copy
  beside them, packed ones cast to the engine's weight dtype), `unpacked` (plain arrays for
  a mesh's rule table), `weight_dtype` / `check_weight_dtype` (`Engine.weight_dtype`'s
  values), `keep_only` (`Engine.keep_packed_only`'s swap: the packed copy becomes the
  model's params).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..models import cpu_kernels
from ..models.transformer import cast_packed, pack_leaf, pack_params, unpack_params


# ------------------------------------------------------------------ whether
def packed_dtype(params):
    """The storage dtype of the params' packed layer weights (None: not packed)."""
    layers = params.get("layers") if isinstance(params, dict) else None
    for v in (layers[0].values() if layers else ()):
        if isinstance(v, cpu_kernels.PackedWeight):
            return v.dtype
    return None


def is_packed(params) -> bool:
    """Whether `params` hold packed layer weights (`pack_params`; e.g. from `load`)."""
    return packed_dtype(params) is not None


def packs(params) -> bool:
    """Whether `Engine.params` runs these params packed for the CPU kernels (f32 on one
    CPU device, kernels on) rather than as they are."""
    return _packable(jax.tree.leaves(params))


def _packable(leaves) -> bool:
    if not leaves or any(getattr(x, "dtype", None) != jnp.float32 for x in leaves):
        return False
    for x in leaves:
        devices = getattr(getattr(x, "sharding", None), "device_set", None)
        if not devices or len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return False
    return bool(cpu_kernels.vector_width())


def _packs_dtype(dtype) -> bool:
    """Whether `Engine.params` would pack params of `dtype` placed on the default device
    (one CPU device, f32, the CPU kernels on): then `load` packs them as it reads them."""
    return packs({"probe": jnp.zeros((), dtype)})


# ------------------------------------------------------------------ at load
@dataclasses.dataclass(frozen=True)
class LoadPacking:
    """How `load` packs the model it reads (`on_load`). dtype: how packed weights are
    stored: None (f32, the model's exact values) or bfloat16 (`load`'s packed_dtype)."""

    dtype: Any = None

    def put(self, key, x, config) -> dict:
        """`checkpoint.restore_checkpoint(put=)`: the saved model's weights packed for the
        CPU kernels as each is read (`models.transformer.pack_leaf`), never a plain and a
        packed copy at once."""
        return pack_leaf(key, x, config, self.dtype)

    def finish(self, model) -> bool:
        """Pack what `model` still holds plain, in place (`pack_for_cpu`): the whole model
        where it was not read through `put` (a GGUF file, an HF directory); nothing where
        it was."""
        return pack_for_cpu(model, self.dtype)


def on_load(dtype, packed_dtype=None, keep_unpacked: bool = False):
    """How `load` packs a model of `dtype` (a parsed dtype) read onto the default device: a
    `LoadPacking` where `Engine.params` would run it packed (one CPU device, f32, the CPU
    kernels on), None where it runs as loaded or `keep_unpacked` asks for plain arrays.
    packed_dtype: a parsed dtype or None (float32 is stored as None: the params' own)."""
    if keep_unpacked or not _packs_dtype(dtype):
        return None
    return LoadPacking(None if packed_dtype == jnp.float32 else packed_dtype)


def pack_for_cpu(model, dtype=None) -> bool:
    """Pack `model.params` in place for the CPU kernels where `Engine.params` would run a
    packed copy (one CPU device, f32, kernels on): each weight is replaced by its packed
    form as it is made (`pack_params(consume=True)`), so the model never holds two copies.
    Returns whether it packed anything. `model.params` is rebound to the packed dict; the
    dicts it held before are emptied of the packed weights (do not keep using them).
    dtype: the packed weights' storage (`load`'s packed_dtype)."""
    if is_packed(model.params) or not packs(model.params):
        return False
    model.params = pack_params(model.params, dtype, consume=True)
    return True


# ------------------------------------------------------------------ the engine's copy
def packed_copy(params, weight_dtype=None):
    """The params the steps run on without a mesh (`Engine.params`): packed params as they
    are, their packed weights cast to `weight_dtype` where it is set (`cast_packed`);
    plain params that pack (`packs`: one CPU device, f32, kernels on) packed into a copy
    beside them (`pack_params`); otherwise `params` itself (GPU/TPU, bf16, kernels off)."""
    if is_packed(params):  # `lj.load` or `keep_packed_only` made the packed copy the model's params
        if weight_dtype is not None:
            params = cast_packed(params, weight_dtype)
        return params
    if packs(params):
        return pack_params(params, weight_dtype)  # eager: the leaves it does not pack stay shared
    return params


def unpacked(params):
    """`params` as a mesh's rule table takes them: plain arrays (a plain copy of packed
    params, `unpack_params`; others as they are)."""
    if is_packed(params):  # packed for one CPU (`lj.load`): the rule table shards plain arrays
        return unpack_params(params)
    return params


def weight_dtype(dtype):
    """`Engine.weight_dtype`'s value for `dtype`: None (None or float32: the params' own)
    or bfloat16; ValueError for any other."""
    dtype = None if dtype is None or jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)
    if dtype is not None and dtype != jnp.bfloat16:
        raise ValueError(f"weight_dtype must be None, float32 or bfloat16, got {dtype}")
    return dtype


def check_weight_dtype(params, dtype) -> None:
    """ValueError where the model's `params` cannot be run with weights stored as `dtype`
    (a `weight_dtype` value): `keep_packed_only` made a bf16 copy its only weights."""
    if packed_dtype(params) == jnp.bfloat16 and dtype != jnp.bfloat16:
        raise ValueError("keep_packed_only() made the bf16 copy this engine's only weights: "
                         "reload the model to go back to float32")


def keep_only(model, placed, mesh) -> bool:
    """Make `placed` (the engine's params for `model`, `Engine.params`) the model's own
    params, so one copy of the weights stays in memory instead of two. Returns whether
    anything changed: nothing where `placed` IS `model.params` (no packing applies, or
    packed already) or on a mesh (there `placed` is sharded, not packed)."""
    if placed is model.params or mesh is not None:
        return False
    model.params = placed
    return True
