"""The skinny-matmul CPU kernels (`models/cpu_kernels`): same products as a float64
reference, rows independent of how many share the call, derivatives, the fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.models import cpu_kernels as ck

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
@pytest.mark.parametrize("M", [1, 2])
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
    both = np.asarray(jax.jit(ck.matmul_nt)(x[:2], e))
    assert np.array_equal(np.asarray(jax.jit(ck.matmul_nt)(x[1:2], e)), both[1:2])


def test_products_the_kernel_does_not_take_use_plain_dot():
    x = jnp.ones((2, 64))
    assert not _lowered_has_kernel(ck.matmul, x.astype(jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16))
    assert not _lowered_has_kernel(ck.matmul, jnp.ones((ck.MAX_ROWS + 1, 64)), jnp.ones((64, 32)))
    assert not _lowered_has_kernel(ck.matmul, x, jnp.ones((64, 17)))  # N not a vector multiple
    assert not _lowered_has_kernel(ck.matmul_nt, jnp.ones((ck.MAX_ROWS_NT + 1, 64)), jnp.ones((10, 64)))
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
