"""The skinny-matmul CPU kernels (`models/cpu_kernels`): same products as a float64
reference, rows independent of how many share the call, derivatives, the fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.models import cpu_kernels as ck

# The kernels are lowered for CPU only (GPU/TPU lower plain dots): on another default
# backend `jax.jit(...).lower()` never shows them, so these tests are for CPU backends.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason=f"CPU kernel tests; JAX's default backend is {jax.default_backend()}")

WIDTH = ck.vector_width()
needs_kernel = pytest.mark.skipif(not WIDTH, reason="CPU kernel not built on this machine (no compiler or not x86)")


def _ref(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _lowered_has_kernel(f, *args) -> bool:
    return "lookahead_matmul" in jax.jit(f).lower(*args).as_text()


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 8, 9, 15, 16])
@pytest.mark.parametrize("K,N", [(64, 48), (576, 960), (100, 16 * 11), (1536, 576)])
def test_matmul_matches_reference(M, K, N):
    k1, k2 = jax.random.split(jax.random.PRNGKey(M * 1000 + N))
    x = jax.random.normal(k1, (M, K))
    w = jax.random.normal(k2, (K, N))
    assert _lowered_has_kernel(ck.matmul, x, w)
    y = np.asarray(jax.jit(ck.matmul)(x, w))
    np.testing.assert_allclose(y, _ref(x, w), rtol=0, atol=2e-5 * np.sqrt(K) * 4)


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("V,D", [(49, 64), (1000, 576), (48, 16)])
def test_matmul_nt_matches_reference(M, V, D):
    k1, k2 = jax.random.split(jax.random.PRNGKey(V + M))
    x = jax.random.normal(k1, (M, D))
    e = jax.random.normal(k2, (V, D))
    assert _lowered_has_kernel(ck.matmul_nt, x, e)
    y = np.asarray(jax.jit(ck.matmul_nt)(x, e))
    np.testing.assert_allclose(y, _ref(x, e.T), rtol=0, atol=2e-5 * np.sqrt(D) * 4)


@needs_kernel
def test_a_row_does_not_depend_on_the_other_rows():
    """Greedy (1 row) and a verify block (many rows) get bitwise the same row."""
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 576))
    w = jax.random.normal(jax.random.PRNGKey(1), (576, 960))
    e = jax.random.normal(jax.random.PRNGKey(2), (1003, 576))
    full = np.asarray(jax.jit(ck.matmul)(x, w))
    for lo, hi in [(0, 1), (5, 6), (3, 7), (8, 16), (9, 11)]:
        assert np.array_equal(np.asarray(jax.jit(ck.matmul)(x[lo:hi], w)), full[lo:hi])
    full = np.asarray(jax.jit(ck.matmul_nt)(x, e))  # blocks of 4 rows of e, V % 4 = 3
    for lo, hi in [(0, 1), (1, 2), (0, 2), (5, 6), (3, 7), (8, 16), (9, 12)]:
        assert np.array_equal(np.asarray(jax.jit(ck.matmul_nt)(x[lo:hi], e)), full[lo:hi])


def test_products_the_kernel_does_not_take_use_plain_dot():
    x = jnp.ones((2, 64))
    assert not _lowered_has_kernel(ck.matmul, x.astype(jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16))
    assert not _lowered_has_kernel(ck.matmul, jnp.ones((ck.MAX_ROWS + 1, 64)), jnp.ones((64, 32)))
    assert not _lowered_has_kernel(ck.matmul, x, jnp.ones((64, 17)))  # N not a vector multiple
    assert not _lowered_has_kernel(ck.matmul_nt, jnp.ones((ck.MAX_ROWS_NT + 1, 64)), jnp.ones((10, 64)))
    assert not _lowered_has_kernel(ck.matmul_nt, jnp.ones((2, 20)), jnp.ones((10, 20)))  # D not a multiple of 8 or 16
    y = jax.jit(ck.matmul)(x, jnp.ones((64, 17)))
    np.testing.assert_allclose(np.asarray(y), np.full((2, 17), 64.0))


def test_derivatives_are_those_of_the_product():
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 64))
    w = jax.random.normal(jax.random.PRNGKey(4), (64, 32))
    e = jax.random.normal(jax.random.PRNGKey(5), (20, 64))

    def loss(x, w, e):
        return jnp.sum(jnp.tanh(ck.matmul(x, w))) + jnp.sum(jnp.sin(ck.matmul_nt(x[:2], e)))

    def ref(x, w, e):
        return jnp.sum(jnp.tanh(x @ w)) + jnp.sum(jnp.sin(x[:2] @ e.T))

    for a, b in zip(jax.grad(loss, argnums=(0, 1, 2))(x, w, e), jax.grad(ref, argnums=(0, 1, 2))(x, w, e)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_switched_off_by_environment(tmp_path):
    code = ("from lookahead_jax.models import cpu_kernels as ck; import jax.numpy as jnp, jax;"
            "x = jnp.ones((2, 64)); w = jnp.ones((64, 32));"
            "assert ck.vector_width() is None;"
            "assert 'lookahead_matmul' not in jax.jit(ck.matmul).lower(x, w).as_text();"
            "assert float(jax.jit(ck.matmul)(x, w)[0, 0]) == 64.0; print('ok')")
    env = dict(os.environ, LOOKAHEAD_JAX_CPU_KERNELS="0", LOOKAHEAD_JAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_failing_build_falls_back_to_dot(tmp_path):
    """No usable compiler: the kernel is off (one log line) and products still come out."""
    code = ("from lookahead_jax.models import cpu_kernels as ck; import jax.numpy as jnp, jax;"
            "assert ck.vector_width() is None, ck._state;"
            "assert 'compil' in ck._state['error'] or 'compiler' in ck._state['error'], ck._state;"
            "assert float(jax.jit(ck.matmul)(jnp.ones((2, 64)), jnp.ones((64, 32)))[1, 3]) == 64.0; print('ok')")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), LOOKAHEAD_JAX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    # not silently slower: one warning line naming the cause and the way out
    warnings = [ln for ln in out.stderr.splitlines() if "CPU kernels off" in ln]
    assert len(warnings) == 1 and "no C++ compiler found" in warnings[0], out.stderr[-2000:]
    assert "LOOKAHEAD_JAX_CPU_KERNELS=0" in warnings[0]


def test_kernel_cache_is_the_package_cache(monkeypatch, tmp_path):
    """models/ reads LOOKAHEAD_JAX_CACHE itself (it imports nothing from the package above
    it): the kernels' cache folder is `lookahead_jax.presets.cache_root`'s, set or not."""
    from lookahead_jax.presets import cache_root

    for value in (str(tmp_path / "x"), "~/y", None):
        if value is None:
            monkeypatch.delenv("LOOKAHEAD_JAX_CACHE", raising=False)
        else:
            monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", value)
        assert ck.cache_root() == cache_root(), value
    assert ck.cache_root() == Path.home() / ".cache" / "lookahead_jax"


@needs_kernel
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_cached_kernel_is_rebuilt(tmp_path, damage):
    """A cached library cut short (a full disk, an interrupted copy: dlopen of it can die
    of SIGBUS) or overwritten is found, deleted and rebuilt: the kernels are on, quietly."""
    from lookahead_jax.presets import cache_root

    built = ck._build()
    cached = tmp_path / built.relative_to(cache_root())
    cached.parent.mkdir(parents=True)
    data = built.read_bytes()
    cached.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"not a library\n" * 100)
    code = ("from lookahead_jax.models import cpu_kernels as ck; import jax, jax.numpy as jnp;"
            "print(ck.vector_width());"
            "print('lookahead_matmul' in jax.jit(ck.matmul).lower(jnp.ones((2, 64)), jnp.ones((64, 32))).as_text())")
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(tmp_path))
    env.pop("LOOKAHEAD_JAX_CPU_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(WIDTH), "True"] and "warning" not in out.stderr, out.stderr[-2000:]
    ck._check_elf(cached)  # a whole library again


@needs_kernel
def test_kernel_is_cached_per_source_and_cpu(tmp_path):
    """A second process finds the built library instead of compiling again."""
    code = ("import time; from lookahead_jax.models import cpu_kernels as ck;"
            "t = time.perf_counter(); w = ck.vector_width(); print(w, ck._build())")
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    libs = list((tmp_path / "kernels").glob("*/libcpu_kernels.so"))
    assert len(libs) == 1 and runs[0].stdout == runs[1].stdout


# ----------------------------------------------------------------------------- argmax
def _argmax_cases():
    rng = np.random.default_rng(7)
    x = np.zeros((8, 40), np.float32)
    x[0, 5] = x[0, 9] = 1.0  # a tie: the first
    x[1, 3], x[1, 7] = np.nan, 5.0  # a NaN counts as the largest
    x[2, 30] = x[2, 33] = np.inf
    x[3] = -np.inf
    x[4, 39], x[4, 2] = np.nan, 3.0  # NaN in the tail after the vector part
    x[5, 38] = 2.0  # the max in the tail
    x[6] = rng.standard_normal(40)
    x[7, 17] = -0.0  # -0.0 == 0.0: the first zero wins
    return [x, rng.standard_normal((3, 49152)).astype(np.float32), rng.standard_normal((2, 3, 259)).astype(np.float32),
            np.ones((4, 1), np.float32)]


@needs_kernel
def test_argmax_is_jnp_argmax():
    for x in _argmax_cases():
        assert "lookahead_argmax" in jax.jit(ck.argmax).lower(x).as_text()
        got = np.asarray(jax.jit(ck.argmax)(x))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert "lookahead_argmax" not in jax.jit(ck.argmax).lower(jnp.ones((2, 8), jnp.bfloat16)).as_text()


@needs_kernel
def test_materialize_is_a_copy_that_keeps_its_producer_out_of_consumers():
    """materialize(x) == x bitwise, through a custom call on CPU (a fusion boundary), the
    identity for derivatives and for dtypes it does not take."""
    pos = jnp.arange(16, dtype=jnp.float32)[:, None] * jnp.linspace(0.1, 1.0, 32)[None, :]

    def rot(q, pos):
        c = ck.materialize(jnp.cos(pos))
        return q * c[None] + 1.0

    q = jnp.asarray(np.random.default_rng(0).standard_normal((3, 16, 32)), jnp.float32)
    hlo = jax.jit(rot).lower(q, pos).compile().as_text()
    assert "lookahead_copy" in hlo
    x = jax.jit(jnp.cos)(pos)
    assert np.array_equal(np.asarray(jax.jit(ck.materialize)(x)), np.asarray(x))
    assert np.array_equal(np.asarray(jax.jit(lambda p: ck.materialize(jnp.cos(p)))(pos)), np.asarray(x))
    np.testing.assert_allclose(np.asarray(jax.jit(rot)(q, pos)), np.asarray(q * x[None] + 1.0), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda p: jnp.sum(jnp.sin(ck.materialize(p * 2.0))))(pos)
    np.testing.assert_allclose(np.asarray(g), np.asarray(2.0 * jnp.cos(pos * 2.0)), rtol=1e-6)
    assert ck.materialize(jnp.ones(4, jnp.bfloat16)).dtype == jnp.bfloat16
    assert "lookahead_copy" not in jax.jit(ck.materialize).lower(jnp.ones(4, jnp.bfloat16)).as_text()


# ----------------------------------------------------------------------------- packed weights
# tiles of 3, 2, 1 vectors of the kernel's width: AVX-512 (16 lanes) / AVX2 (8 lanes)
@pytest.mark.parametrize("K,N,tiles16,tiles8", [(576, 960, (20, 576, 48), (40, 576, 24)),
                                                (64, 64, (2, 64, 32), (4, 64, 16)),
                                                (40, 16 * 5, (5, 40, 16), (5, 40, 16)),
                                                (8, 4 * 2 * 24, (4, 8, 48), (8, 8, 24))])
def test_pack_layout_and_roundtrip(K, N, tiles16, tiles8):
    """Tile t holds columns t*TW .. t*TW+TW-1, its rows contiguous, TW the widest of 3, 2, 1
    vectors that divides N; unpacked() gives w back."""
    tiles = tiles8 if ck.vector_width() == 8 else tiles16
    w = jax.random.normal(jax.random.PRNGKey(N), (K, N))
    p = ck.pack(w)
    assert p.data.shape == tiles and p.shape == (K, N) and p.dtype == jnp.float32
    tw = tiles[2]
    np.testing.assert_array_equal(np.asarray(p.data[1, 3]), np.asarray(w[3, tw:2 * tw]))
    np.testing.assert_array_equal(np.asarray(p.unpacked()), np.asarray(w))
    w3 = w.reshape(K, 2, N // 2)  # a fused weight keeps its shape
    assert ck.pack(w3).shape == (K, 2, N // 2)
    np.testing.assert_array_equal(np.asarray(ck.pack(w3).unpacked()), np.asarray(w3))
    with pytest.raises(ValueError, match=f"multiple of {ck.vector_width() or 16}$"):
        ck.pack(jnp.ones((4, 36)))


def test_host_pack_is_the_device_pack_bitwise_without_a_copy():
    """pack() of a numpy weight (`load` packs each weight as it is read) gives the bits of
    pack() of the jax array: f32 tiles, bf16 tiles rounded as XLA rounds (ties to even,
    subnormals, inf, nan), a transposed view (a tied head, e.T); and its device array uses
    the aligned host buffer it was tiled into (no second copy)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 3 * 48)).astype(np.float32)
    bits = w.view(np.uint32)
    bits[0, :6] = [0x3F808000, 0x3F818000, 0x3F80C000, 0x00000001, 0x7F800000, 0x7FC00001]  # ties, subnormal, inf, nan
    w[1, :3] = [1e-40, -0.0, 3.4e38]
    for src, dtype in [(w, None), (w, jnp.bfloat16), (w.T.copy().T, None), (np.ascontiguousarray(w[:, :64].T).T, jnp.bfloat16),
                       (w.reshape(96, 2, 72), jnp.bfloat16)]:
        host, dev = ck.pack(src, dtype), ck.pack(jnp.asarray(np.ascontiguousarray(src)), dtype)
        assert host.shape == dev.shape and host.data.shape == dev.data.shape and host.dtype == dev.dtype
        view = np.uint16 if host.dtype == jnp.bfloat16 else np.uint32
        assert np.array_equal(np.asarray(host.data).view(view), np.asarray(dev.data).view(view))
    a = ck.aligned_empty((1000, 48), np.float32)
    assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous
    if jax.devices()[0].platform == "cpu":
        a[...] = 1.0
        assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data  # the memory is shared, not copied


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 960), (64, 64), (100, 16 * 11), (1536, 576)])
def test_packed_matmul_is_the_row_major_kernel_bitwise(K, N):
    """Packing changes where weights sit, not the arithmetic: the same bits for M <= 16;
    above (the row-major kernel stops; the packed one switches to its cache-blocked
    product) the product against the reference, and every row bitwise what that row
    alone gives (M = 1): a prefill block and a decode step agree on a token's bits."""
    w = jax.random.normal(jax.random.PRNGKey(N), (K, N))
    p = ck.pack(w)
    mm = jax.jit(ck.matmul)
    for M in (1, 2, 3, 8, 9, 16, 17, 19, 20, 21, 23, 64, 130):  # above 16: every remainder of 6-row blocks
        x = jax.random.normal(jax.random.PRNGKey(M), (M, K))
        assert "lookahead_matmul_nn_packed" in mm.lower(x, p).as_text()
        y = np.asarray(mm(x, p))
        if M <= ck.MAX_ROWS:
            assert np.array_equal(y, np.asarray(mm(x, w)))
        np.testing.assert_allclose(y, _ref(x, w), rtol=0, atol=2e-5 * np.sqrt(K) * 4)
        for r in {0, M // 2, M - 1}:
            assert np.array_equal(y[r:r + 1], np.asarray(mm(x[r:r + 1], p))), (M, r)


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 960), (64, 64), (1536, 576)])
def test_bf16_packed_weights_are_the_f32_kernel_on_the_rounded_weights(K, N):
    """pack(w, bfloat16) stores w rounded to bf16 and computes in f32: bitwise the f32
    kernel on those rounded weights (each widened exactly), any M; the plain fallback
    (no kernel) computes the same product within f32 rounding."""
    w = jax.random.normal(jax.random.PRNGKey(N), (K, N))
    wr = w.astype(jnp.bfloat16).astype(jnp.float32)
    pb, pr = ck.pack(w, jnp.bfloat16), ck.pack(wr)
    assert pb.data.dtype == jnp.bfloat16 and pb.shape == (K, N)
    assert np.array_equal(np.asarray(pb.unpacked(), np.float32), np.asarray(wr))
    for M in (1, 2, 3, 8, 9, 17, 20, 64):
        x = jax.random.normal(jax.random.PRNGKey(M), (M, K))
        assert "lookahead_matmul_nn_packed_bf16" in jax.jit(ck.matmul).lower(x, pb).as_text()
        y = np.asarray(jax.jit(ck.matmul)(x, pb))
        assert np.array_equal(y, np.asarray(jax.jit(ck.matmul)(x, pr)))
        assert np.array_equal(y[-1:], np.asarray(jax.jit(ck.matmul)(x[-1:], pb)))  # row alone
        plain = np.asarray(jax.jit(ck._packed_dot)(x, pb.data))
        assert plain.dtype == np.float32
        np.testing.assert_allclose(y, plain, rtol=0, atol=2e-5 * np.sqrt(K) * 4)
        assert not np.array_equal(y, np.asarray(jax.jit(ck.matmul)(x, ck.pack(w))))  # rounding is real
    with pytest.raises(ValueError, match="bf16 from f32"):
        ck.pack(w.astype(jnp.bfloat16), jnp.float16)


def test_packed_weight_fallbacks_and_derivatives():
    """bf16 activations, or no kernel: plain dot on the unpacked weight; derivatives are
    those of x @ w, through jit (PackedWeight is a pytree node)."""
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 64))
    w = jax.random.normal(jax.random.PRNGKey(4), (64, 32))
    p = ck.pack(w)
    yb = jax.jit(ck.matmul)(x.astype(jnp.bfloat16), p)
    np.testing.assert_allclose(np.asarray(yb, np.float32), _ref(x, w), rtol=0.05, atol=0.3)
    g = jax.jit(jax.grad(lambda x, p: jnp.sum(jnp.tanh(ck.matmul(x, p))), argnums=(0, 1)))(x, p)
    gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(gx), rtol=1e-4, atol=1e-4)
    assert isinstance(g[1], ck.PackedWeight)
    np.testing.assert_allclose(np.asarray(g[1].unpacked()), np.asarray(gw), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- attention
def _attention_case(seed, B=1, K=3, G=3, T=4, S=256, W=128, H=64, p_visible=0.7):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.float32)
    mask = jnp.asarray(rng.random((B, T, W)) < p_visible)
    return q, k, v, mask


def _reference(scale):
    import functools

    from lookahead_jax.models.transformer import grouped_attention

    return functools.partial(grouped_attention, scale=scale)


def _attention(q, k, v, mask, scale=0.125):
    return ck.attention(q, k, v, mask, scale, _reference(scale))


@needs_kernel
@pytest.mark.parametrize("B,K,G,T,S,W,H", [(1, 3, 3, 1, 512, 256, 64), (2, 3, 3, 8, 512, 512, 64),
                                           (1, 1, 4, 16, 64, 40, 16), (2, 2, 2, 5, 300, 300, 32),
                                           (1, 2, 1, 3, 128, 128, 256)])
def test_attention_matches_the_jnp_definition(B, K, G, T, S, W, H):
    q, k, v, mask = _attention_case(B * 100 + T, B, K, G, T, S, W, H)
    f = jax.jit(_attention)
    assert "lookahead_attention" in f.lower(q, k, v, mask).as_text()
    np.testing.assert_allclose(np.asarray(f(q, k, v, mask)), np.asarray(jax.jit(_reference(0.125))(q, k, v, mask)),
                               rtol=0, atol=2e-6)


@needs_kernel
def test_attention_rows_do_not_depend_on_the_block_or_the_window():
    """A token's output is bitwise the same alone (greedy) or among other tokens (a verify
    block), and in a window padded with masked slots (decode windows grow in steps)."""
    B, K, G, T, S, H = 2, 3, 3, 8, 512, 64
    q, k, v, _ = _attention_case(7, B, K, G, T, S, S, H)
    length = np.array([[100], [180]])
    mask = np.arange(S)[None, None, :] < length[:, :, None] + 1 + np.arange(T)[None, :, None]  # causal
    f = jax.jit(_attention)
    full = np.asarray(f(q, k, v, jnp.asarray(mask[:, :, :256])))  # [B,T,K,G,H]
    for t in range(T):
        one = f(q[:, t:t + 1], k, v, jnp.asarray(mask[:, t:t + 1, :256]))
        assert np.array_equal(np.asarray(one)[:, 0], full[:, t])
    wide = np.asarray(f(q, k, v, jnp.asarray(mask)))  # window 512, slots 256.. all masked
    assert np.array_equal(wide, full)


@needs_kernel
def test_attention_prefill_block_at_a_wide_window_takes_the_kernel():
    """A prefill block (more than MAX_ATTN_TOKENS tokens) at a window of
    MIN_PREFILL_ATTN_WINDOW slots or more takes the kernel (it reads each row only to its
    last visible slot, issue 57): close to the definition, and each token's output bitwise
    what it gives alone (a decode step) and at the whole cache's window."""
    B, K, G, T, S, H = 1, 3, 3, 64, 2048, 64
    W = ck.MIN_PREFILL_ATTN_WINDOW
    q, k, v, _ = _attention_case(8, B, K, G, T, S, W, H)
    length = 300  # the row's cached slots before the block; causal over the block
    mask = np.arange(S)[None, None, :] <= length + np.arange(T)[None, :, None]  # [1,T,S]
    f = jax.jit(_attention)
    block = f.lower(q, k, v, jnp.asarray(mask[:, :, :W]))
    assert "lookahead_attention" in block.as_text()
    got = np.asarray(block.compile()(q, k, v, jnp.asarray(mask[:, :, :W])))
    np.testing.assert_allclose(got, np.asarray(jax.jit(_reference(0.125))(q, k, v, jnp.asarray(mask[:, :, :W]))),
                               rtol=0, atol=2e-6)
    assert np.array_equal(np.asarray(f(q, k, v, jnp.asarray(mask))), got)  # the whole cache's window
    for t in (0, 17, T - 1):
        one = f(q[:, t:t + 1], k, v, jnp.asarray(mask[:, t:t + 1]))
        assert np.array_equal(np.asarray(one)[:, 0], got[:, t])
    small = _attention_case(9, B, K, G, T, S, W // 4, H)  # a small window keeps XLA's dots
    assert "lookahead_attention" not in jax.jit(_attention).lower(*small).as_text()


@needs_kernel
@pytest.mark.parametrize("T,W", [(4, 256), (64, 512)])
def test_attention_over_cache_rows_reads_them_in_place(T, W):
    """rows [G]: query row g attends over cache row rows[g] of a larger cache (a prefill
    block of a few of the server's rows, no copy of their windows): bitwise the kernel
    over those rows copied out, and close to the definition, which reads them the same way."""
    C, K, G, S, H = 5, 3, 3, 512, 64
    q, k, v, _ = _attention_case(11 + T, 2, K, G, T, S, W, H)
    rng = np.random.default_rng(T)
    k = jnp.asarray(rng.standard_normal((C, K, S, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((C, K, S, H)), jnp.float32)
    rows = jnp.asarray([3, 1], jnp.int32)
    length = np.array([[100], [40]])
    mask = jnp.asarray(np.arange(W)[None, None, :] <= length[:, :, None] + np.arange(T)[None, :, None])

    def f(q, k, v, mask, rows):
        return ck.attention(q, k, v, mask, 0.125, _reference(0.125), rows)

    lowered = jax.jit(f).lower(q, k, v, mask, rows)
    assert "lookahead_attention_rows" in lowered.as_text()
    got = np.asarray(lowered.compile()(q, k, v, mask, rows))
    copied = np.asarray(jax.jit(_attention)(q, k[rows], v[rows], mask))  # the rows copied out
    assert np.array_equal(got, copied)
    ref = np.asarray(jax.jit(_reference(0.125))(q, k, v, mask, rows))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(ref, np.asarray(jax.jit(_reference(0.125))(q, k[rows], v[rows], mask)), rtol=0, atol=0)


@needs_kernel
def test_attention_row_with_nothing_visible_is_finite():
    q, k, v, mask = _attention_case(3, T=3)
    mask = mask.at[:, 1].set(False)
    out = np.asarray(jax.jit(_attention)(q, k, v, mask))  # [B,T,K,G,H]
    assert np.isfinite(out).all() and not out[:, 1].any() and out[:, 0].any()


def test_attention_the_kernel_does_not_take_uses_the_definition():
    q, k, v, mask = _attention_case(4, T=ck.MAX_ATTN_TOKENS + 1)  # prefill-sized
    f = jax.jit(_attention)
    assert "lookahead_attention" not in f.lower(q, k, v, mask).as_text()
    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    assert "lookahead_attention" not in jax.jit(_attention).lower(*bf, mask).as_text()
    q24, k24, v24, m24 = _attention_case(5, H=20)  # head dim not a multiple of 8 or 16
    assert "lookahead_attention" not in jax.jit(_attention).lower(q24, k24, v24, m24).as_text()
    np.testing.assert_allclose(np.asarray(f(q, k, v, mask)), np.asarray(jax.jit(_reference(0.125))(q, k, v, mask)),
                               rtol=0, atol=0)


def test_attention_derivatives_are_those_of_the_definition():
    q, k, v, mask = _attention_case(6, T=2, S=64, W=48, H=32)

    def loss(att):
        return lambda q, k, v: jnp.sum(jnp.sin(att(q, k, v, mask)))

    got = jax.grad(loss(_attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(_reference(0.125)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(WIDTH != 16, reason="needs an AVX-512 machine to build the AVX2 variant beside it")
def test_avx2_variant_matches_the_reference(tmp_path, monkeypatch):
    """The AVX2+FMA code path (machines without AVX-512), built with -mno-avx512f and
    registered under other names: products and attention against the references."""
    import ctypes

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path))
    lib = ctypes.CDLL(str(ck._build(("-mno-avx512f",))))
    assert lib.lookahead_vector_width() == 8
    for name in ("lookahead_matmul_nn", "lookahead_matmul_nn_packed", "lookahead_matmul_nn_packed_bf16",
                 "lookahead_matmul_nt", "lookahead_attention", "lookahead_argmax"):
        jax.ffi.register_ffi_target(name + "_avx2", jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")

    def call(name, out_shape, *args, **attrs):
        return np.asarray(jax.jit(lambda *a: jax.ffi.ffi_call(name + "_avx2", jax.ShapeDtypeStruct(out_shape, jnp.float32))(
            *a, **attrs))(*args))

    rng = np.random.default_rng(0)
    for M in (1, 2, 3, 9, 16, 17, 31):  # above 16: the packed kernels' cache-blocked product (K = 264: two slices)
        x = rng.standard_normal((M, 264), dtype=np.float32)
        w = rng.standard_normal((264, 40), dtype=np.float32)
        e = rng.standard_normal((13, 264), dtype=np.float32)
        np.testing.assert_allclose(call("lookahead_matmul_nn", (M, 40), x, w), _ref(x, w), rtol=0, atol=1e-4)
        for n in (48, 32, 16):  # tiles of 2 x 3, 2 x 2 and 2 x 1 AVX2 vectors
            wn = rng.standard_normal((264, 2 * n), dtype=np.float32)
            packed = np.asarray(ck.pack(wn).data)
            assert np.array_equal(call("lookahead_matmul_nn_packed", (M, 2 * n), x, packed),
                                  call("lookahead_matmul_nn", (M, 2 * n), x, wn))
            wr = np.asarray(jnp.asarray(wn).astype(jnp.bfloat16).astype(jnp.float32))
            assert np.array_equal(call("lookahead_matmul_nn_packed_bf16", (M, 2 * n), x, ck.pack(wn, jnp.bfloat16).data),
                                  call("lookahead_matmul_nn", (M, 2 * n), x, wr))
        np.testing.assert_allclose(call("lookahead_matmul_nt", (M, 13), x, e), _ref(x, e.T), rtol=0, atol=1e-4)
        if M > 1:
            assert np.array_equal(call("lookahead_matmul_nt", (1, 13), x[1:2], e), call("lookahead_matmul_nt", (M, 13), x, e)[1:2])
    for x in _argmax_cases():
        flat = x.reshape(-1, x.shape[-1])
        out = np.asarray(jax.jit(lambda f: jax.ffi.ffi_call("lookahead_argmax_avx2", jax.ShapeDtypeStruct(f.shape[:1], jnp.int32))(f))(flat))
        np.testing.assert_array_equal(out, np.asarray(jnp.argmax(flat, axis=-1)))
    q, k, v, mask = _attention_case(8, B=2, K=2, G=2, T=5, S=200, W=136, H=32)
    got = call("lookahead_attention", q.shape, q, k, v, mask, scale=np.float32(0.125))
    np.testing.assert_allclose(got, np.asarray(jax.jit(_reference(0.125))(q, k, v, mask)), rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- packed params
@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_packed_params_give_the_same_forward(family):
    """pack_params changes the layout only: decode-sized forwards (1 and 6 tokens) give
    bitwise the same cache and (untied head) logits, a prefill-sized one (40 tokens, where
    the plain weights take XLA's dot) the same within f32 rounding. A tied head (gemma3
    here) becomes a packed e.T beside the embedding: its logits sum in another order
    (close, not bitwise), the same whatever the number of rows."""
    from lookahead_jax.models import forward, init_cache
    from lookahead_jax.models.transformer import pack_params, unpack_params
    from tiny import tiny_model

    tied = family == "gemma3"
    m = tiny_model(family, tie_embeddings=tied, vocab_size=272 if tied else 259)
    packed = pack_params(m.params)
    kinds = {k: type(v).__name__ for k, v in packed["layers"][0].items()}
    assert all(kinds[k] == "PackedWeight" for k in ("qkv", "o", "gate_up", "down")), kinds
    if tied:
        assert packed["packed_head"].shape == (64, 272) and packed["embed"] is m.params["embed"]
    else:
        assert isinstance(packed["lm_head"], jax.Array) and "packed_head" not in packed  # 259 columns: plain
    f = jax.jit(forward, static_argnums=5)
    rows = {}
    for T, length in [(1, 7), (6, 20), (40, 0)]:
        tokens = jax.random.randint(jax.random.PRNGKey(T), (2, T), 3, 259)
        positions = length + jnp.broadcast_to(jnp.arange(T), (2, T))
        cache = init_cache(m.config, 2, 64)
        cache = cache.replace(length=jnp.full((2,), length, jnp.int32))
        mask = jnp.broadcast_to(jnp.arange(64)[None, None] <= positions[:, :, None], (2, T, 64))
        a, ca = f(m.params, tokens, positions, cache, mask, m.config)
        b, cb = f(packed, tokens, positions, cache, mask, m.config)
        rows[T] = (tokens, positions, cache, mask, b)
        if T <= ck.MAX_ROWS:
            assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(ca.k, cb.k))
            assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(ca.v, cb.v))
        if T <= ck.MAX_ROWS and not tied:
            assert np.array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # the last of the 6 tokens alone (its K/V context as in the block): the same logits bits
    tokens, positions, cache, mask, b6 = rows[6]
    _, c5 = f(packed, tokens[:, :5], positions[:, :5], cache, mask[:, :5], m.config)
    one, _ = f(packed, tokens[:, 5:], positions[:, 5:], c5.replace(length=c5.length + 5), mask[:, 5:], m.config)
    assert np.array_equal(np.asarray(one[:, 0]), np.asarray(b6[:, 5]))
    back = unpack_params(packed)
    assert jax.tree.structure(back) == jax.tree.structure(m.params)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(m.params)))


@needs_kernel
def test_runtime_params_are_packed_once_and_follow_the_params():
    """generate runs on packed weights on a CPU device in f32, made once per params; a
    changed leaf makes a new copy (never stale weights); bf16 params stay as they are."""
    from lookahead_jax.loading import runtime_params
    from tiny import tiny_model

    m = tiny_model("llama")
    r = runtime_params(m)
    assert isinstance(r["layers"][0]["gate_up"], ck.PackedWeight)
    assert r["embed"] is m.params["embed"]  # what is not packed is shared, not copied
    assert runtime_params(m) is r
    m.params["layers"][1]["down"] = m.params["layers"][1]["down"] * 2.0  # in place, same dict
    r2 = runtime_params(m)
    assert r2 is not r
    np.testing.assert_array_equal(np.asarray(r2["layers"][1]["down"].unpacked()), np.asarray(m.params["layers"][1]["down"]))
    mb = tiny_model("llama")
    mb.params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mb.params)
    assert runtime_params(mb) is mb.params


@needs_kernel
def test_load_keeps_one_copy_of_the_weights(tmp_path):
    """`lj.load` packs the layer weights as it loads (one CPU device, f32): after load and
    generate, the live jax arrays hold ONE copy of the weights; with keep_unpacked=True
    they hold the plain weights and the packed copy generate makes beside them (so the
    count can tell them apart). The tokens are the same; unpack_params gives the plain
    arrays back, bitwise; save_pretrained of the packed model stores plain arrays."""
    import gc

    from test_distill import byte_tokenizer
    from tiny import tiny_model

    import lookahead_jax as lj
    from lookahead_jax.core.packing import is_packed
    from lookahead_jax.models.transformer import PACKED_LEAVES, unpack_params

    t = tiny_model("llama", n_layers=4, d_ff=512)
    tok = byte_tokenizer()
    lj.save_pretrained(lj.Model(t.config, t.params, "tiny"), tok, tmp_path / "m")
    plain = jax.tree.map(np.asarray, t.params)
    weights = sum(x.nbytes for x in jax.tree.leaves(plain))
    packed_bytes = sum(v.nbytes for p in plain["layers"] for k, v in p.items() if k in PACKED_LEAVES)
    del t
    gc.collect()

    def live() -> int:
        gc.collect()
        return sum(x.nbytes for x in jax.live_arrays())

    def held(**kw):
        before = live()
        model, tok2 = lj.load(str(tmp_path / "m"), **kw)
        out = lj.generate(model, tok2, ["def f(x):", "Hello"], max_new_tokens=8)
        return live() - before, model, out.token_ids

    one, packed_model, ids = held()
    assert is_packed(packed_model.params)
    assert weights <= one < weights + 0.2 * packed_bytes, (one, weights, packed_bytes)
    two, plain_model, ids_plain = held(keep_unpacked=True)
    assert not is_packed(plain_model.params)
    assert two >= weights + 0.9 * packed_bytes, (two, weights, packed_bytes)
    assert ids == ids_plain
    back = unpack_params(packed_model.params)
    assert jax.tree.structure(back) == jax.tree.structure(plain)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(plain)))
    lj.save_pretrained(packed_model, tok, tmp_path / "again")
    again, _ = lj.load(str(tmp_path / "again"), keep_unpacked=True)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(plain)))


@needs_kernel
def test_keep_packed_only_consume_packs_in_place():
    """keep_packed_only(consume=True) (a draft loaded by name) packs the plain params
    weight by weight into the engine's storage dtype: the same packed weights as the
    copying path, the old layer dicts emptied of them (nothing keeps the plain copy)."""
    from tiny import tiny_model

    from lookahead_jax.core.engine import Engine
    from lookahead_jax.core.packing import packed_dtype as _packed_dtype

    a, b = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    old_layer = b.params["layers"][0]
    ea, eb = Engine(a), Engine(b)
    ea.weight_dtype = eb.weight_dtype = "bfloat16"
    assert ea.keep_packed_only() and eb.keep_packed_only(consume=True)
    assert _packed_dtype(a.params) == _packed_dtype(b.params) == jnp.bfloat16
    assert not set(old_layer) & {"qkv", "o", "gate_up", "down"} and "attn_norm" in old_layer
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    assert eb.params is b.params
