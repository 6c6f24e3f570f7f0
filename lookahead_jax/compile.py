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
        (getattr(x, "shape", None), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
        for x in leaves
    ))


class CompiledFunctions:
    """Maps (name, argument shapes) -> compiled executable; counts compilations and time."""

    def __init__(self):
        self._table: dict[Any, Any] = {}
        self.compile_s = 0.0
        self.compilations: list[str] = []

    def __call__(self, name: str, jitted: Callable, *args):
        key = (name, id(jitted), _signature(args))
        exe = self._table.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = jitted.lower(*args).compile()
            dt = time.perf_counter() - t0
            self.compile_s += dt
            shapes = ", ".join(
                "x".join(map(str, x.shape)) for x in jax.tree.leaves(args[2:]) if hasattr(x, "shape")
            )
            desc = f"{name}({shapes})"
            self.compilations.append(desc)
            log.info("compiled %s in %.1f s (compilation #%d)", desc, dt, len(self.compilations))
            self._table[key] = exe
        return exe(*args)
