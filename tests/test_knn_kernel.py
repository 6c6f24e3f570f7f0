"""The KNN shortlist CPU kernel (`cpu_kernels.knn_shortlist`, the shortlist pass of
`knnlm.search.exact_search`): the kp smallest matmul distances ranked by (distance, id),
a query's answer independent of the batch and of the split into tiles, and the exact
search through it equal to brute force on stores full of near-ties."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.knnlm import search as S
from lookahead_jax.models import cpu_kernels as ck

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason=f"CPU kernel tests; JAX's default backend is {jax.default_backend()}")
WIDTH = ck.vector_width()
needs_kernel = pytest.mark.skipif(not WIDTH, reason="CPU kernel not built on this machine (no compiler or not x86)")


def _store(N, D, dtype, seed, dups=True):
    """Random keys with groups of exact duplicates and near-duplicates (near-ties)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((N, D)).astype(dtype)
    if dups and N > 40:
        keys[[5, 17, N - 1]] = keys[2]  # exact duplicates, one in the last (partial) block
        near = keys[30].astype(np.float32) + np.float32(1e-3) * rng.standard_normal(D).astype(np.float32)
        keys[31:36] = near.astype(dtype)
    return keys


def _queries(keys, Q, seed):
    rng = np.random.default_rng(seed)
    src = np.concatenate([[2, 30], rng.integers(0, len(keys), Q)])[:Q] % len(keys)
    return (keys[src].astype(np.float32) + 0.01 * rng.standard_normal((Q, keys.shape[1]))).astype(np.float32)


def _norms(keys):
    return np.square(keys.astype(np.float64)).sum(1).astype(np.float32)


def _reference(kp):
    """The XLA scan over flat keys [N,D], norms [N] (one chunk)."""
    return lambda h, x, n: S._scan_shortlist(h, x.reshape(1, -1, x.shape[-1]), n.reshape(1, -1), kp=kp)


def _kernel(h, keys, norms, kp):
    f = jax.jit(lambda h, x, n: ck.knn_shortlist(h, x, n, kp, _reference(kp)))
    assert "lookahead_knn_shortlist" in f.lower(h, keys, norms).as_text()
    return [np.asarray(a) for a in f(h, keys, norms)]


@needs_kernel
@pytest.mark.parametrize("N,D,dtype", [(3001, 64, np.float16), (20011, 32, np.float16), (777, 48, np.float32)])
def test_shortlist_is_the_kp_smallest_by_distance_then_id(N, D, dtype):
    """kp = N gives the kernel's full ranking: sorted by (m, id), every m within the
    rounding bound of the float64 |x|^2 - 2 h.x; a smaller kp is its first kp entries
    (the tiles' selections merge to the global one: 20011 keys are 3 tiles), duplicates
    ranked by id; a query's row is bitwise the same alone and in batches of 1..9."""
    keys = _store(N, D, dtype, seed=N)
    norms = _norms(keys)
    h = _queries(keys, 9, seed=D)
    full_d, full_i = _kernel(h[:3], keys, norms, N)
    for q in range(3):
        assert sorted(full_i[q]) == list(range(N))
        assert all((a, i) < (b, j) for a, b, i, j in zip(full_d[q], full_d[q][1:], full_i[q], full_i[q][1:]))
        x = keys[full_i[q]].astype(np.float64)
        m = np.square(x).sum(1) - 2 * x @ h[q].astype(np.float64)
        bound = 2 * (D + 16) * S.U * (np.linalg.norm(h[q]) + np.sqrt(np.square(x).sum(1).max())) ** 2
        assert np.abs(full_d[q] - m).max() <= bound
    for kp in (1, 7, 80, N - 1):
        d, i = _kernel(h[:3], keys, norms, kp)
        np.testing.assert_array_equal(i, full_i[:, :kp])
        np.testing.assert_array_equal(d, full_d[:, :kp])
    pos = {int(j): r for r, j in enumerate(full_i[0])}
    assert pos[2] < pos[5] < pos[17] < pos[N - 1] and pos[N - 1] - pos[2] == 3  # duplicates of query 0's source
    alone = [_kernel(h[q:q + 1], keys, norms, 80) for q in range(9)]
    for Q in range(1, 10):
        d, i = _kernel(h[:Q], keys, norms, 80)
        for q in range(Q):
            np.testing.assert_array_equal(i[q], alone[q][1][0])
            np.testing.assert_array_equal(d[q], alone[q][0][0])


@needs_kernel
def test_padding_and_short_stores():
    """+inf norms (padding) never enter the shortlist: past the finite entries it is +inf
    and -1; kp = N over a store of one key."""
    keys = _store(40, 16, np.float16, seed=3)
    norms = _norms(keys)
    norms[25:] = np.inf
    h = _queries(keys[:25], 2, seed=4)
    d, i = _kernel(h, keys, norms, 32)
    assert (np.sort(i[:, :25], axis=1) == np.arange(25)).all()
    assert np.isinf(d[:, 25:]).all() and (i[:, 25:] == -1).all() and np.isfinite(d[:, :25]).all()
    d, i = _kernel(h[:1], keys[:1], norms[:1], 1)
    assert i.tolist() == [[0]] and np.isfinite(d).all()


def test_the_xla_scan_where_the_kernel_does_not_apply():
    """D not a multiple of the vector width, more than MAX_KNN_QUERIES queries: the
    reference (the XLA scan) is what runs, with the same contract."""
    keys = _store(300, 12, np.float16, seed=5)
    norms = _norms(keys)
    h = _queries(keys, 3, seed=6)
    called = []

    def spy(h, x, n):
        called.append(1)
        return _reference(20)(h, x, n)

    d, i = jax.jit(lambda h, x, n: ck.knn_shortlist(h, x, n, 20, spy))(h, keys, norms)
    assert called and np.asarray(i).shape == (3, 20) and (np.diff(np.asarray(d), axis=1) >= 0).all()
    text = jax.jit(lambda h, x, n: ck.knn_shortlist(h, x, n, 20, spy)).lower(h, keys, norms).as_text()
    assert "lookahead_knn_shortlist" not in text
    if WIDTH:
        many = np.zeros((ck.MAX_KNN_QUERIES + 1, 16), np.float32)
        keys = _store(300, 16, np.float16, seed=7)
        text = jax.jit(lambda h, x, n: ck.knn_shortlist(h, x, n, 20, spy)).lower(many, keys, _norms(keys)).as_text()
        assert "lookahead_knn_shortlist" not in text


def _index(keys):
    store = SimpleNamespace(keys=keys, values=np.zeros(len(keys), np.int32), path=None)
    return S.KnnIndex(store, chunk=1024)


@needs_kernel
@pytest.mark.parametrize("N,k", [(5003, 1), (5003, 32), (50, 40), (50, 50), (1500, 700)])
def test_exact_search_through_the_kernel_is_brute_force(N, k):
    """exact_search (its shortlist pass now the kernel) == brute_search, for each query
    alone and in batches of 1..9, on a store of duplicates and near-ties; k near N too."""
    keys = _store(N, 64, np.float16, seed=k)
    idx = _index(keys)
    h = jnp.asarray(_queries(keys, 9, seed=N))
    assert "lookahead_knn_shortlist" in S.exact_search.lower(idx.keys, h, idx.norms, idx.n_valid, idx.xmax,
                                                             k=k).as_text()
    assert "lookahead_knn_shortlist" not in S.exact_search.lower(idx.keys, h, idx.norms, idx.n_valid, idx.xmax,
                                                                 k=k, kernel=False).as_text()
    brute = np.asarray(S.brute_search(idx.keys, h, idx.n_valid, k=k))
    for Q in (1, 2, 3, 8, 9):
        ids, ok = S.exact_search(idx.keys, h[:Q], idx.norms, idx.n_valid, idx.xmax, k=k)
        ids, ok = np.asarray(ids), np.asarray(ok)
        np.testing.assert_array_equal(ids[ok], brute[:Q][ok])
        assert ok[2:].all() or N <= 2 * k + 16  # only the exact duplicates (queries 0, 1) may need brute force
        xla, xok = S.exact_search(idx.keys, h[:Q], idx.norms, idx.n_valid, idx.xmax, k=k, kernel=False)
        both = ok & np.asarray(xok)
        np.testing.assert_array_equal(ids[both], np.asarray(xla)[both])  # the XLA scan's answer
    for q in range(9):
        ids, ok = S.exact_search(idx.keys, h[q:q + 1], idx.norms, idx.n_valid, idx.xmax, k=k)
        if bool(ok[0]):
            np.testing.assert_array_equal(np.asarray(ids)[0], brute[q])


@needs_kernel
def test_avx2_variant_of_the_shortlist(tmp_path, monkeypatch):
    """The AVX2+FMA build (-mno-avx512f) gives the native build's shortlists: the same
    lane-wise FMA chains only where both are AVX2; on AVX-512 the same sets and ranks."""
    import ctypes

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path))
    lib = ctypes.CDLL(str(ck._build(("-mno-avx512f",))))
    assert lib.lookahead_vector_width() == 8
    name = "lookahead_knn_shortlist_f16"
    jax.ffi.register_ffi_target(name + "_avx2test", jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    keys = _store(9000, 64, np.float16, seed=9)
    norms = _norms(keys)
    h = _queries(keys, 5, seed=10)
    out = (jax.ShapeDtypeStruct((5, 80), jnp.float32), jax.ShapeDtypeStruct((5, 80), jnp.int32))
    d, i = jax.jit(lambda *a: jax.ffi.ffi_call(name + "_avx2test", out)(*a))(h, keys, norms)
    want_d, want_i = _kernel(h, keys, norms, 80)
    if WIDTH == 8:
        np.testing.assert_array_equal(np.asarray(i), want_i)
        np.testing.assert_array_equal(np.asarray(d), want_d)
    else:
        np.testing.assert_allclose(np.asarray(d), want_d, rtol=0, atol=1e-3)
