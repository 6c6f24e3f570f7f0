"""The matmuls of one forward alone, for M rows: XLA's dot, our CPU kernel, torch.

A decoder forward over M tokens (M = 1: a greedy step; M = 1 + T: a verify step over a
tree of T drafts) cannot be faster than its weight matmuls. This times exactly those,
with the default model's shapes (random f32 weights, chained as in the model so nothing
runs out of order), with XLA:CPU's dot, with our skinny-matmul kernel on row-major
weights (`models/cpu_kernels`), with it on packed weights (what generation on one CPU
device runs: `runtime_params`) and with torch (what HF runs), so that

* 1 / t(1) bounds greedy tokens/s of an implementation using those matmuls (not the
  machine: reading the weights at full memory bandwidth would be faster still);
* t(M) / t(1) is the price of verifying M - 1 drafts: lookahead gains only when a step
  emits more than t(1 + T) / t(1) tokens on average.

Our real verify step over M = 1 + T tokens (S = 256, length 100) is timed in the same
round-robin, so `model_step_vs_jax_matmuls` (how far our whole step is from its matmuls)
does not depend on the machine's speed drifting between runs.

    python bench/ceiling.py            # prints and saves bench/results/ceiling.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import ROOT, save


def shapes(c):
    N, K, H = c.n_heads, c.n_kv_heads, c.head_dim
    return dict(qkv=(c.d_model, (N + 2 * K) * H), o=(N * H, c.d_model),
                gate_up=(c.d_model, 2 * c.d_ff), down=(c.d_ff, c.d_model))


def time_interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each function, timed in round-robin (the machine's speed drifts)."""
    for f in fns.values():
        f()
        f()
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in ts.items()}


def model_step(model, T: int, S: int = 256, length: int = 100):
    """Our real verify step over 1 + T tokens (T = 0: a greedy step), as a callable."""
    import jax
    import jax.numpy as jnp

    from lookahead_jax.core.acceptance import TokenMatch
    from lookahead_jax.core.drafts import Draft
    from lookahead_jax.core.inputs import StepInputs, StepMode
    from lookahead_jax.core.tree import verify_block
    from lookahead_jax.loading import runtime_params
    from lookahead_jax.models import init_cache
    from lookahead_jax.core.sampling import SamplingParams
    from lookahead_jax.core.verify import jitted_verify_step, window_for

    verify = jitted_verify_step(model.config, TokenMatch(SamplingParams(0.0, 0, 1.0)))
    blk = verify_block(np.zeros(1, np.int32), [Draft([0] * T, list(range(-1, T - 1)))], T)
    x = StepInputs.tree(blk, np.ones(1, bool), jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.int32))
    mode = StepMode(window=window_for(length + 1 + T, S))
    state = {"cache": init_cache(model.config, 1, S)}

    def run():
        cache = state["cache"].replace(length=jnp.full((1,), length, jnp.int32))
        res = verify(runtime_params(model), cache, x, mode=mode)
        jax.block_until_ready(res)
        state["cache"] = res[-1]  # (VerifyOut, cache)

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                    help="tokens per forward (1 + a tree bucket: 1, 2, 4, 8, ...)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench/results/ceiling.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import lookahead_jax as lj

    model = lj.load(a.model)[0]
    cfg = model.config
    layer = shapes(cfg)  # the chain below uses random weights of these shapes
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    rng = np.random.default_rng(0)
    W = [{k: (rng.standard_normal(s, dtype=np.float32) * s[0] ** -0.5) for k, s in layer.items()}
         for _ in range(L)]
    E = rng.standard_normal((V, D), dtype=np.float32) * 0.05
    n_bytes = sum(w.nbytes for lw in W for w in lw.values()) + E.nbytes
    flops_per_row = 2 * n_bytes / 4

    Wj = [{k: jnp.asarray(v) for k, v in lw.items()} for lw in W]
    Ej = jnp.asarray(E)
    Q = cfg.n_heads * cfg.head_dim

    @jax.jit
    def jax_chain(x, Ws, E):
        for p in Ws:
            x = x + (x @ p["qkv"])[:, :Q] @ p["o"]
            g = x @ p["gate_up"]
            x = x + (jax.nn.silu(g[:, :F]) * g[:, F:]) @ p["down"]
        return x @ E.T

    from lookahead_jax.models import cpu_kernels as ck

    @jax.jit
    def kernel_chain(x, Ws, E):  # the same chain through our CPU kernel (what the model uses)
        for p in Ws:
            x = x + ck.matmul(ck.matmul(x, p["qkv"])[:, :Q], p["o"])
            g = ck.matmul(x, p["gate_up"])
            x = x + ck.matmul(jax.nn.silu(g[:, :F]) * g[:, F:], p["down"])
        # the tied output layer: e [V,D] row-major (nt kernel), or packed as e.T like the model's
        return ck.matmul(x, E) if isinstance(E, ck.PackedWeight) else ck.matmul_nt(x, E)

    # packed weights (what generation on one CPU device runs: `runtime_params`)
    Wp = [{k: ck.pack(v) for k, v in lw.items()} for lw in Wj]
    Ep = ck.pack(Ej.T)

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        import os

        torch.set_num_threads(os.cpu_count())
        Wt = [{k: torch.from_numpy(np.ascontiguousarray(v.T)) for k, v in lw.items()} for lw in W]
        Et = torch.from_numpy(E)
        lin = torch.nn.functional.linear

        @torch.no_grad()
        def torch_chain(x):
            for p in Wt:
                x = x + lin(lin(x, p["qkv"])[:, :Q], p["o"])
                g = lin(x, p["gate_up"])
                x = x + lin(torch.nn.functional.silu(g[:, :F]) * g[:, F:], p["down"])
            return lin(x, Et)

    rows = []
    for M in a.rows:
        x = rng.standard_normal((M, D), dtype=np.float32)
        xj = jnp.asarray(x)
        fns = {"jax_ms": lambda: jax.block_until_ready(jax_chain(xj, Wj, Ej)),
               "kernel_ms": lambda: jax.block_until_ready(kernel_chain(xj, Wj, Ej)),
               "packed_ms": lambda: jax.block_until_ready(kernel_chain(xj, Wp, Ep)),
               "model_step_ms": model_step(model, M - 1)}
        if torch is not None:
            xt = torch.from_numpy(x)
            fns["torch_ms"] = lambda: torch_chain(xt)
        r = dict(rows=M, **{k: v * 1e3 for k, v in time_interleaved(fns, a.reps).items()})
        r["model_step_vs_jax_matmuls"] = round(r["model_step_ms"] / r["jax_ms"], 3)
        r["model_step_vs_kernel_matmuls"] = round(r["model_step_ms"] / r["kernel_ms"], 3)
        r["model_step_vs_packed_matmuls"] = round(r["model_step_ms"] / r["packed_ms"], 3)
        r["model_step_ms"] = round(r["model_step_ms"], 2)
        rows.append(r)
    base = rows[0]
    for r in rows:
        for lib in ("jax", "kernel", "packed", "torch"):
            if f"{lib}_ms" in r:
                r[f"{lib}_vs_1_row"] = round(r[f"{lib}_ms"] / base[f"{lib}_ms"], 3)
                r[f"{lib}_gflops"] = round(r["rows"] * flops_per_row / r[f"{lib}_ms"] / 1e6, 1)
                r[f"{lib}_ms"] = round(r[f"{lib}_ms"], 2)
    result = dict(
        model=a.model, weight_mb=round(n_bytes / 1e6, 1), reps=a.reps, rows=rows,
        greedy_ceiling_tok_s=dict(jax=round(1e3 / base["jax_ms"], 1), kernel=round(1e3 / base["kernel_ms"], 1),
                                  packed=round(1e3 / base["packed_ms"], 1),
                                  **({"torch": round(1e3 / base["torch_ms"], 1)} if torch else {})),
        weight_read_gb_s=dict(jax=round(n_bytes / base["jax_ms"] / 1e6, 1),
                              kernel=round(n_bytes / base["kernel_ms"] / 1e6, 1),
                              packed=round(n_bytes / base["packed_ms"] / 1e6, 1)),
    )
    for r in rows:
        print(r)
    print(f"matmuls of one greedy step: {base['jax_ms']:.1f} ms (XLA dot), {base['kernel_ms']:.1f} ms "
          f"(our CPU kernel), {base['packed_ms']:.1f} ms (packed weights) -> at most {result['greedy_ceiling_tok_s']} tok/s for {result['weight_mb']} MB "
          f"of f32 weights ({result['weight_read_gb_s']} GB/s)")
    save(result, a.out)


if __name__ == "__main__":
    main()
