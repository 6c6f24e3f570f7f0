"""Neighbour search over a datastore, and the KNN-LM next-token distribution.

Distance. The neighbours of a query h [D] are the k entries with the smallest squared L2
distance (as KNN-LM) under ONE canonical routine, `sq_distances`: d = h - x, d * d, then a
pairwise sum over D in a fixed tree (halve the zero-padded power-of-two width until one is
left), every step an elementwise f32 operation. The value of d(h, x) therefore depends on
(h, x) alone, never on how many queries or candidates share the call, nor on the program
it is fused into (an optimization barrier keeps d * d from being contracted into an FMA).
Ties are broken by the lower entry id: a neighbour list is sorted by (d, id).

Every search returns the top-k of its candidates under that rule:

* exact (`exact_search`, device): a shortlist of the kp = 2k + 16 entries of smallest
  matmul distance |x|^2 - 2 h.x (f32), then ranked by `sq_distances`. On CPU the shortlist
  is one kernel call (`cpu_kernels.knn_shortlist`: the keys read once for all Q queries,
  each dot product W lane-wise FMA chains then a log2 W level sum, W = 8 or 16 lanes:
  error <= (D/W + log2 W) u |h||x| (1 + O(Du)), the subtraction one more rounding);
  elsewhere (and where the kernel does not apply) a lax.scan over the keys in fixed-size
  chunks [nC,C,D] (Precision.HIGHEST; any summation order, error <= D u |h||x|). Either
  rounding depends on the implementation, so the matmul distance only shortlists: with
  eps = 2 (D + log2 D + 16) u (|h| + max|x|)^2 (u = 2^-24, above the rounding of both
  forms), an entry outside the shortlist has a canonical distance >= (kp-th matmul
  distance + |h|^2) - eps; when that exceeds the k-th canonical distance of the shortlist
  (`ok`), the shortlist's top-k is the exact top-k. Otherwise (near-ties over the whole
  shortlist, rare) the caller redoes the query by `brute_search`: canonical distances to
  every key, a running top-k by (d, id). Either way the result is the exact top-k, the
  same for a query however it is batched.
* subset (`subset_search`): the top-k of given candidate ids (faiss candidates), same
  distances, same order.
* cache (`cache_search`, speculation only): a matmul shortlist of 2k + 16 of the row's
  cached ids, ranked by (canonical d, id): the true list whenever the true top-k is among
  the candidates and the shortlist (verification checks it anyway).
* faiss (`faiss_candidates`, host): IndexHNSWFlat ("hnsw", approximate) or IndexFlatL2
  ("flat", exact brute force on the host) proposes 2k + 8 ids; `subset_search` ranks them.
  "ivf" (an IVF index with 8-bit codes) proposes ids to speculation only.
  A faiss search of one query does not depend on the other queries of the call.

The model step (`forward_fn`) forwards each row's root over the whole cache (attention
window S) and returns the final hidden state with the logits.

Distribution (`knn_scores`, in `choose`: one jitted call per decode step, always of shape
[B,...]):

    w_j     = softmax_j(-d_j / temperature)               over the k neighbours
    p_kNN   = sum_j w_j [value_j = v]                     (per distinct value: a k x k sum)
    p       = lambda * p_kNN + (1 - lambda) * softmax(logits)
    scores  = log p          (lambda = 0: the raw logits, i.e. plain decoding exactly)

then greedy (argmax) or sampling on `scores` with the library's key (seed, row, position)
and filters (`sampling.select_tokens`). The mass per value is gathered with a k x k
comparison and set (not scatter-added: an atomic add's order is not fixed on GPUs). The
same (h, logits, neighbour ids) give bitwise the same scores in every call.

Axes: B rows, Q queries, N entries (padded to nC * C), C chunk, D model dim, V vocab,
k neighbours, kp shortlist, M candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models import advance, cpu_kernels, hidden_states, logits_from_hidden
from ..core.multihost import broadcast_plan
from ..core.sampling import SamplingParams, select_tokens
from ..core.verify import banned, token_logprobs

U = 2.0 ** -24  # float32 unit roundoff
BIG_ID = np.iinfo(np.int32).max  # sorts after every real id
# keys per scan step of the exact search's XLA shortlist (the CPU kernel reads them flat).
# On the CPU a chunk's f32 copy (2.4 MB at D = 576) then stays in cache: 4096 was 1.7x
# slower there (bench/knn_search.py); on accelerators, where each scan step is a launch,
# the earlier 4096 (not measured there yet)
CHUNKS = {"cpu": 1024}
CHUNK = 4096


def shortlist_size(k: int) -> int:
    return 2 * k + 16


def tree_sum(x):
    """Sum over the last axis in a fixed pairwise order: elementwise adds only, so the value
    of a row never depends on the array's shape. The n - P entries past the largest power
    of two P <= n are first added onto the first ones (what halving a zero-padded width 2P
    would do, without adding the zeros: 6x faster on XLA:CPU at D = 576), then the width
    is halved until one is left."""
    n = x.shape[-1]
    P = 1 << (n.bit_length() - 1)
    if P != n:  # [a b c d e] -> [a+e b c d]
        x = x[..., :P] + jnp.pad(x[..., P:], [(0, 0)] * (x.ndim - 1) + [(0, 2 * P - n)])
    while x.shape[-1] > 1:  # [a b c d] -> [a+c b+d] -> [(a+c)+(b+d)]
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def sq_distances(h, x):
    """Canonical squared L2 distances: h [...,D] f32 against x [...,D] (f16/f32, broadcast)
    -> [...] f32 (module docstring)."""
    d = h.astype(jnp.float32) - x.astype(jnp.float32)
    return tree_sum(jax.lax.optimization_barrier(d * d))


def _ranked(d, ids, k: int):
    """Sort candidates by (d, id); the first k ids, -1 where d is inf (no candidate)."""
    d, ids = jax.lax.sort((d, ids), dimension=-1, num_keys=2)
    return jnp.where(jnp.isfinite(d[..., :k]), ids[..., :k], -1), d[..., :k]


def _scan_shortlist(h, keys, norms, kp: int):
    """The shortlist pass in XLA (keys [nC,C,D], norms [nC,C]): a lax.scan over the chunks
    keeping the kp smallest matmul distances -> (md [Q,kp] ascending, mi [Q,kp])."""
    Q = h.shape[0]
    nC, C, _ = keys.shape

    def body(carry, xs):
        best_d, best_i = carry  # [Q,kp]
        kc, nc, c = xs
        dot = jnp.einsum("QD,CD->QC", h, kc.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        d = nc[None, :] - 2.0 * dot  # [Q,C]
        ids = jnp.broadcast_to(c * C + jnp.arange(C, dtype=jnp.int32), (Q, C))
        all_d = jnp.concatenate([best_d, d], axis=1)
        all_i = jnp.concatenate([best_i, ids], axis=1)
        neg, pos = jax.lax.top_k(-all_d, kp)
        return (-neg, jnp.take_along_axis(all_i, pos, axis=1)), None

    init = (jnp.full((Q, kp), jnp.inf, jnp.float32), jnp.full((Q, kp), -1, jnp.int32))
    (md, mi), _ = jax.lax.scan(body, init, (keys, norms, jnp.arange(nC, dtype=jnp.int32)))
    return md, mi


@functools.partial(jax.jit, static_argnames=("k", "kernel"))
def exact_search(keys, h, norms, n_valid, xmax, *, k: int, kernel: bool = True):
    """keys [nC,C,D]; h [Q,D] f32; norms [nC,C] f32 (|x|^2, +inf on padding); n_valid, xmax
    scalars. Returns (ids [Q,k] int32 ranked by (d, id), ok [Q] bool): where ok is false
    the shortlist could miss a neighbour: redo the query with `brute_search`. kernel=False:
    the XLA shortlist on CPU too (bench/knn_search.py times both)."""
    Q, D = h.shape
    nC, C, _ = keys.shape
    kp = min(shortlist_size(k), nC * C)
    h = h.astype(jnp.float32)
    scan = functools.partial(_scan_shortlist, kp=kp)
    md, mi = cpu_kernels.knn_shortlist(h, keys, norms, kp, scan) if kernel else scan(h, keys, norms)
    valid = (mi >= 0) & (mi < n_valid)
    x = keys.reshape(nC * C, D)[jnp.clip(mi, 0, nC * C - 1)]  # [Q,kp,D]
    dc = jnp.where(valid, sq_distances(h[:, None, :], x), jnp.inf)
    ids, dk = _ranked(dc, jnp.where(valid, mi, BIG_ID), k)
    hh = jnp.sum(h * h, axis=-1)
    eps = 2.0 * (D + math.log2(D) + 16) * U * (jnp.sqrt(hh) + xmax) ** 2
    ok = (n_valid <= kp) | (md[:, kp - 1] + hh - eps > dk[:, k - 1])
    return ids, ok


@functools.partial(jax.jit, static_argnames=("k",))
def brute_search(keys, h, n_valid, *, k: int):
    """The exact top-k by canonical distance to every key: keys [nC,C,D], h [Q,D] -> ids [Q,k]."""
    Q, D = h.shape
    nC, C, _ = keys.shape
    h = h.astype(jnp.float32)

    def body(carry, xs):
        bd, bi = carry  # [Q,k]
        kc, c = xs
        ids = c * C + jnp.arange(C, dtype=jnp.int32)
        d = jnp.where(ids[None, :] < n_valid, sq_distances(h[:, None, :], kc[None]), jnp.inf)  # [Q,C]
        all_d = jnp.concatenate([bd, d], axis=1)
        all_i = jnp.concatenate([bi, jnp.broadcast_to(jnp.where(ids < n_valid, ids, BIG_ID), (Q, C))], axis=1)
        sd, si = jax.lax.sort((all_d, all_i), dimension=-1, num_keys=2)
        return (sd[:, :k], si[:, :k]), None

    init = (jnp.full((Q, k), jnp.inf, jnp.float32), jnp.full((Q, k), BIG_ID, jnp.int32))
    (bd, bi), _ = jax.lax.scan(body, init, (keys, jnp.arange(nC, dtype=jnp.int32)))
    return jnp.where(jnp.isfinite(bd), bi, -1)


@functools.partial(jax.jit, static_argnames=("k",))
def subset_search(keys, h, cand, n_valid, *, k: int):
    """The top-k of candidate ids cand [Q,M] (int32, -1 = none; distinct) for h [Q,D]:
    ids [Q,k] ranked by (d, id), -1 past the valid candidates."""
    nC, C, D = keys.shape
    valid = (cand >= 0) & (cand < n_valid)
    x = keys.reshape(nC * C, D)[jnp.clip(cand, 0, nC * C - 1)]  # [Q,M,D]
    d = jnp.where(valid, sq_distances(h[:, None, :], x), jnp.inf)
    return _ranked(d, jnp.where(valid, cand, BIG_ID), k)[0]


@functools.partial(jax.jit, static_argnames=("k",))
def cache_search(keys, h, cand, norms, n_valid, *, k: int):
    """Speculation's search of a row's cache, cand [Q,M] (int32, -1 = none; distinct): the
    2k + 16 candidates of smallest matmul distance, ranked by (canonical d, id) -> ids
    [Q,k]. A prediction only (verification decides), so no exactness check; when the true
    top-k is among the candidates it is almost always this answer."""
    nC, C, D = keys.shape
    Q, M = cand.shape
    kp = min(shortlist_size(k), M)
    valid = (cand >= 0) & (cand < n_valid)
    safe = jnp.clip(cand, 0, nC * C - 1)
    x = keys.reshape(nC * C, D)[safe]  # [Q,M,D]
    dot = jnp.einsum("QD,QMD->QM", h.astype(jnp.float32), x.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    approx = jnp.where(valid, norms.reshape(-1)[safe] - 2.0 * dot, jnp.inf)
    _, pos = jax.lax.top_k(-approx, kp)
    short = jnp.take_along_axis(jnp.where(valid, cand, -1), pos, axis=1)  # [Q,kp]
    ok = short >= 0
    d = jnp.where(ok, sq_distances(h[:, None, :], keys.reshape(nC * C, D)[jnp.clip(short, 0)]), jnp.inf)
    return _ranked(d, jnp.where(ok, short, BIG_ID), k)[0]


def knn_probs(h, ids, keys, values, *, temperature: float, vocab: int):
    """p_kNN [B,V] f32 from neighbour ids [B,k] (-1 = none): softmax(-d / temperature) over
    the neighbours, each weight on its entry's value."""
    nC, C, D = keys.shape
    B, k = ids.shape
    valid = ids >= 0
    safe = jnp.clip(ids, 0, nC * C - 1)
    d = sq_distances(h[:, None, :], keys.reshape(nC * C, D)[safe])  # [B,k]
    a = jnp.where(valid, -d / temperature, -jnp.inf)
    m = jnp.max(jnp.where(valid, a, jnp.finfo(jnp.float32).min), axis=-1, keepdims=True)
    e = jnp.where(valid, jnp.exp(a - m), 0.0)
    w = e / jnp.maximum(tree_sum(e), jnp.finfo(jnp.float32).tiny)[:, None]  # [B,k]
    v = values[safe]  # [B,k]
    same = (v[:, :, None] == v[:, None, :]) & valid[:, None, :]  # [B,k,k]: j' shares j's value
    mass = tree_sum(jnp.where(same, w[:, None, :], 0.0))  # [B,k] total weight of value v_j
    cols = jnp.where(valid, v, vocab)  # out of range -> dropped
    return jnp.zeros((B, vocab), jnp.float32).at[jnp.arange(B)[:, None], cols].set(mass, mode="drop")


def knn_scores(h, logits, ids, keys, values, *, lam: float, temperature: float):
    """log(lam * p_kNN + (1 - lam) * softmax(logits)) [B,V]; lam = 0: the logits as they are."""
    if lam == 0.0:
        return logits
    p_lm = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    p_knn = knn_probs(h, ids, keys, values, temperature=temperature, vocab=logits.shape[-1])
    return jnp.log(lam * p_knn + (1.0 - lam) * p_lm)


@functools.partial(jax.jit, static_argnames=("lam", "temperature", "sampling", "ban", "logprobs"))
def choose(keys, h, logits, ids, values, seeds, rows, positions, suppress=None, *, lam: float,
           temperature: float, sampling: SamplingParams, ban: tuple = (), logprobs: bool = False):
    """The next token of each row from the KNN-LM distribution: h [B,D], logits [B,V] (the
    model's, at the row's root), neighbour ids [B,k]; positions [B] = the root's position.
    Returns (tokens [B] int32, log p of each token [B] f32: of the mixed distribution,
    before the min_new_tokens ban and the sampling filters; with lam = 0 the model's
    log_softmax, as plain decoding reports it)."""
    scores = knn_scores(h, logits, ids, keys, values, lam=lam, temperature=temperature)  # [B,V]
    pos = positions[:, None]
    masked = banned(scores[:, None, :], pos, suppress, ban)
    tok = select_tokens(masked, sampling, seeds, rows, pos + 1)[:, 0]
    lp = token_logprobs(scores[:, None, :], tok[:, None])[:, 0] if lam == 0.0 else \
        jnp.take_along_axis(scores, tok[:, None], axis=1)[:, 0]
    return tok, (lp if logprobs else jnp.zeros_like(lp))


# ----------------------------------------------------------------------------- model step
@jax.jit
def next_roots(root, tok, active):
    """The next step's roots [B]: each active row's token, the others' roots as they were."""
    return jnp.where(active, tok.astype(root.dtype), root)


def _placed(mesh, config, h, logits, cache):
    """On a mesh: h and logits whole on every device (the host reads them, over several
    processes without a collective; the searches take them as they are), the cache where
    the engine's steps keep it (`sharding.cache_shardings`). Without a mesh: as they are."""
    if mesh is None:
        return h, logits, cache
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ..core.sharding import cache_shardings

    whole = NamedSharding(mesh, P())
    cache = jax.lax.with_sharding_constraint(cache, cache_shardings(config, mesh, int(cache.length.shape[0])))
    return jax.lax.with_sharding_constraint(h, whole), jax.lax.with_sharding_constraint(logits, whole), cache


@functools.lru_cache(maxsize=None)
def forward_fn(config, mesh=None):
    """jit (cache donated): forward each row's root [B] at its position cache.length over
    the whole cache (window S, so a row's state never depends on the other rows' lengths)
    -> (h [B,D] f32 final hidden states, logits [B,V] f32, cache advanced by active [B]).
    mesh: the engine's (`_placed`: h and logits replicated, the cache kept as it is split)."""
    def fn(params, cache, root, active):
        S = cache.max_len
        positions = cache.length[:, None]  # [B,1]
        mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B,1,S]
        h, cache = hidden_states(params, root[:, None], positions, cache, mask, config)
        logits = logits_from_hidden(params, h, config)[:, 0]
        return _placed(mesh, config, h[:, 0].astype(jnp.float32), logits, advance(cache, active.astype(jnp.int32)))

    return jax.jit(fn, donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def spec_step_fn(config, mesh=None):
    """jit (cache donated): one speculative step as one program, `forward_fn`'s forward, then
    `cache_search` of cand [B,M], `choose` and `next_roots` -> (h, logits, cache, ids, tokens,
    log-probabilities, next roots). Its pick may round differently from `choose` alone (one
    log-probability in ~24 steps did, by an ulp), so speculative KNN-LM re-picks every
    verified position with `choose` alone; the forward's h, logits and K/V are the forward
    alone's bits (tests/test_knnlm.py checks speculative == plain bitwise)."""
    forward = forward_fn(config, mesh)

    def fn(params, cache, root, active, keys, cand, norms, n_valid, values, seeds, rows, positions,
           suppress=None, *, k: int, lam: float, temperature: float, sampling: SamplingParams, ban: tuple = (),
           logprobs: bool = False):
        h, logits, cache = forward(params, cache, root, active)
        ids = cache_search(keys, h, cand, norms, n_valid, k=k)
        tok, lp = choose(keys, h, logits, ids, values, seeds, rows, positions, suppress, lam=lam,
                         temperature=temperature, sampling=sampling, ban=ban, logprobs=logprobs)
        return h, logits, cache, ids, tok, lp, next_roots(root, tok, active)

    return jax.jit(fn, donate_argnums=(1,), static_argnames=("k", "lam", "temperature", "sampling", "ban", "logprobs"))


# knn_speculate="auto": "ivf" from this many datastore entries (where faiss is installed),
# else "cache". Measured on the shared wiki passages with SmolLM2-135M (speculative KNN-LM
# over plain KNN-LM, the same tokens): 34.6K entries cache 0.98x, ivf 0.98x (a search is
# cheap: nothing to win); 1.02M entries cache 1.15-1.20x, ivf 1.75-1.86x; 2.91M ivf 2.71x.
IVF_AUTO_MIN = 500_000


def resolve_speculate(kind: str, size: int) -> str:
    """What knn_speculate=`kind` ranks over a datastore of `size` entries: "auto" is "ivf"
    from IVF_AUTO_MIN entries when faiss imports, else "cache"; the others as given."""
    if kind != "auto":
        return kind
    if size < IVF_AUTO_MIN:
        return "cache"
    try:
        import faiss  # noqa: F401
    except ImportError:
        return "cache"
    return "ivf"


# ----------------------------------------------------------------------------- index
class KnnIndex:
    """A datastore on the device (keys in chunks [nC,C,D] in their stored dtype, |x|^2,
    values) plus its faiss indexes, made on first use; `search` / `subset` / `scores` run
    the jitted functions above through the engine's compiled-function table when given.
    mesh: the engine's; the arrays are then whole on every device of it (`replicate`).

    Over several processes the faiss indexes are process 0's alone (`faiss_candidates`
    broadcasts its answer): another host's HNSW graph or IVF lists may differ, and the
    processes would write the same saved index."""

    def __init__(self, datastore, chunk: Optional[int] = None, mesh=None):
        keys = datastore.keys
        N, D = keys.shape
        chunk = chunk or CHUNKS.get(jax.default_backend(), CHUNK)
        C = min(chunk, 1 << max(0, (N - 1).bit_length()))
        nC = -(-N // C)
        pad = np.zeros((nC * C, D), keys.dtype)
        norms = np.full(nC * C, np.inf, np.float32)  # |x|^2, in float64 then rounded
        for s in range(0, N, 65536):  # bounded float64 temporaries
            part = keys[s:s + 65536]
            pad[s:s + len(part)] = part
            norms[s:s + len(part)] = np.square(part, dtype=np.float64).sum(1)
        self.datastore = datastore
        self.size, self.dim, self.chunk = N, D, C
        xmax = np.float32(np.sqrt(float(norms[:N].max())) * (1 + 1e-6))  # max |x|, rounded up
        arrays = (pad.reshape(nC, C, D), norms.reshape(nC, C), np.asarray(datastore.values, np.int32), np.int32(N),
                  xmax)
        if mesh is None:
            arrays = [jax.device_put(x) for x in arrays[:3]] + [jnp.int32(N), jnp.float32(xmax)]
        else:
            from ..core.sharding import replicate

            arrays = replicate(list(arrays), mesh)
        self.keys, self.norms, self.values, self.n_valid, self.xmax = arrays
        self._faiss = {}
        self.fallbacks = 0  # queries the exact search redid by brute force

    # ---- faiss (host)
    def faiss_index(self, kind: str):
        if kind not in self._faiss:
            try:
                import faiss
            except ImportError as e:
                raise ImportError("knn_search=hnsw|flat and knn_speculate=ivf need faiss: pip install faiss-cpu "
                                  "(or the project's `retrieval` extra)") from e
            from .datastore import build_hnsw, build_ivf

            if kind == "ivf":
                self._faiss[kind] = build_ivf(self.datastore, progress=self.size >= 100_000)
            elif kind == "hnsw":
                if not (self.datastore.path / "hnsw.faiss").exists():
                    logging.getLogger("lookahead_jax").warning(
                        "building the faiss HNSW index over %d keys (once: saved in %s; `python -m "
                        "lookahead_jax.knnlm build ... --hnsw` builds it ahead)", self.size, self.datastore.path)
                self._faiss[kind] = build_hnsw(self.datastore, progress=True)
            elif kind == "flat":
                index = faiss.IndexFlatL2(self.dim)
                index.add(np.ascontiguousarray(self.datastore.keys, np.float32))
                self._faiss[kind] = index
            else:
                raise ValueError(f"unknown faiss index {kind!r}: hnsw, flat or ivf")
        return self._faiss[kind]

    def faiss_candidates(self, h: np.ndarray, kind: str, k: int, ef_search: int = 128, nprobe: int = 32) -> np.ndarray:
        """Candidate ids [Q, 2k+8] int32 (-1 = none) from faiss for queries h [Q,D]: kind
        "hnsw" (efSearch >= ef_search), "flat", or "ivf" (the nprobe nearest lists, by the
        index's 8-bit approximate distances: speculation only). Over several processes
        process 0's answer on every process (one broadcast; the others do not search)."""
        fetch = min(self.size, 2 * k + 8)
        out = np.full((len(h), 2 * k + 8), -1, np.int32)
        if jax.process_index() == 0:
            index = self.faiss_index(kind)
            if kind == "hnsw":
                index.hnsw.efSearch = max(ef_search, fetch)
            elif kind == "ivf":
                index.nprobe = min(int(nprobe), index.nlist)
            _, found = index.search(np.ascontiguousarray(h, np.float32), fetch)
            out[:, :fetch] = found
        return broadcast_plan(out)  # (one process: `out` itself)

    def with_ivf(self, base: np.ndarray, h, active, k: int, nprobe: int) -> np.ndarray:
        """Candidates [B, M + 2k+8]: base [B,M] (ids, -1 = none), then the IVF index's
        `faiss_candidates` of the active rows' queries h [B,D] (a host array) less those
        already in the row's base, so that a row's candidates stay distinct."""
        rows = np.flatnonzero(active)
        extra = np.full((len(base), 2 * k + 8), -1, np.int32)
        if len(rows):
            extra[rows] = self.faiss_candidates(h[rows], "ivf", k, nprobe=nprobe)
            for b in rows:
                extra[b][np.isin(extra[b], base[b])] = -1
        return np.concatenate([base, extra], axis=1)


@dataclasses.dataclass
class KnnlmStore:
    """What KNN-LM keeps on an engine across calls (`engine.stores.of(KnnlmStore)`, made on
    first use, kept as long as the engine): the index in use with the identity of the
    datastore it was built from (`engine_index`: one, the last used), and speculative
    KNN-LM's OS3 measurements per datastore and settings (strategies/knnlm_runs.py)."""

    index: Optional[tuple] = None  # (datastore identity, KnnIndex)
    os3: dict = dataclasses.field(default_factory=dict)  # (datastore identity, settings) -> KnnMeasures


def engine_index(engine, datastore, corpus) -> KnnIndex:
    """The KnnIndex of a datastore (a directory, a `Datastore` or None: the model's default,
    checked against `corpus` when given), kept by the engine (one: the last used, in its
    `KnnlmStore`)."""
    from pathlib import Path

    from .datastore import Datastore, StaleDatastore, mismatch, build_command, load_datastore, model_identity

    ds = datastore
    if isinstance(ds, Datastore):
        from ..retrieval.corpus import load_corpus

        corpus = load_corpus(corpus) if corpus is not None else None
        why = mismatch(ds.meta, model_identity(engine.model), corpus)
        if why:
            cmd = build_command(engine.model, corpus, ds.path)
            raise StaleDatastore(f"the KNN-LM datastore at {ds.path} is stale: {why}. Rebuild it with:\n  {cmd}", cmd)
    else:
        ds = load_datastore(engine.model, corpus, ds)
    key = (str(Path(ds.path).resolve()), ds.meta.get("created"), ds.size)
    store = engine.stores.of(KnnlmStore)
    hit = store.index
    if hit is not None and hit[0] == key:
        return hit[1]
    store.index = None  # the old index goes before the new one is built
    index = KnnIndex(ds, mesh=engine.mesh)
    store.index = (key, index)
    return index
