"""CPU kernels for XLA:CPU decode and verify steps: f32 matmuls, attention, argmax.

On CPU a decode step is a pass over the weights, and XLA's dot costs ~30% more at 2 rows
than at 1 and ~60% more at 4 (bench/ceiling.py): a tree verify step of a few tokens pays
for rows it barely computes. `cpu_kernels.cc` (XLA FFI custom calls) uses every loaded
weight vector for all rows at once, so up to ~8 rows cost about one pass over the weights.

`matmul(x, w)` and `matmul_nt(x, e)` are drop-in for `x @ w` and `x @ e.T` on 2-D f32
operands; `attention(q, k, v, mask, scale, reference)` is one layer's attention of a few
new tokens over the cache in one call, where XLA runs ~12 small ops whose fixed costs
dominate at decode sizes (2-4 ms of a SmolLM2 step); `argmax(x)` is jnp.argmax over the
last axis (XLA's reduce costs ~0.1 ms per 49k-logit row); `knn_shortlist` is the exact KNN
search's shortlist pass (keys read once for all queries). They take the kernel only where
it pays and is possible, decided at trace time:

* lowering for CPU (`lax.platform_dependent`: GPU/TPU lower plain `dot` / the reference),
* f32 operands, 1..MAX_ROWS rows (attention: 1..MAX_ATTN_TOKENS tokens, or any number
  at a window of MIN_PREFILL_ATTN_WINDOW slots or more), the vectorised dims multiples
  of the vector width,
* the kernel built: at first use, by the host C++ compiler (`c++ -O3 -march=native`,
  AVX2+FMA or AVX-512; cached per source, CPU and jax version under
  `<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/kernels`). No compiler, another
  architecture, or `LOOKAHEAD_JAX_CPU_KERNELS=0`: plain `dot` everywhere, one log line (a
  warning when the build fails). A cached library that does not load (truncated) is
  deleted and rebuilt once.

Packed weights: `pack(w)` stores w [K, N] as column tiles [N/TW, K, TW] (`PackedWeight`, a
pytree node). The kernel then reads each tile as one contiguous stream instead of K
pieces a row of w apart, ~2x faster on the weight reads that bound a decode step, and it
takes any number of rows: above 16 (prefill blocks, large trees) a cache-blocked product
whose throughput matches XLA's and torch's GEMMs (so prefill uses it too), each row still
bitwise what it gives alone. `models.transformer.pack_params` packs a model's layer weights;
`lookahead_jax.loading.runtime_params` does it for generation on one CPU device.

A row's result does not depend on how many rows share the call, nor on packing, nor
(attention) on masked slots of a wider window, so the logits of a token are bitwise the
same in a greedy step and in a verify block of up to 16 tokens. Derivatives go through
plain dots and the jnp reference (custom JVP), so training code can differentiate a model
that uses them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("lookahead_jax")

MAX_ROWS = 16  # above this XLA's GEMM is as fast (compute, not weight reads, dominates)
MAX_ROWS_NT = 16  # x @ e.T (tied embeddings as the output layer)
MAX_ATTN_TOKENS = 16  # attention: decode and verify blocks, at any window
# attention of more tokens (prefill blocks): the kernel from this window on. It reads each
# row only to its last visible slot where XLA's batched dots read the whole window (64
# tokens over 2,048 slots, the row at 800: 0.30 against 0.71-0.85 s of CPU for SmolLM2's 30
# layers; a whole 512-token prompt 0.35 against 1.5 s); at a 128 window XLA's is cheaper
# (0.03 against 0.13 s), issue 57
MIN_PREFILL_ATTN_WINDOW = 512
MAX_KNN_QUERIES = 64  # knn_shortlist: a speculative round's queries (the kernel takes any Q)
SOURCE = Path(__file__).with_name("cpu_kernels.cc")
_lock = threading.Lock()
_state: dict = {}  # "width": vector width once built and registered, or "error": why not


def cpu_id() -> str:
    """Short hex hash (10 digits) of the CPU model and features: the model name and
    feature lines of /proc/cpuinfo (x86 "flags", Arm "Features" and "CPU part"), or
    `platform.processor()` where it cannot be read. Native code built for this CPU (the
    kernel here, XLA's persistent compilation cache) is only valid where it is the same."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        text = platform.processor() or platform.platform()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def cache_root() -> Path:
    """The package's cache folder: $LOOKAHEAD_JAX_CACHE, else ~/.cache/lookahead_jax (not
    created here). Read here as `lookahead_jax.presets.cache_root` reads it, because models/
    imports nothing from the package above it (tests/test_cpu_kernels.py checks the two
    agree)."""
    env = os.environ.get("LOOKAHEAD_JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lookahead_jax"


def _build(flags: tuple = ()) -> Path:
    """Compile cpu_kernels.cc (cached); `flags` are extra compiler flags (tests build the
    AVX2 variant on an AVX-512 machine with ("-mno-avx512f",))."""
    asked = os.environ.get("CXX")
    cxx = shutil.which(asked) if asked else (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"))
    if not cxx:
        raise RuntimeError(f"no C++ compiler found ({'CXX=' + asked if asked else 'c++, g++, clang++'}); "
                           "install g++ or set CXX")
    src = SOURCE.read_bytes()
    key = hashlib.sha1(src + cpu_id().encode() + platform.machine().encode() + jax.__version__.encode()
                       + cxx.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / key / "libcpu_kernels.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cxx, "-O3", "-march=native", *flags, "-std=c++17", "-shared", "-fPIC",
               "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(tmp_so)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {r.stderr.strip()[-800:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never load a half-written file
    return out


KERNELS = ("lookahead_matmul_nn", "lookahead_matmul_nn_packed", "lookahead_matmul_nn_packed_bf16",
           "lookahead_matmul_nt", "lookahead_attention", "lookahead_attention_rows", "lookahead_argmax",
           "lookahead_copy",
           "lookahead_knn_shortlist_f16", "lookahead_knn_shortlist_f32")


def _check_elf(path: Path) -> None:
    """OSError unless `path` is a whole 64-bit ELF file: every segment and the section
    header table (which the linker writes last) inside it. dlopen of a truncated library
    can die of SIGBUS instead of failing, so this is checked before loading."""
    data = path.read_bytes()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:  # ELFCLASS64
        raise OSError(f"{path} is not a 64-bit ELF library")
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(phnum if phoff + phentsize * phnum <= len(data) else 0):
        offset, _, _, filesz = struct.unpack_from("<QQQQ", data, phoff + i * phentsize + 8)
        end = max(end, offset + filesz)
    if end > len(data):
        raise OSError(f"{path} is truncated ({len(data)} of at least {end} bytes)")


def _open(path: Path):
    """The library at `path`, loaded, with every kernel symbol present (OSError/AttributeError:
    not a usable library, e.g. a file truncated by a full disk or an interrupted copy)."""
    _check_elf(path)
    lib = ctypes.CDLL(str(path))
    for name in (*KERNELS, "lookahead_vector_width"):
        getattr(lib, name)
    return lib


def _load():
    """The built library, loaded: a cached one that does not load is deleted and rebuilt
    once (a second failure is raised)."""
    path = _build()
    try:
        return _open(path)
    except (OSError, AttributeError) as e:
        log.info("cached CPU kernel %s does not load (%s): rebuilding it", path, e)
        path.unlink(missing_ok=True)
        return _open(_build())


def vector_width() -> Optional[int]:
    """The kernel's vector width (16 AVX-512, 8 AVX2), building and registering it on first
    call; None where it is off or cannot be built (then everything uses plain dot: a log
    line when switched off or on another architecture, a warning when the build fails)."""
    if "width" in _state or "error" in _state:
        return _state.get("width")
    with _lock:
        if "width" in _state or "error" in _state:
            return _state.get("width")
        if os.environ.get("LOOKAHEAD_JAX_CPU_KERNELS", "1") == "0":
            _state["error"] = "LOOKAHEAD_JAX_CPU_KERNELS=0"
        elif platform.machine().lower() not in ("x86_64", "amd64"):
            _state["error"] = f"no kernel for {platform.machine()}"
        else:
            try:
                lib = _load()
                for name in KERNELS:
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
                _state["width"] = int(lib.lookahead_vector_width())
                _state["lib"] = lib  # keep the library loaded
            except Exception as e:  # noqa: BLE001 - any failure means: use XLA's dot
                _state["error"] = str(e)
                log.warning("CPU kernels off, decoding ~20%% slower (%s); fix the build or set "
                            "LOOKAHEAD_JAX_CPU_KERNELS=0 to run without them", " ".join(str(e).split()))
                return None
        if "error" in _state:
            log.info("CPU matmul kernels off (%s): XLA dot everywhere", _state["error"])
    return _state.get("width")


def _usable(x, w, vec_dim: int, max_rows: int) -> bool:
    """Whether the kernel takes this product (vec_dim: the dim it vectorises over)."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        return False
    if not 1 <= x.shape[0] <= max_rows:
        return False
    vw = vector_width()
    return bool(vw) and vec_dim % vw == 0


def precision(*xs):
    """Dot precision for operands `xs`: HIGHEST when all are f32, so an f32 model computes
    in f32 on every backend (GPUs would otherwise use TF32 and TPUs one bf16 pass, whose
    rounding differs between a 1-row greedy step and a many-row verify block by ~1e-3,
    enough to flip near-tied argmaxes); the backend's default for bf16."""
    return jax.lax.Precision.HIGHEST if all(x.dtype == jnp.float32 for x in xs) else None


def _dot(x, w):
    return jnp.matmul(x, w, precision=precision(x, w))


def _dot_nt(x, e):
    return jnp.matmul(x, e.T, precision=precision(x, e))


def _ffi(name, x, w, n):
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, w)


def _with_plain_jvp(kernel, plain):
    """f(*args): `kernel(*args)` when lowering for CPU, `plain(*args)` (the jnp version)
    on other backends; derivatives are plain's (custom JVP), so training code can
    differentiate through the kernels."""

    @jax.custom_jvp
    def f(*args):
        return jax.lax.platform_dependent(*args, cpu=kernel, default=plain)

    @f.defjvp
    def _jvp(primals, tangents):
        return f(*primals), jax.jvp(plain, primals, tangents)[1]

    return f


_nn = _with_plain_jvp(lambda x, w: _ffi("lookahead_matmul_nn", x, w, w.shape[1]), _dot)
_nt = _with_plain_jvp(lambda x, e: _ffi("lookahead_matmul_nt", x, e, e.shape[0]), _dot_nt)


def matmul(x, w):
    """x [M,K] @ w [K,N]; w may be a `PackedWeight` (then any M takes the kernel)."""
    if isinstance(w, PackedWeight):
        if x.ndim == 2 and x.dtype == jnp.float32 and vector_width():
            if w.dtype == jnp.float32:
                return _nn_packed(x, w.data)
            if w.dtype == jnp.bfloat16:
                return _nn_packed_bf16(x, w.data)
        return _packed_dot(x, w.data)
    if _usable(x, w, w.shape[1], MAX_ROWS):
        return _nn(x, w)
    return _dot(x, w)


def argmax(x):
    """jnp.argmax(x, axis=-1) as int32 (the first of equal maxima; a NaN counts as the
    largest), for f32 x [..., V]: one kernel call on CPU, where XLA's argmax reduce costs
    ~0.1 ms per row of a 49k vocabulary (a verify block has one row per tree node)."""
    if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] < 1 or x.size == 0 or not vector_width():
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    flat = x.reshape(-1, x.shape[-1])

    def kernel(f):
        return jax.ffi.ffi_call("lookahead_argmax", jax.ShapeDtypeStruct(f.shape[:1], jnp.int32))(f)

    out = jax.lax.platform_dependent(flat, cpu=kernel, default=lambda f: jnp.argmax(f, axis=-1).astype(jnp.int32))
    return out.reshape(x.shape[:-1])


def materialize(x):
    """x, computed once into a buffer: on CPU (f32) it goes through a copy kernel, which
    XLA cannot fuse into x's consumers. Without it XLA:CPU fuses a cheap-looking producer
    into each consumer and recomputes it per element: the RoPE tables' cos and sin
    [B,T,H/2] were evaluated once per element of every q and k rotation. Identity on
    other backends and dtypes, and for derivatives."""
    if x.dtype != jnp.float32 or x.size == 0 or not vector_width():
        return x
    copy = jax.ffi.ffi_call("lookahead_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return _with_plain_jvp(copy, lambda x: x)(x)


# ----------------------------------------------------------------------------- packed weights
PACK_VECTORS = (3, 2, 1)  # tile widths tried in order, in vectors of the kernel's width


def pack_widths() -> tuple:
    """Tile widths tried in order: 3, 2, 1 vectors of the kernel's width (48, 32, 16 with
    AVX-512; 24, 16, 8 with AVX2; AVX-512's where the kernel is off). The few-row kernel
    reads a tile 3, 2 or 1 vectors wide as one contiguous stream. (AVX2 with AVX-512's 48:
    two sub-tiles of 24 read every other 96 bytes of each 192-byte row, and a SmolLM2 step's
    weight reads took 1.9x as long on a 2-core AMD EPYC, bench/ceiling.py.)"""
    vw = vector_width() or 16
    return tuple(v * vw for v in PACK_VECTORS)


@jax.tree_util.register_pytree_node_class
class PackedWeight:
    """A weight w [K, ...] (N columns after its first dim) stored for the CPU kernel as
    data [N/TW, K, TW]: column tile t (columns t*TW .. t*TW+TW-1) is one contiguous block of
    K rows. The kernel then streams each tile instead of walking K rows of w a row apart,
    ~2x faster on the weight reads that bound a decode step. `shape` and `dtype` are w's;
    `unpacked()` gives w back. A pytree node (data is its only leaf), so packed params pass
    through jit like plain ones.

        p = pack(w)            # w [576, 3072] -> p.data [64, 576, 48] (AVX2: [128, 576, 24])
        matmul(x, p)           # == matmul(x, w), bitwise
    """

    def __init__(self, data, shape):
        self.data = data
        self.shape = tuple(shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return len(self.shape)

    def unpacked(self):
        return self.data.transpose(1, 0, 2).reshape(self.shape)

    def tree_flatten(self):
        return (self.data,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(children[0], shape)

    def __repr__(self):
        return f"PackedWeight(shape={self.shape}, tiles={getattr(self.data, 'shape', None)})"


def pack_width(n: int) -> Optional[int]:
    """The tile width for a weight of n columns (None: no width divides it; keep it plain)."""
    return next((tw for tw in pack_widths() if n % tw == 0), None)


def pack(w, dtype=None) -> "PackedWeight":
    """w [K, ...] -> PackedWeight (f32, columns a multiple of the vector width; `pack_width`).

    `dtype=jnp.bfloat16` stores the tiles in bf16 (w rounded to nearest even): half the
    bytes per step, with f32 arithmetic (each weight widened exactly in registers). Not
    for a model whose output must equal its f32 self; for a draft model, whose rounding
    changes only which drafts are proposed, never the verified output.
    A numpy `w` is packed on the host into 64-byte-aligned memory that the device array
    then uses as it is (`aligned_empty`): the tiles are the only new copy."""
    k = w.shape[0]
    n = int(np.prod(w.shape[1:]))
    tw = pack_width(n)
    if tw is None:
        raise ValueError(f"cannot pack a weight of {n} columns: not a multiple of {pack_widths()[-1]}")
    if dtype is not None and jnp.dtype(dtype) != w.dtype:
        if jnp.dtype(dtype) != jnp.bfloat16 or w.dtype != jnp.float32:
            raise ValueError(f"packed weights are f32, or bf16 from f32; got {w.dtype} -> {jnp.dtype(dtype)}")
    if isinstance(w, np.ndarray):  # host memory (a weight just read): tiled in one copy, no jax temporaries
        tiles = w.reshape(k, n // tw, tw).transpose(1, 0, 2)  # a view (w.T too: the split axis stays whole)
        data = aligned_empty(tiles.shape, w.dtype if dtype is None else dtype)
        np.copyto(data, tiles, casting="unsafe")  # f32 -> bf16: round to nearest even, as XLA's convert
        return PackedWeight(jax.device_put(data), w.shape)  # aligned: the device array IS `data`
    data = jnp.asarray(w).reshape(k, n // tw, tw).transpose(1, 0, 2)
    if dtype is not None and jnp.dtype(dtype) != data.dtype:
        data = data.astype(jnp.bfloat16)
    return PackedWeight(data, w.shape)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised host array whose data is 64-byte aligned: on CPU `jax.device_put`
    of such an array makes no copy (the jax.Array keeps and reads that memory; unaligned,
    it copies: twice the memory until the numpy array is dropped)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _packed_dot(x, data):
    w = data.transpose(1, 0, 2).reshape(data.shape[1], -1)
    if x.dtype == jnp.float32 and w.dtype == jnp.bfloat16:  # bf16 storage, f32 arithmetic (exact widening)
        w = w.astype(jnp.float32)
    return _dot(x, w)


_nn_packed = _with_plain_jvp(  # data [N/TW, K, TW]: N = N/TW * TW columns
    lambda x, d: _ffi("lookahead_matmul_nn_packed", x, d, d.shape[0] * d.shape[2]), _packed_dot)
_nn_packed_bf16 = _with_plain_jvp(  # the same with bf16 tiles
    lambda x, d: _ffi("lookahead_matmul_nn_packed_bf16", x, d, d.shape[0] * d.shape[2]), _packed_dot)


def matmul_nt(x, e):
    """x [M,D] @ e [V,D].T (tied embeddings as the output layer)."""
    if _usable(x, e, e.shape[1], MAX_ROWS_NT):
        return _nt(x, e)
    return _dot_nt(x, e)


def attention_applies(tokens: int, head_dim: int) -> bool:
    """Whether `attention` runs the kernel for f32 blocks of `tokens` new tokens per row and
    this head size at every window (building the kernel on first call). The kernel reads
    each row only up to its last visible slot, so where it applies a step's window can be
    the whole cache at no measurable cost (`Engine.window`). Larger blocks take it only at
    windows of MIN_PREFILL_ATTN_WINDOW or more, so they keep small windows where they can."""
    vw = vector_width() if 1 <= tokens <= MAX_ATTN_TOKENS else None
    return bool(vw) and head_dim % vw == 0


def attention(q, k, v, mask, scale: float, reference, rows=None):
    """Attention of one layer's new tokens over the cache, in one kernel call on CPU.

    q [B,T,K,G,H] f32: the queries as the qkv projection lays them out (query head
    k*G + g of token t); k, v [C,K,S,H]: the cache (new tokens already written); mask
    [B,T,W] bool, W <= S: the slots each token sees (attention reads slots < W only);
    rows [B] int32 (optional): query row b attends over cache row rows[b] (a block of a
    few rows of a C-row cache, read in place); without it C == B, row b over row b.
    Returns [B,T,K,G,H] f32 (a [B,T,N*H] reshape away from the output projection):
    softmax(scale * q k^T, masked) v, a row with nothing visible giving zeros.

    `reference(q, k, v, mask, rows)` is the same computation in jnp: what GPU/TPU lower, what
    runs where the kernel does not apply (not f32, T > MAX_ATTN_TOKENS at a window under
    MIN_PREFILL_ATTN_WINDOW, H not a multiple of the vector width, kernel off), and what
    derivatives go through.
    """
    T, H = q.shape[1], q.shape[4]
    usable = (q.dtype == k.dtype == v.dtype == jnp.float32 and mask.dtype == jnp.bool_
              and (1 <= T <= MAX_ATTN_TOKENS or T >= 1 and mask.shape[2] >= MIN_PREFILL_ATTN_WINDOW)
              and mask.shape[1] == T and mask.shape[2] <= k.shape[2])
    vw = vector_width() if usable else None
    if not vw or H % vw:
        return reference(q, k, v, mask, rows)
    if rows is None:
        def kernel(q, k, v, mask):
            return jax.ffi.ffi_call("lookahead_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                q, k, v, mask, scale=np.float32(scale))

        return _with_plain_jvp(kernel, lambda q, k, v, mask: reference(q, k, v, mask, None))(q, k, v, mask)

    def kernel_rows(q, k, v, mask, rows):
        return jax.ffi.ffi_call("lookahead_attention_rows", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, k, v, mask, rows, scale=np.float32(scale))

    return _with_plain_jvp(kernel_rows, reference)(q, k, v, mask, rows.astype(jnp.int32))


def knn_shortlist(h, keys, norms, kp: int, reference):
    """The shortlist pass of the exact KNN search (`knnlm.search.exact_search`): h [Q,D]
    f32, keys [...,D] f16/f32 (N rows), norms [...] f32 (|x|^2, +inf on padding, N of
    them) -> (md [Q,kp] f32, mi [Q,kp] int32): per query the kp entries of smallest
    matmul distance |x|^2 - 2 h.x, ranked by (distance, id), +inf / -1 past the entries
    of finite distance. On CPU one kernel call reads the keys once for all Q queries
    (XLA's scan widened every f16 chunk to f32 and ran a small-batch GEMM at ~12
    GFLOP/s); a query's shortlist does not depend on the others in the call.
    `reference(h, keys, norms)` gives the same contract in jnp (its rounding, and so its
    ties, may differ): what GPU/TPU lower and what runs where the kernel does not apply."""
    Q, D = h.shape
    usable = (h.dtype == jnp.float32 and keys.dtype in (jnp.float16, jnp.float32) and norms.dtype == jnp.float32
              and 1 <= Q <= MAX_KNN_QUERIES and keys.shape[-1] == D and norms.size * D == keys.size
              and 1 <= kp <= norms.size < 2 ** 31)
    vw = vector_width() if usable else None
    if not vw or D % vw:
        return reference(h, keys, norms)
    name = "lookahead_knn_shortlist_" + ("f16" if keys.dtype == jnp.float16 else "f32")

    def kernel(h, keys, norms):
        out = (jax.ShapeDtypeStruct((Q, kp), jnp.float32), jax.ShapeDtypeStruct((Q, kp), jnp.int32))
        return tuple(jax.ffi.ffi_call(name, out)(h, keys, norms))

    return jax.lax.platform_dependent(h, keys, norms, cpu=kernel, default=reference)
