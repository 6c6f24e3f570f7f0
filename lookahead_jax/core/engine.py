"""The target model as the decode loop sees it: params, compiled steps, measured costs.

An `Engine` holds everything about one model that outlives a `generate` call: the params
(and their CPU-packed or mesh-sharded copy), the compiled executables (`compile.py`), the
verify costs measured per shape, the step timer, and the state drafters share across
requests (the suffix drafter's cache of earlier outputs, the n-gram tries, acceptance
statistics). Nothing is stored on the model object: `engine_for(model)` keeps one engine
per model (and mesh) in a registry, and every function that needs one takes it
explicitly.

    engine = lj.Engine(model, mesh=make_mesh(data=2, model=4))
    out = lj.generate(engine, tok, prompts)          # or generate(model, ..., mesh=mesh)

Sharding: with a mesh, params are placed by the rule table of `sharding.py` (heads / MLP
columns over "model"), batch rows and the KV cache over "data" (kv heads over "model"
where they divide), tree arrays over "data" by row; the jitted steps get these as
explicit in/out shardings, so the cache stays where it is step after step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import packing
from .compile import CompiledFunctions
from .inputs import StepInputs, StepMode, place
from .multihost import multiprocess
from ..models import KVCache, init_cache
from ..models.config import ModelConfig

log = logging.getLogger("lookahead_jax")


class Stores:
    """What outlives requests on an engine, one store per owner: the core knows no plug-in's
    cache. A plug-in defines its store type next to the code that uses it and reaches its
    one store per engine through `of` (created on first use; it lives as long as the
    engine):

        store = engine.stores.of(TrieStore)       # drafters/trie.py: TrieStore()
        store = engine.stores.get(key, factory)   # any hashable key, factory() on first use

    `peek(key)`: the store if made (else None), making nothing; `clear(key)` forgets one
    owner's store (the next `of` / `get` makes a fresh one), `clear()` all of them;
    iteration: the keys of the stores made; `len`, `in` as for a dict. The stores today:
    `drafters/suffix.py`'s `SuffixStore` (the cache of earlier outputs, acceptance
    statistics), `drafters/trie.py`'s `TrieStore` (tries, acceptance statistics),
    `strategies/specinfer.py`'s `DraftStore` (draft engines and models, warnings, the auto
    budget's measurements), `knnlm/search.py`'s `KnnlmStore` (the index in use, OS3's
    measurements), `core/prefix_cache.py`'s `PrefixCache` (prompt blocks' K/V),
    `drafters/draft_prefix.py`'s `DraftPrefixCache` (a draft model's prompt units)."""

    def __init__(self):
        self._by_key: dict = {}  # owner key -> its store

    def get(self, key, factory):
        """The store under `key`, made by `factory()` on first use."""
        store = self._by_key.get(key)
        if store is None:
            store = self._by_key[key] = factory()
        return store

    def of(self, owner: type):
        """The store of type `owner` (keyed by the type itself, made by `owner()`)."""
        return self.get(owner, owner)

    def peek(self, key, default=None):
        """The store under `key` if one was made, else `default` (nothing is made)."""
        return self._by_key.get(key, default)

    def clear(self, key=None) -> None:
        """Forget the store under `key` (None: every store); the next use makes a new one."""
        if key is None:
            self._by_key.clear()
        else:
            self._by_key.pop(key, None)

    def __iter__(self):
        return iter(list(self._by_key))

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key) -> bool:
        return key in self._by_key

    def __repr__(self) -> str:
        names = (getattr(k, "__name__", repr(k)) for k in self._by_key)
        return f"Stores({', '.join(names)})"


def _same_leaves(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Engine:
    """One model ready to decode (module docstring). `model`: anything with `.config`,
    `.params` and `.dtype` (a `loading.Model`)."""

    def __init__(self, model, mesh=None):
        self._model = model  # engine_for's engines hold a weakref instead (see there)
        self.config: ModelConfig = model.config
        self.dtype = getattr(model, "dtype", jnp.float32)
        self.name = getattr(model, "name", "")
        self.mesh = mesh
        self.compiled = CompiledFunctions()
        self.verify_costs: dict = {}  # (rule, sampling mode, B, S, T, window) -> seconds
        self.step_times: dict = {}  # (rule, B, S) -> budget.StepTimes
        self.stores = Stores()  # what outlives requests, per owning plug-in (tries, draft engines, ...)
        self._placed: Optional[tuple] = None  # (source leaves, params as the steps take them)
        self._weight_dtype = None  # storage of packed weights (None: the params' own, f32)
        self._mesh_steps: dict = {}  # jitted steps with explicit shardings (mesh only)

    @property
    def model(self):
        m = self._model() if isinstance(self._model, weakref.ref) else self._model
        if m is None:
            raise RuntimeError("this engine's model was garbage-collected; keep a reference to the model "
                               "or build Engine(model) yourself")
        return m

    @property
    def platform(self) -> str:
        """Where the steps run: "cpu", "gpu", "tpu" (the mesh's devices, else JAX's default)."""
        if self.mesh is not None:
            return self.mesh.devices.flat[0].platform
        return jax.devices()[0].platform

    def __repr__(self) -> str:
        mesh = dict(self.mesh.shape) if self.mesh is not None else None
        return f"Engine({self.name or type(self.model).__name__}, mesh={mesh})"

    # ------------------------------------------------------------------ params
    @property
    def params(self):
        """The params the jitted steps run on, remade whenever a leaf of `model.params`
        changes (never stale): on a mesh, sharded by the rule table; on one CPU device in
        f32 with the CPU kernels on, a copy with the layer weights packed for the matmul
        kernel (`models.transformer.pack_params`: ~2x faster weight reads, the same
        values; a second copy of those weights in memory; `LOOKAHEAD_JAX_CPU_KERNELS=0`
        turns kernels and packing off); otherwise `model.params` itself. A model from
        `lj.load` comes packed already (`packing.on_load`): then these ARE
        `model.params`, one copy of the weights; a Model you build with plain arrays keeps
        them and gets the packed copy beside them (`keep_packed_only` to drop them). What
        is packed, cast or unpacked, `packing.py` decides and does."""
        leaves = jax.tree.leaves(self.model.params)
        if self._placed is not None and _same_leaves(self._placed[0], leaves):
            return self._placed[1]
        out = self.model.params
        if self.mesh is not None:
            from .sharding import shard_params

            out = shard_params(packing.unpacked(out), self.config, self.mesh)
        else:
            out = packing.packed_copy(out, self._weight_dtype)
        self._placed = (leaves, out)
        return out

    @property
    def weight_dtype(self):
        """How the packed CPU weights are stored: None (f32, the model's exact values) or
        bfloat16 (half the bytes each step reads, f32 arithmetic; the weights rounded, so
        the logits change by ~1e-2: for DRAFT models, whose outputs are verified, never
        for the model whose tokens are returned). Applies where packing does (one CPU
        device, f32, kernels on); elsewhere the params run as loaded (load a draft with
        dtype="bfloat16" on GPU/TPU)."""
        return self._weight_dtype

    @weight_dtype.setter
    def weight_dtype(self, dtype):
        dtype = packing.weight_dtype(dtype)
        if dtype != self._weight_dtype:
            packing.check_weight_dtype(self.model.params, dtype)
            self._weight_dtype = dtype
            self._placed = None  # repacked at the next use

    def keep_packed_only(self, consume: bool = False) -> bool:
        """Make the packed copy (see `params`) the model's own params, so that one copy of
        the weights stays in memory instead of two (the 1.5B Qwen in f32: ~7 GB instead of
        ~14 GB). Same values; `models.transformer.unpack_params` gives the plain arrays
        back. Returns whether anything changed (nothing does where no packing applies:
        GPU/TPU, bf16, a mesh, or params packed already, as `lj.load` returns them).
        The packed copy is made beside the plain one (a moment with both) unless
        `consume`: then plain params are packed weight by weight into place
        (`pack_params(consume=True)`: the dicts of the old `model.params` are emptied of
        them; for params nobody else holds, e.g. a draft loaded by name)."""
        if consume and self.mesh is None:
            packing.pack_for_cpu(self.model, self._weight_dtype)
        placed = self.params
        if not packing.keep_only(self.model, placed, self.mesh):
            return False
        self._placed = (jax.tree.leaves(placed), placed)
        return True

    def window(self, needed: int, S: int, tokens: int) -> int:
        """The attention window of a step that forwards `tokens` new tokens per row and
        needs `needed` of the S cache slots. Where the CPU attention kernel runs the step
        (one CPU device, f32, `cpu_kernels.attention_applies`), the whole cache: the kernel
        reads each row only up to its last visible slot, so every length shares one
        compiled step (SmolLM2, 8 rows at length 100 and 400, T = 0 / 3 / 15: window 2048
        within 0.97-1.05x of 128 / 512, interleaved medians). Elsewhere attention reads
        every slot of the window: the smallest of `verify.window_for`'s few windows."""
        from ..models import cpu_kernels
        from .verify import window_for

        window = window_for(needed, S)  # (raises when the cache is too small)
        if self.mesh is None and self.platform == "cpu" and jnp.dtype(self.dtype) == jnp.float32 \
                and cpu_kernels.attention_applies(tokens, self.config.head_dim):
            return S
        return window

    # ------------------------------------------------------------------ arrays
    def init_cache(self, batch: int, max_len: int) -> KVCache:
        if self.mesh is None:
            return init_cache(self.config, batch, max_len, self.dtype)
        from .sharding import init_sharded_cache

        return init_sharded_cache(self.config, batch, max_len, self.dtype, self.mesh)

    def put(self, x):
        """A host array [B, ...] kept on device across steps (seeds, row ids): split over
        "data" on a mesh; over several processes replicated, so that the host reads them
        back (a slot's insert, a prefill's rows) without a collective."""
        if self.mesh is None:
            return jnp.asarray(x)
        from .sharding import replicate, shard_batch

        return replicate(x, self.mesh) if multiprocess() else shard_batch(x, self.mesh)

    def arg(self, x):
        """A host array [B, ...] used by one step (tokens, tree, active rows). Without a
        mesh it goes to the executable as the numpy array it is: the compiled call moves it
        in C++, where `jnp.asarray` per argument cost ~0.2 ms of Python dispatch each
        (~1 ms of a 53 ms greedy step on the 2-core CPU, six arguments)."""
        if self.mesh is None:
            return np.asarray(x)
        from .sharding import replicate, shard_batch

        return replicate(x, self.mesh) if multiprocess() else shard_batch(x, self.mesh)

    # ------------------------------------------------------------------ steps
    def _step(self, kind: str, key, make, args: tuple, static: dict):
        """(jitted step `kind` for `key`, its static keyword arguments) for the arguments
        (params, cache, inputs). Without a mesh, the shared `jax.jit` from `verify.py`. On
        a mesh, a jit with explicit shardings: params by the rule table, the cache by
        `sharding.cache_shardings` (in and out, so it stays where it is step after step),
        every leaf of the inputs and of the result with its rows over "data" (replicated
        when the rows do not divide the axis, or over several processes); the mode is bound into it (jit takes no
        keyword arguments beside explicit in_shardings). The step returns (named result,
        cache): every field of the result is [B, ...]."""
        if self.mesh is None:
            return make(), static
        from .sharding import batch_spec, cache_shardings, param_shardings

        B = int(args[2].tokens.shape[0])  # rows of the step (the cache's, or a `sel` subset's)
        ranks = tuple(np.ndim(x) for x in jax.tree.leaves(args[2]))
        jkey = (kind, key, B, int(args[1].length.shape[0]), tuple(sorted(static.items())), ranks)
        fn = self._mesh_steps.get(jkey)
        if fn is None:
            from jax.sharding import NamedSharding, PartitionSpec as P

            # over several processes inputs and results are whole on every device (the
            # cache stays split): every process reads the results without a collective
            rows = NamedSharding(self.mesh, P() if multiprocess() else batch_spec(1, B, self.mesh))
            whole = NamedSharding(self.mesh, P())  # a scalar input (a one-row block's row) on every device
            inputs = jax.tree.map(lambda x: rows if np.ndim(x) else whole, args[2])
            cache = cache_shardings(self.config, self.mesh, int(args[1].length.shape[0]))
            fn = jax.jit(functools.partial(make().__wrapped__, **static), donate_argnums=(1,),
                         in_shardings=(param_shardings(self.config, self.mesh), cache, inputs),
                         out_shardings=(rows, cache))
            self._mesh_steps[jkey] = fn
        return fn, {}

    def _dispatch(self, name: str, fn, args: tuple, static: dict, ahead: Optional[str]):
        """Run a step through the compiled-function table, or only look ahead: "check"
        (whether it is compiled: `CompiledFunctions.ready`), "load" (queue its load from the
        step cache), "compile" (queue its compilation) or "later" (queue it on the one
        thread of what steps do without meanwhile; these three `CompiledFunctions.prefetch`:
        nothing runs, returns whether it was queued now)."""
        if ahead is None:
            return self.compiled(name, fn, *args, **static)
        if ahead == "check":
            return self.compiled.ready(name, fn, *args, **static)
        if ahead not in ("load", "compile", "later"):
            raise ValueError(f"ahead must be None, 'check', 'load', 'compile' or 'later', got {ahead!r}")
        return self.compiled.prefetch(name, fn, *args, compile=ahead != "load", later=ahead == "later", **static)

    def extend(self, cache, inputs, mode, *, ahead: Optional[str] = None):
        """`verify.extend_step` through the compiled-function table (name "prefill") on the
        `inputs.StepInputs` (tokens, n_new, seed, row; optional: each row's sampling values,
        penalties, suppress, sel) with the static `inputs.StepMode` (window, emit, ban,
        logprobs, hidden, top_logprobs): returns (`verify.ExtendOut`, cache). Host arrays
        are placed as `arg` places them. ahead: only check or queue its compilation
        (`_dispatch`)."""
        from .verify import jitted_extend

        args = (self.params, cache, place(inputs, self.arg))
        fn, static = self._step("extend", None, lambda: jitted_extend(self.config), args, {"mode": mode})
        return self._dispatch("prefill", fn, args, static, ahead)

    def verify(self, cache, inputs, mode, *, rule, ahead: Optional[str] = None):
        """`verify.verify_step` on the `inputs.StepInputs` of a packed `tree.VerifyBlock`
        (`StepInputs.tree`; optional: each row's sampling values, draft_probs, penalties,
        suppress) with the static `inputs.StepMode`: returns (`verify.VerifyOut`, cache).
        rule: the acceptance rule. ahead: only check, load or queue its compilation
        (`_dispatch`)."""
        from .verify import jitted_verify_step

        args = (self.params, cache, place(inputs, self.arg))
        fn, static = self._step("verify", rule, lambda: jitted_verify_step(self.config, rule), args, {"mode": mode})
        return self._dispatch("verify", fn, args, static, ahead)

    def plain_steps(self, cache, inputs, mode, *, rule, ahead: Optional[str] = None):
        """`verify.plain_steps` (up to `mode.steps` plain decode steps in one call) on the
        inputs of a root-only block (`StepInputs.tree` with remaining [B] and stop_ids
        [B,E]): returns (`verify.StepsOut`, cache); the rest as in `verify`."""
        from .verify import jitted_plain_steps

        args = (self.params, cache, place(inputs, self.arg))
        fn, static = self._step("steps", rule, lambda: jitted_plain_steps(self.config, rule), args, {"mode": mode})
        return self._dispatch("steps", fn, args, static, ahead)

    def measure_verify_costs(self, rule, B: int, S: int, buckets, length: Optional[int] = None,
                             rounds: int = 7) -> dict:
        """Seconds per verify step for each tree bucket T (cached per shape).

        Measured at cache length `length` (default S // 2) with the attention window a
        step at that length uses, on one scratch cache of the real shape. Each bucket is
        compiled and run once, then timed in `rounds` round-robin passes over the buckets
        (median per bucket), so a slow spell of the machine hits every bucket alike rather
        than one. A bigger tree never costs less than a smaller one (running max over T):
        a noisy low reading for T = 1 would otherwise make trees look cheaper than plain
        decoding."""
        from .drafts import Draft
        from .tree import pack, with_root

        from .sampling import RowSampling, SamplingParams

        # the rule's own sampling as every row's, as data in the decode loop's one step
        # (rules compare equal whatever their values: what the values make the step compute
        # is part of the key)
        sp = getattr(rule, "sampling", None)
        sampled = isinstance(sp, SamplingParams) and not sp.greedy
        values = RowSampling.of([sp if sampled else SamplingParams()] * B, put=self.put)
        sampling = dataclasses.replace(values, filter=True)
        mode = None if not sampled else values.filter
        todo, keys = {}, {}
        for T in buckets:
            L = min(S // 2 if length is None else length, S - 1 - T)
            window = self.window(L + 1 + T, S, 1 + T)
            key = keys[T] = (rule, mode, B, S, T, window)
            if key not in self.verify_costs:
                chain = Draft([0] * T, list(range(-1, T - 1)))
                todo[key] = (T, L, window, with_root(pack([chain] * B, T), np.zeros(B, np.int32)))
        if todo:
            cache = self.init_cache(B, S)
            seeds, rows = self.put(np.zeros(B, np.uint32)), self.put(np.arange(B, dtype=np.int32))
            active = np.ones(B, bool)
            times = {key: [] for key in todo}
            for r in range(rounds + 1):  # round 0 compiles and warms up
                for key, (T, L, window, blk) in todo.items():
                    cache = cache.replace(length=self.put(np.full(B, L, np.int32)))
                    t0 = time.perf_counter()
                    res = self.verify(cache, StepInputs.tree(blk, active, seeds, rows, sampling=sampling),
                                      StepMode(window=window), rule=rule)
                    jax.block_until_ready(res)
                    if r:
                        times[key].append(time.perf_counter() - t0)
                    cache = res[-1]
            for key, (T, L, window, _) in todo.items():
                self.verify_costs[key] = float(np.median(times[key]))
                log.info("verify cost T=%d (window %d): %.2f ms", T, window, self.verify_costs[key] * 1e3)
        out, floor = {}, 0.0
        for T in sorted(buckets):
            floor = max(floor, self.verify_costs[keys[T]])
            out[T] = floor
        return out


# one engine per (model object, mesh); the model is held weakly where it allows it
_ENGINES: dict = {}


def engine_for(model, mesh=None) -> Engine:
    """The engine of `model` on `mesh` (made on first use, kept while the model lives).
    An `Engine` passed in is returned as it is (its mesh must match, if one is given)."""
    if isinstance(model, Engine):
        if mesh is not None and mesh is not model.mesh:
            raise ValueError("this Engine was built for another mesh; build Engine(model, mesh) instead")
        return model
    key = (id(model), id(mesh) if mesh is not None else None)
    hit = _ENGINES.get(key)
    if hit is not None:
        ref, engine = hit
        if (ref() if isinstance(ref, weakref.ref) else ref) is model:
            return engine
    own = getattr(model, "__dict__", {}).get(_ENGINE_ATTR)
    if own is not None and key[1] in own:
        return own[key[1]]
    engine = Engine(model, mesh)
    try:  # the registry must not keep the model alive: its engine holds it weakly too
        ref: Any = weakref.ref(model, lambda _, k=key, reg=_ENGINES: reg.pop(k, None))
        engine._model = ref
    except TypeError:
        # not weak-referenceable (e.g. a SimpleNamespace): the engine lives on the model
        # itself, so both go together (a registry entry would keep the model, its engine
        # and every executable compiled for it for the life of the process)
        try:
            vars(model).setdefault(_ENGINE_ATTR, {})[key[1]] = engine
            return engine
        except TypeError:  # no __dict__ either: kept for the life of the process
            ref = model
    _ENGINES[key] = (ref, engine)
    return engine


_ENGINE_ATTR = "_lookahead_jax_engines"  # {mesh id: Engine} on models without weakrefs
