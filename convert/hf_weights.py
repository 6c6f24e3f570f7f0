"""HF transformers checkpoints (config.json + safetensors) -> (ModelConfig, params).

    load_hf_dir(dir)                          local directory: config.json and either
                                              model.safetensors or model-0000x-of-0000y
                                              shards listed in model.safetensors.index.json
    params_from_hf_state_dict(sd, config)     {HF name: numpy array} -> params pytree

Safetensors files are read with a small numpy reader (memory-mapped, lazy), because the
`safetensors` package's numpy backend cannot return bfloat16 (numpy has no such dtype;
we use `ml_dtypes.bfloat16`, which JAX depends on). The key maps and transformations
(transpose Linear weights, Gemma's 1 + w norms) live in `convert/keymaps.py`.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lookahead_jax.models import ModelConfig

from .keymaps import HF_KEYMAPS, build_params, plan

# Checkpoint name variants of the same text-decoder weights, normalised to "model.*".
_PREFIXES = (
    ("model.language_model.", "model."),  # Gemma3ForConditionalGeneration, transformers>=4.52
    ("language_model.model.", "model."),  # Gemma3ForConditionalGeneration, older saves
    ("language_model.lm_head.", "lm_head."),
)
# Non-decoder parts of multimodal Gemma-3 checkpoints (skipped by load_hf_dir).
GEMMA3_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
    "model.multi_modal_projector.",
)
# Buffers some older checkpoints saved; recomputed from the config, never needed.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _normalise(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def params_from_hf_state_dict(
    state_dict: Mapping[str, np.ndarray],
    config: ModelConfig,
    dtype=jnp.float32,
    *,
    skip_prefixes: tuple = (),
    progress: bool = False,
):
    """HF state dict (name -> numpy array, any float dtype) -> our params pytree.

    `state_dict` may be lazy (e.g. memory-mapped): only `.shape` is read before the whole
    name/shape plan has been checked. With tied embeddings, an `lm_head.weight` equal to
    the embedding (torch's `state_dict()` lists it) is accepted and dropped.
    `skip_prefixes`: names to ignore on purpose (e.g. a vision tower).
    """
    if config.family not in HF_KEYMAPS:
        raise ValueError(f"no HF key map for family {config.family!r}; known: {list(HF_KEYMAPS)}")
    keymap = HF_KEYMAPS[config.family]
    by_name: dict[str, str] = {}  # normalised name -> original name
    for name in state_dict:
        if name.startswith(tuple(skip_prefixes)) or name.endswith(_IGNORED_SUFFIXES):
            continue
        norm = _normalise(name)
        if norm in by_name:
            raise ValueError(f"HF tensors {by_name[norm]!r} and {name!r} are the same weight")
        by_name[norm] = name

    if config.tie_embeddings and "lm_head.weight" in by_name:
        head = np.asarray(state_dict[by_name["lm_head.weight"]])
        embed_name = by_name.get("model.embed_tokens.weight")
        embed = None if embed_name is None else np.asarray(state_dict[embed_name])
        if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
            raise ValueError(
                "HF tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but the "
                "config ties them (tie_word_embeddings=true): set tie_word_embeddings=false "
                "in config.json (config.tie_embeddings=False) to use the separate head."
            )
        del by_name["lm_head.weight"]

    shapes = {n: tuple(state_dict[orig].shape) for n, orig in by_name.items()}
    routes = plan(shapes, keymap, config)
    return build_params(
        routes, lambda n: state_dict[by_name[n]], config, dtype,
        progress=progress, desc="HF -> params",
    )


# ----------------------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """{name: read-only memory-mapped numpy array} of one .safetensors file.

    Format: u64 little-endian header size N, N bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data block
    (offsets are relative to its start).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: not a safetensors file or truncated (header size {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + n else np.zeros(0, np.uint8)
    base = 8 + n
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dt = np.dtype(_ST_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if base + end > size or end - begin != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) lies outside the file "
                f"or has a wrong byte size: the file is truncated or corrupt"
            )
        out[name] = data[base + begin: base + end].view(dt).reshape(shape)
    return out


def read_hf_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    """All tensors of an HF directory: model.safetensors or index-listed shards (lazy)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.exists(os.path.join(path, fn))]
        if missing:
            raise ValueError(f"{index} lists shard(s) that are not there: {missing}")
        tensors = {}
        for fn in files:
            part = read_safetensors(os.path.join(path, fn))
            for name in [n for n, f in weight_map.items() if f == fn]:
                if name not in part:
                    raise ValueError(f"{index} says {name!r} is in {fn}, but it is not")
                tensors[name] = part[name]
        return tensors
    if os.path.exists(single):
        return read_safetensors(single)
    present = sorted(os.listdir(path))
    raise ValueError(
        f"{path}: no model.safetensors or model.safetensors.index.json (found {present}). "
        "PyTorch .bin checkpoints are not read: re-save with "
        "`model.save_pretrained(dir, safe_serialization=True)`."
    )


def load_hf_dir(path, dtype=jnp.float32, *, progress: bool = False):
    """Local HF model directory -> (ModelConfig, params).

    Reads config.json via `ModelConfig.from_hf`, then the safetensors weights.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path}: no config.json; expected a local HF model directory")
    with open(cfg_path) as f:
        hf = json.load(f)
    config = ModelConfig.from_hf(hf)
    skip: tuple = GEMMA3_VISION_PREFIXES if hf.get("model_type") == "gemma3" else ()
    tensors = read_hf_safetensors_dir(path)
    params = params_from_hf_state_dict(
        tensors, config, dtype, skip_prefixes=skip, progress=progress
    )
    return config, params
