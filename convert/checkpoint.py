"""Save / restore (config, params) with orbax-checkpoint.

Directory layout:

    <directory>/model_config.json   ModelConfig.to_dict() and the size of every params file,
                                    written after the params commit (restore checks the sizes)
    <directory>/params/             orbax StandardCheckpointer checkpoint of the pytree

Restore builds the target pytree from the config (`models.param_shapes`), so the stored
structure and shapes are checked against the config before any array is read, and each
leaf is restored straight into the requested dtype and sharding (orbax reads only the
stored chunks that the shards of each process's devices overlap, see CHUNK_BYTES; onto one
device, the leaves are read one by one, largest first, see `restore_checkpoint`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lookahead_jax.models import ModelConfig

from .keymaps import expected_leaves

SAVE_CONCURRENT_GB = 1  # leaves being written at once
SAVE_HOST_GB = 0.25  # leaves copied to the host ahead of their write
TRIM_EVERY_S = 0.5
CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
FORMAT = "lookahead-jax-checkpoint/2"  # /2: fused qkv and gate_up (models.fuse_layer)
# Each leaf is stored in chunks of at most CHUNK_BYTES (orbax's SaveArgs.chunk_byte_size:
# the largest dimension split first, e.g. the rows of embed [V,D], down [F,D] and o [NH,D],
# the F columns of gate_up), and qkv / qkv_bias one kv head per chunk (their K axis,
# CHUNK_AXES): the dimensions `core.sharding` splits over "model". A restore into shards
# (several devices or processes) then reads only the chunks its shards overlap: with one
# chunk per leaf (orbax's default below its 2 GiB OCDBT file size) every process read and
# decompressed every leaf whole (2 processes on model=8, 600 MB of f32 weights: 592 MB
# read by each; chunked, 297). 2 MiB, not less: orbax has TensorStore merge reads of chunks
# less than 1 MB apart, so smaller chunks of a shard and of its neighbour are read together
# (onto one device no slower: 0.6 s for the 600 MB, 0.8 s unchunked, on a busy 2-core CPU). Leaves under
# 2 MiB stay one chunk. The layout does not change what is stored: checkpoints saved
# before (one chunk per leaf) restore the same, only read whole.
CHUNK_BYTES = 2 << 20
CHUNK_AXES = {"qkv": (1,), "qkv_bias": (0,)}  # [D, K, C, H], [K, C, H]


def _flat(tree, prefix="") -> dict:
    """{"layers.0.q": leaf, ...} of a dict/list pytree (our params layout)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _unflat(flat: dict) -> dict:
    """Inverse of `_flat` for our params layout (top-level dict, "layers" a list of dicts)."""
    tree: dict = {}
    for path, leaf in flat.items():
        parts = path.split(".")
        if parts[0] == "layers":
            layers = tree.setdefault("layers", [])
            i = int(parts[1])
            while len(layers) <= i:
                layers.append({})
            layers[i][parts[2]] = leaf
        else:
            tree[path] = leaf
    return tree


def _check_tree(flat_shapes: dict, config: ModelConfig, what: str) -> None:
    want = expected_leaves(config, split=False)
    missing = sorted(set(want) - set(flat_shapes))
    extra = sorted(set(flat_shapes) - set(want))
    wrong = [
        f"{p}: {tuple(flat_shapes[p])} != {want[p]}"
        for p in want
        if p in flat_shapes and tuple(flat_shapes[p]) != want[p]
    ]
    if missing or extra or wrong:
        raise ValueError(
            f"{what} does not match the config (family={config.family}, "
            f"n_layers={config.n_layers}, d_model={config.d_model}): missing {missing[:6]}, "
            f"unexpected {extra[:6]}, wrong shapes {wrong[:6]}"
        )


def save_checkpoint(directory, config: ModelConfig, params, *, overwrite: bool = False) -> str:
    """Write params (orbax) and config (JSON) under `directory`; returns its absolute path."""
    directory = os.path.abspath(os.fspath(directory))
    _check_tree({p: x.shape for p, x in _flat(params).items()}, config, "params")
    pdir = os.path.join(directory, PARAMS_DIR)
    if os.path.exists(pdir) and not overwrite:
        raise ValueError(f"{pdir} already exists; pass overwrite=True to replace it")
    os.makedirs(directory, exist_ok=True)
    cfg_path = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(cfg_path):
        os.remove(cfg_path)  # a config only ever sits beside a committed params dir
    with _trimming(), _checkpointer() as ckptr:
        ckptr.save(pdir, args=ocp.args.PyTreeSave(params, save_args=_save_args(params)), force=overwrite)
    with open(cfg_path, "w") as f:
        json.dump({"format": FORMAT, "config": config.to_dict(), "files": _file_sizes(pdir)}, f, indent=1)
    return directory


def _save_args(params):
    """orbax SaveArgs of every leaf: chunks of at most CHUNK_BYTES, qkv's per kv head."""
    return _unflat({key: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES,
                                      shard_axes=CHUNK_AXES.get(key.rsplit(".", 1)[-1], ()))
                    for key in _flat(params)})


def _checkpointer():
    """orbax's synchronous Checkpointer over a PyTreeCheckpointHandler (the layout that
    StandardCheckpointer writes and reads) with bounded memory: at most SAVE_CONCURRENT_GB
    of leaves being written and SAVE_HOST_GB copied to the host ahead of their write (the
    host bound only applies to keys that are not "prioritized": none are). With orbax's
    defaults every leaf is copied to the host at once; with only save_concurrent_gb=1, the
    first save of the 1.5B Qwen (6.6 GiB of f32 weights) still peaked 2.2 GiB above them."""
    try:
        handler = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=SAVE_CONCURRENT_GB, save_device_host_concurrent_gb=SAVE_HOST_GB,
            is_prioritized_key_fn=lambda keypath: False)
    except TypeError:  # an orbax without the host bound: the write bound alone
        handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=SAVE_CONCURRENT_GB)
    return ocp.Checkpointer(handler)


@contextlib.contextmanager
def _trimming(every_s: float = TRIM_EVERY_S):
    """While the block runs, hand the C allocator's free pages back to the OS every
    `every_s` (glibc's malloc_trim, which trims every arena; a no-op elsewhere): orbax's
    and TensorStore's writer threads free each leaf's host copy and encode buffers into
    per-thread arenas that otherwise keep them, so the RSS climbed with the bytes written
    (+1.0 GiB saving the 0.5B Qwen's 2.4 GiB; trimmed +0.6, trimmed and with the host
    bound +0.47, no slower)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        yield
        return
    done = threading.Event()

    def run():
        while not done.wait(every_s):
            trim(0)

    thread = threading.Thread(target=run, name="lookahead-jax-malloc-trim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        trim(0)


def _file_sizes(pdir: str) -> dict:
    """{path relative to pdir: size in bytes} of every file orbax wrote."""
    return {os.path.relpath(os.path.join(d, n), pdir): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(pdir) for n in names}


def _check_files(directory: str) -> None:
    """ValueError naming the first params file that is missing or not the size it was saved
    with (a truncated copy, a full disk). Checked before orbax reads anything: orbax's error
    for a short file is a TensorStore spec per array plus asyncio tracebacks from its
    cancelled reads. (Checkpoints saved before the sizes were recorded are not checked.)"""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        files = json.load(f).get("files") or {}
    pdir = os.path.join(directory, PARAMS_DIR)
    for rel, size in sorted(files.items()):
        path = os.path.join(pdir, rel)
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing")
        if os.path.getsize(path) != size:
            raise ValueError(f"{path} has {os.path.getsize(path)} bytes, {size} when saved (truncated?)")


def read_config(directory) -> ModelConfig:
    """The checkpoint's config, without reading its params."""
    directory = os.fspath(directory)
    cfg_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(
            f"{directory} is not a lookahead-jax checkpoint: no {CONFIG_FILE} (it is written "
            "last, so an interrupted save_checkpoint leaves none)"
        )
    try:
        with open(cfg_path) as f:
            blob = json.load(f)
        if blob.get("format") != FORMAT:
            raise ValueError(
                f"format {blob.get('format')!r}, expected {FORMAT!r} (a checkpoint written by "
                "another lookahead-jax version: convert the original weights again with "
                "lookahead_jax.load(...) and save_pretrained)")
        return ModelConfig.from_dict(blob["config"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{cfg_path} is malformed: {type(e).__name__}: {e}") from e


def restore_checkpoint(directory, dtype=None, sharding: Any = None, *, put=None):
    """-> (config, params), restored straight into `dtype` and `sharding`.

    dtype: None keeps the stored dtype of each leaf; otherwise every leaf is cast to it.
    sharding: None (first local device), one `jax.sharding.Sharding` for every leaf, a
      pytree of Shardings with the params structure (e.g. NamedShardings from a mesh), or
      a callable `config -> either of those` for when only the checkpoint knows the
      config. Each leaf is read straight into its sharding: large models never
      materialise unsharded.
    put: with sharding None, `put(key, host_array, config) -> {key: leaf, ...}` makes the
      params leaves of each leaf read (e.g. packed for the CPU kernels); by default the
      array itself on the first local device.

    With sharding None the leaves are read one after another, largest first, each into
    64-byte-aligned host memory that `jax.device_put` then uses without a copy (on CPU):
    the peak is the params plus about one leaf (orbax's restore, kept for shardings,
    reads all leaves at once and copies each to the device: ~1 GiB more for the 6.6 GiB
    of the 1.5B Qwen).
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist")
    config = read_config(directory)
    pdir = os.path.join(directory, PARAMS_DIR)
    if not os.path.isdir(pdir):
        raise ValueError(f"{directory}: missing the {PARAMS_DIR}/ directory of the checkpoint")
    _check_files(directory)

    with ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(pdir).item_metadata
            meta = getattr(meta, "tree", meta)
        except Exception as e:
            raise ValueError(
                f"{pdir} is not a readable orbax checkpoint; the checkpoint is incomplete or "
                f"corrupt ({type(e).__name__}: {e})"
            ) from e
        if meta is None:
            raise ValueError(f"{pdir} has no orbax metadata; the checkpoint is incomplete")
        stored = _flat(meta)
        _check_tree({p: m.shape for p, m in stored.items()}, config, f"checkpoint {pdir}")

        if callable(sharding) and not isinstance(sharding, jax.sharding.Sharding):
            sharding = sharding(config)
        if sharding is None:
            put = put or (lambda key, x, config: {key: jax.device_put(x, jax.local_devices()[0])})
            flat = {}
            for key, x in _read_leaves(pdir, stored, dtype):
                flat.update(put(key, x, config))
                del x  # the host array is the device array's memory, or garbage now
            return config, _unflat({**{k: flat.pop(k) for k in stored if k in flat}, **flat})
        if put is not None:
            raise ValueError("put= applies to a restore onto one device (sharding=None)")
        if isinstance(sharding, jax.sharding.Sharding):
            shardings = {p: sharding for p in stored}
        else:
            shardings = _flat(sharding)
            if set(shardings) != set(stored) or not all(
                isinstance(s, jax.sharding.Sharding) for s in shardings.values()
            ):
                raise ValueError(
                    "sharding must be a jax.sharding.Sharding or a pytree of Shardings with "
                    f"the params structure; got leaves {sorted(shardings)[:6]}..."
                )
        target = _unflat({
            p: jax.ShapeDtypeStruct(
                tuple(m.shape), jnp.dtype(dtype) if dtype is not None else m.dtype,
                sharding=shardings[p],
            )
            for p, m in stored.items()
        })
        try:
            params = ckptr.restore(pdir, target)
        except Exception as e:
            raise ValueError(
                f"{pdir}: orbax could not restore the params; the checkpoint is incomplete "
                f"or corrupt ({type(e).__name__}: {e})"
            ) from e
    return config, params


READ_AHEAD_BYTES = 256 << 20  # host bytes read ahead of the leaf being handed over


def _read_leaves(pdir: str, stored: dict, dtype):
    """(key, numpy array) for every leaf of the orbax checkpoint in `pdir` (`stored`: its
    flat metadata), largest first, cast to `dtype` (None: as stored), in 64-byte-aligned
    memory (`cpu_kernels.aligned_empty`). Reads run ahead by up to READ_AHEAD_BYTES (at
    least one leaf), so decompressing the next leaves overlaps what the caller does with
    this one; the caller holds one leaf at a time plus the read-ahead."""
    import collections

    import tensorstore as ts

    from lookahead_jax.models.cpu_kernels import aligned_empty

    ocdbt = os.path.exists(os.path.join(pdir, "manifest.ocdbt"))
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})

    def kvstore(key):
        if ocdbt:
            return {"driver": "ocdbt", "base": f"file://{pdir}/", "path": key}
        return f"file://{pdir}/{key}/"

    def start(key):
        meta = stored[key]
        for driver in ("zarr", "zarr3"):  # orbax writes zarr v2 by default, zarr3 when asked
            try:
                t = ts.open({"driver": driver, "kvstore": kvstore(key)}, context=ctx, open=True,
                            read=True).result()
                break
            except ValueError:
                if driver == "zarr3":
                    raise
        if tuple(t.shape) != tuple(meta.shape):
            raise ValueError(f"{key}: stored shape {tuple(t.shape)}, metadata says {tuple(meta.shape)}")
        out = aligned_empty(t.shape, t.dtype.numpy_dtype)
        return key, out, ts.array(out).write(t)

    order = sorted(stored, key=lambda k: -_nbytes(stored[k]))
    pending: collections.deque = collections.deque()
    ahead = 0
    try:
        while order or pending:
            while order and (not pending or ahead + _nbytes(stored[order[0]]) <= READ_AHEAD_BYTES):
                pending.append(start(order.pop(0)))
                ahead += _nbytes(stored[pending[-1][0]])
            key, out, done = pending.popleft()
            ahead -= _nbytes(stored[key])
            done.result()
            if dtype is not None and out.dtype != jnp.dtype(dtype):
                cast = aligned_empty(out.shape, dtype)
                np.copyto(cast, out, casting="unsafe")  # as orbax: numpy's astype on the host
                out = cast
            del done
            yield key, out
            del out
    except BaseException as e:
        for _, _, done in pending:
            done.cancel()
        if not isinstance(e, Exception):  # GeneratorExit, KeyboardInterrupt
            raise
        raise ValueError(
            f"{pdir}: could not restore the params; the checkpoint is incomplete or corrupt "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from e


def _nbytes(meta) -> int:
    return int(np.prod(meta.shape)) * np.dtype(meta.dtype).itemsize
