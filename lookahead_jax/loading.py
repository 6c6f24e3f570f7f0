"""`load(name_or_path)`: presets, local checkpoints, GGUF files, HF directories, hub ids.

Resolution order for `name_or_path`:
1. a preset name (`presets.PRESETS`): its converted orbax checkpoint is cached under
   `cache_root()/<preset>/<dtype>/`; the first load converts the packaged GGUF (progress
   bar), later loads restore the checkpoint in seconds (processes loading a preset for the
   first time at once: one converts, the others wait on `<dtype>.lock`, then restore it);
2. a local path: a directory saved by `save_pretrained` below (orbax checkpoint + config),
   an HF directory (config.json + safetensors), or a `.gguf` file;
3. an HF hub id ("org/name"): downloaded with huggingface_hub when online (clear error when
   not), then treated as an HF directory.

Memory: on one CPU device in float32 with the CPU kernels on, the model `load` returns
holds its layer weights (and an untied lm_head) already packed for the matmul kernel
(`core.packing` decides it and packs; `models.transformer.pack_leaf`: each weight packed
on the host as it is read from the checkpoint, largest first, and handed to the device
without a copy): ONE copy of the
weights, which decode with bitwise the same logits, and a peak of about the weights plus
one weight (the Qwen 1.5B: 6.6 GiB of f32 weights). A first load converts the GGUF,
saves the checkpoint, drops the converted params and reads the checkpoint back that way. (An `Engine` over plain f32 params
keeps a packed copy beside them: two copies, ~14 GB instead of ~7 GB for the 1.5B Qwen.)
Such `model.params` hold `cpu_kernels.PackedWeight` leaves: for plain arrays (training,
comparing weights with another library) load with `keep_unpacked=True`, or take
`models.transformer.unpack_params(model.params)` (a plain copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Optional

import jax.numpy as jnp

try:
    import fcntl
except ImportError:  # Windows: no flock (see _conversion_lock)
    fcntl = None

from . import presets
from .convert import checkpoint as ckpt
from .convert import config_from_gguf, load_gguf, load_hf_dir, open_gguf
from .convert.tokenizer import Tokenizer
from .core import packing
from .models.config import ModelConfig

log = logging.getLogger("lookahead_jax")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Model:
    """A decoder: static config + params pytree (+ where it came from). `load` returns one;
    it is also how your own params reach `generate` (colab/train_and_eval.ipynb):

        model = lj.Model(config, params)   # once: a models.ModelConfig and its params pytree
        ...                                # in the eval loop of your training code:
        model.params = params              # the current params, as they are
        out = lj.generate(model, tokenizer, prompts, strategy="lookahead")

    Keep the one `Model`: its engine (`engine_for`) keeps the compiled steps and measured
    costs, and remakes its device copy of the params (`Engine.params`) whenever a leaf of
    `model.params` is another array than at the last call, so each eval decodes with the
    params it was given. `params` may hold `PackedWeight` leaves (`load`'s default on CPU,
    see the module docstring); a Model you build yourself keeps its params as you pass
    them (its Engine packs a copy beside them; `engine_for(model).keep_packed_only()` keeps
    one copy)."""

    config: ModelConfig
    params: Any
    name: str = ""
    dtype: Any = jnp.float32


def runtime_params(model):
    """The params the jitted decode functions run on (`Engine.params` of the model's
    default engine): on one CPU device in f32 with the CPU kernels on, a copy with the
    layer weights packed for the matmul kernel (`models.transformer.pack_params`: ~2x
    faster weight reads, the same values), made once per params object and kept by the
    engine (a second copy of those weights in memory; `LOOKAHEAD_JAX_CPU_KERNELS=0` turns
    kernels and packing off); otherwise `model.params` itself (GPU/TPU, bf16, params
    sharded over several devices). `model`: anything with `.config` and `.params`."""
    from .core.engine import engine_for

    return engine_for(model).params


def parse_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32 or bfloat16")
    return dtype


def save_pretrained(model: Model, tokenizer: Tokenizer, directory) -> Path:
    """Write an orbax checkpoint + config + tokenizer that `load(directory)` restores
    (packed params are stored plain: the checkpoint does not depend on the CPU kernels)."""
    from .models.transformer import unpack_params

    directory = Path(directory).absolute()
    ckpt.save_checkpoint(directory / "params", model.config, unpack_params(model.params))
    tokenizer.save(directory / "tokenizer")
    (directory / "LOOKAHEAD_JAX").write_text(f"{model.name}\n")
    return directory


def release_memory() -> None:
    """Collect garbage, then hand the C allocator's free pages back to the OS (glibc's
    `malloc_trim`; elsewhere only the collection). XLA's CPU buffers and numpy's scratch are
    malloc'd, so freed weights otherwise stay in the process's RSS: a first load, which
    converts the GGUF, then saves and reads back, peaked ~1 GiB higher without it."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _is_saved(path: Path) -> bool:
    return (path / "LOOKAHEAD_JAX").exists()


def _restore(path: Path, dtype, name: str, pack=None, mesh=None):
    """The saved model at `path`; pack (a `packing.LoadPacking`): its weights packed for
    the CPU kernels as each is read (`LoadPacking.put`), never a plain and a packed copy at
    once. mesh: each leaf restored straight into its NamedSharding on the mesh
    (`sharding.checkpoint_sharding`, the shardings `shard_params` gives): every process
    reads only the shards of its own devices, and no whole copy is made."""
    if mesh is not None:
        from .core.sharding import checkpoint_sharding

        config, params = ckpt.restore_checkpoint(path / "params", dtype=dtype,
                                                 sharding=checkpoint_sharding(mesh))
    else:
        put = pack.put if pack is not None else None
        config, params = ckpt.restore_checkpoint(path / "params", dtype=dtype, put=put)
    return Model(config, params, name, dtype), Tokenizer.load(path / "tokenizer")


def _placed(model: Model, mesh) -> Model:
    """`model` (its params read whole: a GGUF file, an HF directory) placed on `mesh` by the
    rule table (`shard_params`); as it is without a mesh."""
    if mesh is not None:
        from .core.sharding import shard_params

        model.params = shard_params(model.params, model.config, mesh)
    return model


def load(name_or_path: str = presets.DEFAULT_MODEL, dtype="float32", *, progress: bool = True,
         mesh=None, keep_unpacked: bool = False, packed_dtype=None):
    """Load (model, tokenizer). See the module docstring for what `name_or_path` may be.

    mesh: a ("data", "model") `jax.sharding.Mesh` (`sharding.make_mesh`): the params are
    placed on it by the rule table (heads / MLP columns over "model"); pass the same mesh
    to `generate` to split batch rows and the KV cache over "data". An orbax checkpoint (a
    preset's converted checkpoint, a `save_pretrained` directory) is restored straight into
    those shardings (`sharding.checkpoint_sharding`): each process reads only its own
    devices' shards (over several processes, every process calls `load` with the same
    mesh: orbax's restore ends at a barrier of all of them). A GGUF file, an HF directory
    or hub id is still read whole by every process, then placed (`sharding.shard_params`);
    a preset's first load converts its GGUF whole, saves it, then restores the checkpoint
    sharded. On a mesh nothing is packed for the CPU kernels.
    keep_unpacked: return plain arrays even where the CPU kernels would run packed weights
    (module docstring, "Memory"); generate then packs a copy at its first call (two copies
    of the weights in memory).
    packed_dtype: how packed weights are stored: None (f32, the model's exact values) or
    "bfloat16" (half the memory and bytes per step, values rounded: for a draft model,
    see `Engine.weight_dtype`). Whether and how it packs: `core.packing.on_load`."""
    if packed_dtype is not None:
        packed_dtype = parse_dtype(packed_dtype)
    if mesh is not None:
        return _load(name_or_path, dtype, progress, mesh=mesh)
    pack = packing.on_load(parse_dtype(dtype), packed_dtype, keep_unpacked)
    model, tok = _load(name_or_path, dtype, progress, pack)
    if pack is not None:
        pack.finish(model)
    return model, tok


def _load(name_or_path, dtype, progress: bool, pack=None, mesh=None):
    dtype = parse_dtype(dtype)
    if not name_or_path or not str(name_or_path).strip():
        raise ValueError("empty model name; pass a preset name, a local path or an HF hub id")
    name = str(name_or_path)
    if name in presets.PRESETS:
        return _load_preset(name, dtype, progress, pack, mesh)

    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file or a model directory")
            config, params = load_gguf(path, dtype=dtype, progress=progress)
            return _placed(Model(config, params, path.name, dtype), mesh), Tokenizer.from_gguf(path)
        if _is_saved(path):
            return _restore(path, dtype, path.name, pack, mesh)
        if (path / "config.json").exists():
            config, params = load_hf_dir(path, dtype=dtype)
            return _placed(Model(config, params, path.name, dtype), mesh), Tokenizer.from_dir(path)
        raise ValueError(
            f"{path} is neither a lookahead_jax checkpoint (save_pretrained) nor an HF model "
            "directory (config.json + *.safetensors)"
        )

    if _is_hub_id(name):
        model, tok = _load_from_hub(name, dtype)
        return _placed(model, mesh), tok
    raise ValueError(_unknown(name))


def _load_preset(name, dtype, progress: bool, pack=None, mesh=None):
    """A preset: its cached checkpoint, restored (into its shardings on `mesh`); else its
    GGUF converted and saved (and, to pack or onto a mesh, read back from the checkpoint).
    A checkpoint found saved is restored without a lock. Otherwise check, convert, save
    and rename run under `_conversion_lock`: of several processes loading a preset for the
    first time at once, one converts and the others wait, then restore its checkpoint
    (before the lock, all wrote one `<dtype>.tmp` directory, removed each other's files and
    died in orbax's save). Each save goes to a temp dir of its own, renamed onto the target
    when whole, so a reader finds no checkpoint or a complete one."""
    target = presets.cache_root() / name / jnp.dtype(dtype).name
    broken = None
    seen = _marker(target)  # before the restore: the entry it read, whoever replaces it later
    if seen is not None:
        try:
            return _restore(target, dtype, name, pack, mesh)
        except Exception as e:  # a half-written, truncated or stale cache entry: rebuild it
            reason = str(e).split(" See full TensorStore details")[0].splitlines()[0]
            log.warning("cached checkpoint at %s is unreadable (%s): rebuilding it from the GGUF",
                        target, reason)
            broken = seen
    with _conversion_lock(target) as locked:
        stale = _marker(target)
        done = stale is not None and stale != broken  # another process saved it meanwhile
        if not done:
            if locked:  # nobody else is converting: temp dirs left are from killed conversions
                for old in target.parent.glob(f"{target.name}.tmp*"):
                    shutil.rmtree(old, ignore_errors=True)
            model, tok = _convert(name, target, dtype, progress, stale)
    if done:
        log.info("%s was converted by another process while this one waited: restoring it", target)
        return _restore(target, dtype, name, pack, mesh)
    if pack is None and mesh is None:
        return model, tok
    # read back packed, leaf by leaf (never the converted and a packed copy at once), or
    # each device's shards of each leaf
    del model
    release_memory()
    return _restore(target, dtype, name, pack, mesh)


def _marker(path: Path):
    """Which saved checkpoint is at `path`: (inode, ctime) of its LOOKAHEAD_JAX file, which
    `save_pretrained` writes last (a rebuilt checkpoint has a new one); None if unsaved."""
    try:
        st = (path / "LOOKAHEAD_JAX").stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """An exclusive `flock` on `<target>.lock` for the block; yields whether one is held
    (False without fcntl, e.g. on Windows: then only the temp dirs of their own keep two
    converting processes apart). The lock file stays: removing it would let a later process
    lock a new file while another still holds the old one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield False
        return
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield True  # closing the file releases the lock


def _convert(name, target: Path, dtype, progress: bool, stale):
    """(model, tokenizer) from the preset's GGUF, also saved as `target`: written to
    `<target>.tmp.<pid>.<random>`, then renamed onto `target` (`os.replace` of a directory
    is atomic, but fails onto a non-empty one: the entry there is removed first when it is
    `stale`, the `_marker` found under the lock, or None). Without a lock another process
    may have saved it meanwhile: its checkpoint is kept and this one dropped."""
    from .fetch import gguf_path

    path = gguf_path(name)  # raises with the exact fetch command when not installed
    config, params = load_gguf(path, dtype=dtype, progress=progress)
    release_memory()  # the dequantization's scratch, before the save adds its buffers
    model = Model(config, params, name, dtype)
    tok = Tokenizer.from_gguf(path)
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        save_pretrained(model, tok, tmp)
        if _marker(target) in (None, stale):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if _marker(target) in (None, stale):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone after the rename)
    return model, tok


def _is_hub_id(name: str) -> bool:
    return "/" in name and not name.startswith((".", "/", "~"))


def _unknown(name: str) -> str:
    return (f"unknown model {name!r}: not a preset ({', '.join(presets.PRESETS)}), "
            "not an existing path, not an HF hub id (org/name)")


def vocab_size(name_or_path) -> Optional[int]:
    """The vocabulary (embedding rows, `ModelConfig.vocab_size`) of the model `load` would
    load, read without its weights in well under a second: a preset's known size, a saved
    checkpoint's or an HF directory's config, a GGUF header. None where it is not known
    cheaply (an HF hub id, a path that is not a model: `load` reports that); ValueError, as
    from `load`, for a name that is none of preset, path and hub id."""
    name = str(name_or_path)
    if name in presets.PRESETS:
        return presets.PRESETS[name].vocab_size or None
    path = Path(name).expanduser()
    if not path.exists() and not _is_hub_id(name):
        raise ValueError(_unknown(name))
    try:
        if path.is_file() and path.suffix == ".gguf":
            return config_from_gguf(open_gguf(path)).vocab_size
        if _is_saved(path):
            return ckpt.read_config(path / "params").vocab_size
        if (path / "config.json").is_file():
            return ModelConfig.from_hf(json.loads((path / "config.json").read_text())).vocab_size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def _load_from_hub(repo_id: str, dtype):
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
        )
    except Exception as e:  # offline, unknown repo, gated...
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "This machine may be offline: use a preset (python -m lookahead_jax.fetch --list) "
            "or a local directory / .gguf file instead."
        ) from None
    config, params = load_hf_dir(local, dtype=dtype)
    return Model(config, params, repo_id, dtype), Tokenizer.from_dir(local)
