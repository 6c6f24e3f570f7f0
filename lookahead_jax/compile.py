"""Ahead-of-time compilation with a visible, counted cache.

Every jitted step is compiled once per static shape signature (batch, bucketed tree size,
cache length) via `jit(...).lower(...).compile()`. Compilation time is therefore measured
separately from decode time, and every compilation is logged, so the number of
compilations stays small and known.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import jax

log = logging.getLogger("lookahead_jax")


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
            exe = jitted.lower(*args, **static).compile()
            dt = time.perf_counter() - t0
            self.compile_s += dt
            shapes = ", ".join(
                "x".join(map(str, x.shape)) for x in jax.tree.leaves(args[2:]) if hasattr(x, "shape")
            )
            desc = f"{name}({shapes}{''.join(f', {k}={v}' for k, v in sorted(static.items()))})"
            self.compilations.append(desc)
            log.info("compiled %s in %.1f s (compilation #%d)", desc, dt, len(self.compilations))
            self._table[key] = exe
        return exe(*args)
