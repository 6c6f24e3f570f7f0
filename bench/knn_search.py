"""Micro-benchmark of the KNN-LM exact search (`knnlm.search.exact_search`): one query
against batches of Q queries over a random float16 store, the figure being the ratio
batch-Q / batch-1 (speculative KNN-LM verifies a round's queries in one batched search).
Both shortlist passes are timed in the same rounds: the CPU kernel ("kernel", what
exact_search runs on CPU) and the XLA scan ("xla", kernel=False; what it ran before).

    nice -n 5 python bench/knn_search.py                  # N = 1,000,000, D = 576, k = 32
    nice -n 5 python bench/knn_search.py --n 200000 --runs 3

The store is random (seed fixed), queries are stored keys plus small noise (their
neighbours are real near-ties, as in a datastore of hidden states). Batch sizes are timed
alternately (batch 1, 2, 4, 8, batch 1, ...), the median of `--runs` rounds reported:
absolute times on a shared host are noisy, the ratios measured side by side less so.
Each batch's ids are checked against the same queries searched one at a time, and the
two paths' ids against each other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, host_line, save  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="store entries")
    ap.add_argument("--dim", type=int, default=576, help="key width D (SmolLM2-135M: 576)")
    ap.add_argument("--k", type=int, default=32, help="neighbours (the strategy's default knn_k)")
    ap.add_argument("--batches", default="1,2,4,8", help="query batch sizes Q")
    ap.add_argument("--runs", type=int, default=5, help="alternating rounds (median reported)")
    ap.add_argument("--noise", type=float, default=0.05, help="query = stored key + noise * N(0,1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "knn-search.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from lookahead_jax.knnlm.search import KnnIndex, exact_search

    print(host_line())
    rng = np.random.default_rng(args.seed)
    keys = np.empty((args.n, args.dim), np.float16)
    for s in range(0, args.n, 65536):  # bounded float32 temporaries
        keys[s:s + 65536] = rng.standard_normal((min(65536, args.n - s), args.dim), np.float32)
    store = SimpleNamespace(keys=keys, values=np.zeros(args.n, np.int32), path=None)
    t0 = time.perf_counter()
    idx = KnnIndex(store)
    del store, keys
    print(f"store: {args.n} x {args.dim} float16, chunks {idx.keys.shape}, index in {time.perf_counter() - t0:.1f} s")

    batches = [int(b) for b in args.batches.split(",")]
    Qmax = max(batches)
    src = rng.integers(0, args.n, Qmax)
    host_keys = np.asarray(idx.keys).reshape(-1, args.dim)
    hq = (host_keys[src].astype(np.float32) + args.noise * rng.standard_normal((Qmax, args.dim), np.float32))
    del host_keys

    paths = ("kernel", "xla")

    def search(Q, path, q0=0):
        ids, ok = exact_search(idx.keys, jnp.asarray(hq[q0:q0 + Q]), idx.norms, idx.n_valid, idx.xmax, k=args.k,
                               kernel=path == "kernel")
        return np.asarray(ids), np.asarray(ok)

    for path in paths:  # compile every shape; check each batch against one-at-a-time answers
        for Q in batches:
            t0 = time.perf_counter()
            search(Q, path)
            print(f"{path} Q={Q}: compiled and ran in {time.perf_counter() - t0:.1f} s")
    single = {p: np.concatenate([search(1, p, q)[0] for q in range(Qmax)]) for p in paths}
    all_ok, same = True, bool(np.array_equal(single["kernel"], single["xla"]))
    for path in paths:
        for Q in batches:
            ids, ok = search(Q, path)
            all_ok &= bool(ok.all())
            same &= bool(np.array_equal(ids, single[path][:Q]))
    print(f"batched ids equal one-at-a-time and kernel ids equal xla ids: {same}; ok (no brute-force fallback) "
          f"everywhere: {all_ok}")

    times = {(p, Q): [] for p in paths for Q in batches}
    for _ in range(args.runs):
        for Q in batches:
            for path in paths:
                t0 = time.perf_counter()
                search(Q, path)
                times[path, Q].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"\n{'path':>6} {'Q':>3} {'median s':>9} {'x batch 1':>10} {'per query s':>12} {'x xla':>6}")
    for path in paths:
        for Q in batches:
            m = med[path, Q]
            print(f"{path:>6} {Q:>3} {m:>9.3f} {m / med[path, batches[0]]:>10.2f} {m / Q:>12.3f} "
                  f"{m / med['xla', Q]:>6.2f}")

    def figures(path):
        return dict(median_s={str(Q): round(med[path, Q], 4) for Q in batches},
                    ratio_to_batch1={str(Q): round(med[path, Q] / med[path, batches[0]], 3) for Q in batches},
                    times_s={str(Q): [round(t, 4) for t in times[path, Q]] for Q in batches})

    save(dict(n=args.n, dim=args.dim, k=args.k, chunk=idx.chunk, runs=args.runs, noise=args.noise,
              seed=args.seed, batched_equals_single=same, all_ok=all_ok, **figures("kernel"), xla=figures("xla")),
         args.out)


if __name__ == "__main__":
    main()
