"""Shared test helpers: tiny random HF transformers models (torch imported lazily)."""

from __future__ import annotations

import pytest

# Tiny dims chosen so every matrix row (the "in" dim) is a multiple of 32: the GGUF tests
# can store them as Q8_0. V vocab, D model dim, N/K heads, H head dim, F mlp dim.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)

HF_KINDS = ("llama", "llama3", "qwen2", "gemma3")


def pytest_addoption(parser):
    parser.addoption(
        "--large-models", action="store_true", default=False,
        help="also run the real-model tests of the Qwen2.5-Coder 1.5B preset (where it is fetched): HF "
             "transformers' f32 1.5B alone peaks at ~8.6 GiB, so they are left out of the default suite, "
             "whose peak stays within 8 GB")
    parser.addoption(
        "--prefix-cache-mb", type=float, default=0,
        help="run with generate's prefix cache on (MB) wherever a test leaves prefix_cache unset "
             "(references included): every strategy's suite once with the cache, as issue 53 asks; "
             "the tests that compare the cache with none pass it themselves")


def pytest_configure(config):
    """JAX's persistent compilation cache for the test processes, in its own folder
    (`<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/xla-tests/<host>-<cpu>`), as the CLI
    does for itself: the suite compiles thousands of small executables, many of them again
    after each module's `jax.clear_caches()` and in every later run. Off with
    LOOKAHEAD_JAX_XLA_CACHE=0 (or a JAX_COMPILATION_CACHE_DIR of your own is used)."""
    from lookahead_jax.core.compile import enable_compilation_cache

    enable_compilation_cache("xla-tests")
    mb = config.getoption("--prefix-cache-mb")
    if mb:  # generate's default, for every call of this run that does not set it
        import inspect

        from lookahead_jax.generate import generate

        names = [n for n, x in inspect.signature(generate).parameters.items() if x.default is not x.empty]
        defaults = list(generate.__defaults__)
        defaults[names.index("prefix_cache")] = int(mb * (1 << 20))
        generate.__defaults__ = tuple(defaults)


# ----------------------------------------------------------------------------- deselected
# The quick run (`python -m pytest -q`, addopts' -m 'not slow') says what it left out: a
# line before the final count, per group of slow tests. Under xdist each worker collects
# and deselects; the controller gathers their node ids (workeroutput) and prints the line.
_SLOW_DESELECTED: set = set()
_SLOW_GROUPS = (  # (test file, what its slow tests run)
    ("tests/test_readme.py", "run the README's commands"),
    ("tests/test_notebooks.py", "run the notebooks"),
    ("tests/test_real_model.py", "compare real packaged models with HF"),
    ("tests/test_clients.py", "drive the server with lm-eval and guidellm"),
    ("tests/test_install.py", "resolve command 2's install against PyPI"),
)


def pytest_deselected(items):
    """Slow tests left out where the mark expression leaves them out (the quick run's
    'not slow'), not the ones another filter (-k) dropped from a run that selects them."""
    if items and "not slow" in (items[0].config.getoption("markexpr") or ""):
        _SLOW_DESELECTED.update(i.nodeid for i in items if i.get_closest_marker("slow") is not None)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the ids to the controller
        session.config.workeroutput["slow_deselected"] = sorted(_SLOW_DESELECTED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _SLOW_DESELECTED.update(getattr(node, "workeroutput", {}).get("slow_deselected", ()))


def slow_deselected_line(nodeids) -> str:
    """'N tests deselected as slow (8 run the README's commands, ...); run them with -m slow'
    ("" for none)."""
    if not nodeids:
        return ""
    files = [n.split("::")[0] for n in nodeids]
    parts = [f"{files.count(f)} {what} ({f})" for f, what in _SLOW_GROUPS if f in files]
    rest = sum(1 for f in files if f not in dict(_SLOW_GROUPS))
    if rest:
        parts.append(f"{rest} larger grids and real-model runs elsewhere")
    return (f"{len(nodeids)} tests deselected as slow: " + ", ".join(parts)
            + "; run them with -m slow, or everything with -m 'slow or not slow' (as CI does)")


@pytest.hookimpl(trylast=True)  # after --durations: next to the final count
def pytest_terminal_summary(terminalreporter):
    line = slow_deselected_line(sorted(_SLOW_DESELECTED))
    if line:
        terminalreporter.write_sep("-", "deselected")
        terminalreporter.write_line(line)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


class _ModuleLock:
    """Between the two xdist workers: a module marked `exclusive_memory` runs while the other
    worker runs no module (it waits before its next one); one marked `heavy_memory` runs
    beside ordinary modules but never beside another heavy or exclusive one; other modules
    share. A readers-writer lock from flock'd files: `gate` (taken briefly by everyone, held
    by a waiting writer, so a reader cannot overtake it) and `room` (shared by readers,
    exclusive for a writer), and before them `heavy` (held by a heavy module throughout).
    Every module takes them in that order, so no two wait on each other. No-op outside xdist."""

    def __init__(self, exclusive: bool, heavy: bool = False):
        import os
        import tempfile

        uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        self.exclusive, self.files = exclusive, None
        if uid:
            base = os.path.join(tempfile.gettempdir(), f"lookahead-jax-tests-{uid}")
            self.files = [open(f"{base}.{n}.lock", "a") for n in ("gate", "room")]
            if heavy:
                self.files.append(open(f"{base}.heavy.lock", "a"))

    def __enter__(self):
        import fcntl

        if self.files:
            gate, room = self.files[:2]
            for f in self.files[2:]:  # heavy: one heavy module at a time, before the room
                fcntl.flock(f, fcntl.LOCK_EX)
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(room, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)
        return self

    def __exit__(self, *exc):
        if self.files:
            for f in self.files:
                f.close()  # releases the room lock


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code(request):
    """Per test module. Before: a module marked `exclusive_memory` (its peak alone is most of
    the suite's memory budget) waits until the other xdist worker is between modules, which
    then waits for it; one marked `heavy_memory` (its subprocesses hold a few GiB) waits only
    for another heavy or exclusive module (see _ModuleLock). After: drop JAX's caches of compiled executables,
    collect the module's models (whose engines hold theirs) and trim the allocator, so what
    one module loaded is not still resident under the next (the suite's peak, both workers
    together, stays <= 8 GB). A CPU executable also keeps ~6 memory mappings; the whole suite
    in one process compiles thousands, and past the kernel's vm.max_map_count (65,530 here)
    LLVM's next mmap fails and XLA's compiler crashes (a segfault in
    backend_compile_and_load, seen in a full run). Says so on stderr when a module ends with
    many mappings left."""
    import sys

    exclusive = request.node.get_closest_marker("exclusive_memory") is not None
    heavy = request.node.get_closest_marker("heavy_memory") is not None
    with _ModuleLock(exclusive, heavy):
        yield
        import jax

        from tiny import release_memory

        jax.clear_caches()
        release_memory()
    n = _memory_maps()
    if n > 30000:
        sys.__stderr__.write(f"\n[conftest] {n} memory mappings after this module (vm.max_map_count ~65k)\n")


def make_tiny_hf(kind: str, seed: int = 0, **overrides):
    """A tiny random float32 HF causal LM of `kind`, in eval mode, with eager attention.

    llama:  tied embeddings, default RoPE.
    llama3: llama3 rope_scaling (original context 64, so it changes many frequencies),
            untied head, head_dim 24 != D/N. (HF llama's attention_bias also adds an
            o_proj bias, which our model does not have: see test_convert.)
    qwen2:  q/k/v biases, untied head.
    gemma3: 3 layers [sliding, full, sliding], window 4, linear RoPE scaling on the full
            layer only, query_pre_attn_scalar 24 != H, final logit softcap.
    All weights are re-drawn (norms and biases too, which HF initialises to constants).
    """
    import torch
    import transformers as T

    torch.manual_seed(seed)
    common = dict(TINY, rms_norm_eps=1e-5, attn_implementation="eager")
    if kind == "llama":
        cfg = T.LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides})
        model = T.LlamaForCausalLM(cfg)
    elif kind == "llama3":
        cfg = T.LlamaConfig(**{
            **common, "head_dim": 24, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **overrides,
        })
        model = T.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = T.Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
        model = T.Qwen2ForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = T.Gemma3TextConfig(**{
            **common, "num_hidden_layers": 3, "num_key_value_heads": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 4, "query_pre_attn_scalar": 24, "final_logit_softcapping": 10.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            **overrides,
        })
        model = T.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    gemma = kind.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # gemma stores w (multiplier 1 + w)
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if gemma else 1.0))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:  # Linear [out,in]
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_hf():
    """The `make_tiny_hf` factory (skips the test when torch/transformers are absent)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_tiny_hf


@pytest.fixture(scope="module")
def model():
    """The tiny llama (seed 1) of the lossless / decode-core / SpecInfer tests (one per module)."""
    from tiny import tiny_model

    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def tok():
    """The byte-level tokenizer of the tiny models."""
    from tiny import ByteTokenizer

    return ByteTokenizer()
