"""Ahead-of-time compilation with a visible, counted cache.

Every jitted step is compiled once per static shape signature (batch, bucketed tree size,
cache length) via `jit(...).lower(...).compile()`. Compilation time is therefore measured
separately from decode time, and every compilation is logged, so the number of
compilations stays small and known.

Executable cache (`enable_executable_cache`, turned on by the CLI, which owns its
process): JAX's persistent compilation cache skips XLA's compile, but a new process still
traces and lowers every step to compute that cache's key (~0.3-0.5 s per executable on a
2-core CPU; lookahead needs one verify per tree bucket and attention window, greedy one).
This cache keys each executable by what determines it without tracing: the jitted
function (its module, name and bound static arguments: config, sampling, rule), the
arguments' tree structure, shapes, dtypes and shardings, the static keywords, the
versions of jax / jaxlib, the CPU, the environment variables that change lowering, and a
hash of this package's source; and stores the serialized executable, so a warm process
loads it without tracing.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax

log = logging.getLogger("lookahead_jax")

_EXE_DIR: Optional[Path] = None  # where serialized executables live (None: off)


def enable_executable_cache(directory) -> Optional[Path]:
    """Store compiled steps under `directory` and load them in later processes (module
    docstring); None turns it off. Returns the directory."""
    global _EXE_DIR
    _EXE_DIR = None if directory is None else Path(directory)
    if _EXE_DIR is not None:
        _EXE_DIR.mkdir(parents=True, exist_ok=True)
    return _EXE_DIR


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    """What an executable depends on beside its own key: versions, the CPU, the
    environment variables that change lowering, the kernel state, the package source."""
    import jaxlib

    from .models import cpu_kernels

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    dirs = {root, Path(cpu_kernels.__file__).resolve().parent}
    from . import convert

    dirs.add(Path(convert.__file__).resolve().parent)
    for d in sorted(dirs):
        for f in sorted(d.rglob("*")):
            if f.suffix in (".py", ".cc") and f.is_file():
                h.update(f.name.encode() + f.read_bytes())
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("LOOKAHEAD_JAX_", "XLA_", "JAX_")) and k != "LOOKAHEAD_JAX_CACHE")
    return repr((jax.__version__, jaxlib.__version__, jax.default_backend(), cpu_kernels.cpu_id(),
                 cpu_kernels.vector_width(), jax.config.jax_enable_x64,
                 jax.config.jax_default_matmul_precision, env, h.hexdigest()))


def _function_id(jitted) -> Optional[str]:
    """A process-independent name for `jitted` and the static arguments bound into it
    (None where it has none, e.g. a lambda, or a bound value without a stable repr)."""
    fn = getattr(jitted, "__wrapped__", jitted)
    args, kw = (), {}
    if isinstance(fn, functools.partial):
        fn, args, kw = fn.func, fn.args, fn.keywords
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    text = repr((name, args, sorted(kw.items())))
    if "<lambda>" in name or "<locals>" in name or " at 0x" in text:
        return None
    return text


def _disk_key(name, jitted, args, static) -> Optional[str]:
    fid = _function_id(jitted)
    if fid is None:
        return None
    leaves, treedef = jax.tree.flatten(args)
    if any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in leaves):
        return None  # a mesh step: its jit carries out_shardings the key does not see
    sig = tuple((x.shape, str(x.dtype), str(getattr(x, "sharding", None))) if hasattr(x, "shape")
                else (type(x).__name__,) for x in leaves)
    text = repr((name, fid, str(treedef), sig, sorted((k, repr(v)) for k, v in static.items()), _environment()))
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _load_executable(key: str):
    from jax.experimental.serialize_executable import deserialize_and_load

    path = _EXE_DIR / f"{key}.exe"
    if not path.is_file():
        return None
    try:
        blob, in_tree, out_tree = pickle.loads(path.read_bytes())
        return deserialize_and_load(blob, in_tree, out_tree)
    except Exception as e:  # a truncated or stale entry: compile afresh (and overwrite it)
        log.warning("executable cache entry %s unusable (%s: %s); compiling", path.name, type(e).__name__, e)
        return None


def _compile_fresh(jitted, args, static):
    """Compile without JAX's persistent cache: an executable XLA:CPU loaded from that cache
    serializes without its functions (loading it back fails: "Function ... not found")."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return jitted.lower(*args, **static).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def _store_executable(key: str, exe) -> None:
    from jax.experimental.serialize_executable import serialize

    try:
        data = pickle.dumps(serialize(exe))
        tmp = _EXE_DIR / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, _EXE_DIR / f"{key}.exe")  # atomic: a concurrent reader sees all or nothing
    except Exception as e:  # not serializable here, or the disk: the process goes on without
        log.warning("could not store an executable (%s: %s)", type(e).__name__, e)


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return (treedef, tuple(
        (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else (type(x),)
        for x in leaves
    ))


class CompiledFunctions:
    """Maps (name, argument shapes) -> compiled executable; counts compilations and time."""

    def __init__(self):
        self._table: dict[Any, Any] = {}
        self._params_sig: dict[int, tuple] = {}
        self.compile_s = 0.0
        self.compilations: list[str] = []
        self.loaded = 0  # of the compilations, those loaded from the executable cache

    def executables(self, name: str) -> list:
        """The compiled executables of step `name` ("prefill", "verify"), oldest first."""
        return [exe for key, exe in self._table.items() if key[0] == name]

    def __call__(self, name: str, jitted: Callable, *args, **static):
        """Run `jitted(*args, **static)`, compiling it first for a new signature; `static`
        are the jitted function's static keyword arguments (part of the signature)."""
        # args[0] is the params pytree (hundreds of leaves, the same object every step):
        # its signature is computed once per object, the rest of the arguments each call.
        params = args[0]
        psig = self._params_sig.get(id(params))
        if psig is None or psig[0] is not params:
            psig = self._params_sig[id(params)] = (params, _signature(params))
        key = (name, id(jitted), psig[1], _signature(args[1:]), tuple(sorted(static.items())))
        exe = self._table.get(key)
        if exe is None:
            t0 = time.perf_counter()
            disk = _disk_key(name, jitted, args, static) if _EXE_DIR is not None else None
            exe = _load_executable(disk) if disk is not None else None
            how = "loaded" if exe is not None else "compiled"
            if exe is not None:
                self.loaded += 1
            elif disk is not None:
                exe = _compile_fresh(jitted, args, static)
                _store_executable(disk, exe)
            else:
                exe = jitted.lower(*args, **static).compile()
            dt = time.perf_counter() - t0
            self.compile_s += dt
            shapes = ", ".join(
                "x".join(map(str, x.shape)) for x in jax.tree.leaves(args[2:]) if hasattr(x, "shape")
            )
            desc = f"{name}({shapes}{''.join(f', {k}={v}' for k, v in sorted(static.items()))})"
            self.compilations.append(desc)
            log.info("%s %s in %.1f s (compilation #%d)", how, desc, dt, len(self.compilations))
            self._table[key] = exe
        return exe(*args)
