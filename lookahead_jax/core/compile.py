"""Ahead-of-time compilation with a visible, counted cache.

Every jitted step is compiled once per static shape signature (batch, bucketed tree size,
cache length) via `jit(...).lower(...).compile()`. Compilation time is therefore measured
separately from decode time, and every compilation is logged, so the number of
compilations stays small and known.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import jax

log = logging.getLogger("lookahead_jax")


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return (treedef, tuple(
        (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else (type(x),)
        for x in leaves
    ))


def _abstract(x):
    """An array argument's shape, dtype, weak type and sharding (what lowering reads)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    return x


_BACKGROUND: dict = {}
_BACKGROUND_LOCK = threading.Lock()


def _background(later: bool = False) -> ThreadPoolExecutor:
    """The process's background compilation threads: two for loads and what is needed
    soon (a load is mostly one core's work outside the GIL, and the step waiting for one
    keeps a core); one for what steps do without meanwhile (`later`: a warm-up's programs
    past its minimum set), so that decoding keeps a core."""
    name = "later" if later else "pool"
    with _BACKGROUND_LOCK:
        if name not in _BACKGROUND:
            _BACKGROUND[name] = ThreadPoolExecutor(1 if later else 2, thread_name_prefix=f"lookahead-jax-compile-{name}",
                                                   initializer=_lowest_priority if later else None)
        return _BACKGROUND[name]


def _lowest_priority() -> None:
    """The calling thread at the lowest CPU priority where the OS schedules threads apart
    (Linux: a thread is a task with its own nice value): a compilation nobody waits for
    takes the cores decoding leaves idle."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux (priorities per process there): as it is
        pass


class CompiledFunctions:
    """Maps (name, argument shapes) -> compiled executable; counts compilations and time
    (`compile_s` of this table; `total_compile_s` of every table in the process, e.g. a
    target's and its draft model's together)."""

    total_compile_s = 0.0

    def __init__(self):
        self._table: dict[Any, Any] = {}
        self._params_sig: dict[int, tuple] = {}
        self.compile_s = 0.0
        self.compilations: list[str] = []
        self.prefetched: list[tuple] = []
        self.background_s = 0.0  # seconds of background loads and compilations (`prefetch`)
        self.last_key = None  # the table key of the last `prefetch` (for `done`)

    def executables(self, name: str) -> list:
        """The compiled executables of step `name` ("prefill", "verify"), oldest first."""
        return [exe.result() if isinstance(exe, Future) else exe for key, exe in self._table.items()
                if key[0] == name]

    def _key(self, name: str, jitted: Callable, args, static) -> tuple:
        # args[0] is the params pytree (hundreds of leaves, the same object every step):
        # its signature is computed once per object, the rest of the arguments each call.
        params = args[0]
        psig = self._params_sig.get(id(params))
        if psig is None or psig[0] is not params:
            psig = self._params_sig[id(params)] = (params, _signature(params))
        return (name, id(jitted), psig[1], _signature(args[1:]), tuple(sorted(static.items())))

    def __call__(self, name: str, jitted: Callable, *args, **static):
        """Run `jitted(*args, **static)`, compiling it first for a new signature; `static`
        are the jitted function's static keyword arguments (part of the signature). A
        signature `prefetch` is loading is waited for; only the wait counts as compile time."""
        key = self._key(name, jitted, args, static)
        exe = self._table.get(key)
        if isinstance(exe, Future) and exe.cancel():  # still queued: compiled here, now
            exe = None
        elif isinstance(exe, Future):
            t0 = time.perf_counter()
            try:
                exe = exe.result()
            except Exception as e:  # noqa: BLE001 - compiled again here, where an error shows
                log.info("background compilation of %s failed (%s); compiling it now", name, e)
                exe = None
            dt = time.perf_counter() - t0
            if dt > 1e-3:
                self.compile_s += dt
                CompiledFunctions.total_compile_s += dt
            if exe is not None:
                self._table[key] = exe
        if exe is None:
            t0 = time.perf_counter()
            exe = _compile_cached(name, jitted, args, static)
            dt = time.perf_counter() - t0
            self.compile_s += dt
            CompiledFunctions.total_compile_s += dt
            shapes = ", ".join(
                "x".join(map(str, x.shape)) for x in jax.tree.leaves(args[2:]) if hasattr(x, "shape")
            )
            desc = f"{name}({shapes}{''.join(f', {k}={v}' for k, v in sorted(static.items()))})"
            self.compilations.append(desc)
            log.info("compiled %s in %.1f s (compilation #%d)", desc, dt, len(self.compilations))
            self._table[key] = exe
        return exe(*args)

    def ready(self, name: str, jitted: Callable, *args, **static) -> bool:
        """Whether `jitted` is compiled for these arguments' shapes (a background
        compilation that finished counts; one queued or running does not): a caller that
        can do without it (a smaller tree, a wider window) takes another step meanwhile."""
        return self.done(self._key(name, jitted, args, static))

    def done(self, key, failed: bool = False) -> bool:
        """`ready` by the table's key (`last_key` of a `prefetch`): callable from any
        thread, nothing rebuilt. failed=True: a background compilation that raised counts
        as done too (its step compiles it again in place, where the error shows)."""
        exe = self._table.get(key)
        if isinstance(exe, Future):
            return exe.done() and (failed or exe.exception() is None)
        return exe is not None

    def prefetch(self, name: str, jitted: Callable, *args, compile: bool = False, later: bool = False,
                 **static) -> bool:
        """Compile `jitted` for these arguments' shapes in a background thread, without
        running it: a later `__call__` with the same signature takes the executable, waiting
        only for what is left (or compiling it itself when the load has not started). Only
        shapes, dtypes and shardings are read here, so the arrays may be donated right after.
        Only a step the step cache holds is queued: a warm process loads it in ~0.5 s of CPU,
        mostly outside the GIL, while other loads or the device run; a step never compiled
        on this machine (seconds of compilation) is left to its first call, unless `compile`
        (the slots' warm-up, a tree size a step does without meanwhile: `decode.step`);
        `later`: on the one-thread queue of what steps do without meanwhile.
        Returns whether it was queued now (`ready` tells when it is done); `prefetched`
        lists the background loads and compilations (name, seconds), apart from
        `compilations` (the calls that compiled)."""
        key = self.last_key = self._key(name, jitted, args, static)
        if key in self._table:
            return False
        shapes = jax.tree.map(_abstract, args)
        if not compile and _step_path(name, jitted, shapes, static) is None:
            return False  # not a load but a full compilation (seconds of CPU): left to the step

        compile_cached = _compile_cached

        def work():
            t0 = time.perf_counter()
            exe = compile_cached(name, jitted, shapes, static)
            dt = time.perf_counter() - t0
            self.prefetched.append((name, dt))
            self.background_s += dt
            return exe

        self._table[key] = _background(later).submit(work)
        return True

    def settle(self, cancel: bool = False) -> None:
        """Wait for this table's queued loads; cancel=True: drop those not started instead
        (running ones go on), e.g. when decoding ends, so none runs unasked."""
        for key, exe in list(self._table.items()):
            if isinstance(exe, Future):
                if cancel:
                    if exe.cancel():
                        del self._table[key]
                    continue
                try:
                    self._table[key] = exe.result()
                except Exception:  # noqa: BLE001 - the step's call compiles it, where an error shows
                    del self._table[key]


def enable_compilation_cache(subdir: str = "xla") -> Optional[str]:
    """Persist compiled steps across CLI runs (decode steps compile per tree bucket and
    attention window, and `auto` calibrates every bucket: ~20-30 s on a 2-core CPU).

    The CLI owns its process, so it turns on JAX's persistent compilation cache under
    `<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/xla/<host>-<arch>-<cpu hash>`, one
    folder per machine and CPU (entries are native code for this CPU), unless the user configured a cache already
    (JAX_COMPILATION_CACHE_DIR) or set LOOKAHEAD_JAX_XLA_CACHE=0. The library itself never
    changes JAX's global configuration. Returns the directory used, or None. (The test
    suite uses it too, with `subdir="xla-tests"`.) With it goes the step cache
    (`enable_step_cache`, in `<subdir>-steps/`; off with LOOKAHEAD_JAX_STEP_CACHE=0), which
    skips the tracing a warm process would still do."""
    import platform

    from ..models.cpu_kernels import cpu_id
    from ..presets import cache_root

    if os.environ.get("LOOKAHEAD_JAX_XLA_CACHE", "1") == "0":
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir or os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = cache_root() / subdir / f"{platform.node() or 'host'}-{platform.machine()}-{cpu_id()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("no compilation cache (%s): compiling from scratch", e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if os.environ.get("LOOKAHEAD_JAX_STEP_CACHE", "1") != "0":
        enable_step_cache(cache_root() / f"{subdir}-steps" / path.name)
    return str(path)


# ----------------------------------------------------------------------------- step cache
# JAX's persistent compilation cache is keyed by the lowered module, so a warm process still
# traces and lowers every step before it can look its executable up: measured on a 2-core
# CPU, SmolLM2, 28 lookahead steps (prefill buckets, tree sizes x windows): 38 s tracing +
# 18 s lowering + 15 s loading executables. The step cache stores each step's lowered
# program (`jax.export`, serialized StableHLO) under a key of our own: the step's function
# and bound options, the arguments' structure / shapes / dtypes, the static options, this
# package's source, the jax version, backend, CPU, kernel state and flags. A warm process
# then deserializes the program, lowers a one-call wrapper (~0.15 s) and compiles it (a hit
# in JAX's cache): the 28 steps above in 23 s instead of 74 s. Single-device steps whose
# bound options describe themselves (no closures, no reprs with addresses); anything else,
# and any entry that fails to load, is traced as before (a log line says why).
_STEP_CACHE: dict = {"dir": None, "source": None}


def enable_step_cache(directory) -> None:
    """Keep compiled steps' programs under `directory` (None: off). Process-wide; the CLI,
    the server and the test suite turn it on with `enable_compilation_cache`."""
    _STEP_CACHE["dir"] = None if directory is None else str(directory)


def step_cache_dir() -> Optional[str]:
    return _STEP_CACHE["dir"]


def _source_hash() -> str:
    """sha256 over this package's Python sources (lookahead_jax with its models and convert)."""
    if _STEP_CACHE["source"] is None:
        import hashlib
        from pathlib import Path

        from .. import convert, models

        h = hashlib.sha256()
        for root in (Path(__file__).resolve().parents[1], Path(models.__file__).resolve().parent,
                     Path(convert.__file__).resolve().parent):
            for f in sorted(root.rglob("*.py")):
                h.update(f"{root.name}/{f.relative_to(root)}".encode())
                h.update(f.read_bytes())
        _STEP_CACHE["source"] = h.hexdigest()
    return _STEP_CACHE["source"]


def _describe(obj) -> Optional[str]:
    """A description of a step's function or bound option that names everything it
    computes with, or None (a closure, a lambda, a repr with an address): not cached."""
    if isinstance(obj, functools.partial):
        parts = [_describe(obj.func)] + [_describe(a) for a in obj.args]
        parts += [None if (d := _describe(v)) is None else f"{k}={d}" for k, v in sorted(obj.keywords.items())]
        return None if None in parts else f"partial({', '.join(parts)})"
    if callable(obj) and not isinstance(obj, type) and hasattr(obj, "__qualname__"):
        return None if "<" in obj.__qualname__ else f"{obj.__module__}.{obj.__qualname__}"
    text = repr(obj)
    return None if " at 0x" in text or "<" in text else text


_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")


def _step_key(name, jitted, args, static) -> Optional[str]:
    """The step cache's key for `jitted(*args, **static)`, or None where it is not cached."""
    import hashlib
    import platform

    import jaxlib

    from ..models import cpu_kernels

    info, fun = getattr(jitted, "_jit_info", None), getattr(jitted, "__wrapped__", None)
    if info is None or fun is None or info.user_specified_in_shardings or info.static_argnums:
        return None
    leaves, treedef = jax.tree.flatten(args)
    devices = set()
    for x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return None
        if getattr(x, "sharding", None) is not None:  # an array, or its `_abstract` shape
            devices |= set(x.sharding.device_set)
    what, st = _describe(fun), _describe(tuple(sorted(static.items())))
    if what is None or st is None or len(devices) > 1:
        return None
    dev = next(iter(devices)) if devices else jax.devices()[0]
    parts = [
        name, what, st, str(treedef), str(info.donate_argnums), str(info.static_argnames),
        ";".join(f"{tuple(x.shape)}{x.dtype}{bool(getattr(x, 'weak_type', False))}" for x in leaves),
        jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind, platform.machine(),
        cpu_kernels.cpu_id(), str(cpu_kernels.vector_width()), os.environ.get("XLA_FLAGS", ""),
        ";".join(str(getattr(jax.config, f, None)) for f in _TRACE_FLAGS), _source_hash(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class _FlatExecutable:
    """A step compiled from its stored program: called with the step's arguments (pytrees),
    returns its outputs (pytrees), as `jit(...).lower(...).compile()`'s executable does;
    other attributes (cost_analysis, as_text, ...) are the compiled wrapper's."""

    def __init__(self, compiled, out_tree):
        self._compiled, self._out_tree = compiled, out_tree

    def __call__(self, *args):
        return jax.tree.unflatten(self._out_tree, self._compiled(*jax.tree.leaves(args)))

    def __getattr__(self, item):
        return getattr(self._compiled, item)


def _compile_exported(exp, out_tree, leaves, donate, fun_name: str) -> _FlatExecutable:
    """Compile a stored program for these argument leaves (donating the `donate` ones); the
    wrapper carries the step function's name, so JAX's logs name it as without the cache
    (e.g. "Persistent compilation cache hit for 'jit_verify_step'")."""
    def call(*xs):
        return exp.call(*xs)

    call.__name__ = call.__qualname__ = fun_name
    return _FlatExecutable(jax.jit(call, donate_argnums=donate).lower(*leaves).compile(), out_tree)


def _fun_name(jitted, default: str) -> str:
    f = getattr(jitted, "__wrapped__", None)
    while isinstance(f, functools.partial):
        f = f.func
    name = getattr(f, "__name__", default)
    return name if name.isidentifier() else default


def _step_path(name, jitted, args, static):
    """The step cache's file for this step when it holds one, else None."""
    from pathlib import Path

    root = _STEP_CACHE["dir"]
    key = _step_key(name, jitted, args, static) if root else None
    path = key and Path(root) / f"{name}-{key[:40]}.step"
    return path if path and path.exists() else None


def _compile_cached(name, jitted, args, static):
    """`jitted.lower(*args, **static).compile()`, through the step cache when it is on."""
    import pickle
    from pathlib import Path

    root = _STEP_CACHE["dir"]
    key = _step_key(name, jitted, args, static) if root else None
    if key is None:
        return jitted.lower(*args, **static).compile()
    path = Path(root) / f"{name}-{key[:40]}.step"
    leaves, in_tree = jax.tree.flatten(args)
    donated = set(jitted._jit_info.donate_argnums)
    arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    donate = tuple(j for j, i in enumerate(arg_of_leaf) if i in donated)
    if path.exists():
        try:
            entry = pickle.loads(path.read_bytes())
            if entry.get("key") != key:
                raise ValueError("key differs")
            return _compile_exported(jax.export.deserialize(entry["exported"]), entry["out_tree"], leaves, donate,
                                     _fun_name(jitted, name))
        except Exception as e:  # noqa: BLE001 - a damaged entry is traced again and rewritten
            log.info("step cache: entry %s unreadable (%s: %s); tracing the step", path.name,
                     type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    out_tree = []

    def flat(*xs):
        out, tree = jax.tree.flatten(jitted(*jax.tree.unflatten(in_tree, xs), **static))
        out_tree.append(tree)
        return out

    from ..models import cpu_kernels

    try:
        checks = [jax.export.DisabledSafetyCheck.custom_call(k) for k in cpu_kernels.KERNELS]
        exp = jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
        blob = bytes(exp.serialize())
    except Exception as e:  # noqa: BLE001 - e.g. a primitive export does not take
        log.info("step cache: %s not stored (%s: %s)", name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return jitted.lower(*args, **static).compile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps({"key": key, "exported": blob, "out_tree": out_tree[0]}))
        tmp.replace(path)
    except OSError as e:
        log.info("step cache: could not write %s (%s)", path, e)
    return _compile_exported(exp, out_tree[0], leaves, donate, _fun_name(jitted, name))
