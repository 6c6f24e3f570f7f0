"""Where a greedy token's time goes, ours vs HF transformers (torch): prefill and decode step.

    python bench/step_profile.py                                # Qwen2.5-Coder-1.5B f32
    python bench/step_profile.py --model smollm2-135m --lengths 64 512

For each prompt length P (a real prompt's ids, cut to P tokens), same model weights (the
GGUF dequantized to f32 for both), alternating ours and HF's in rounds (the machine's
speed drifts): the prefill (one forward over P tokens, first token picked) and the
decode step (ms per token over the next `--steps` tokens, EOS ignored so both run the
same number of steps), each the median over `--reps` rounds. Both run what users run:
our `generate` (the jitted prefill / verify step on packed weights, compilation excluded)
and HF's `model.generate` (use_cache=True, greedy).

A decode step must read every weight once but the input embedding table (it gathers one
row of it): those bytes over the step time are the effective read bandwidth, set beside a measured streaming read of `--stream-gb` GB (torch
sum over a f32 tensor: the machine's practical ceiling for a step that is bandwidth
bound). The prefill is compute bound: its GFLOP/s (2 x layer params x P; the head runs
for the last token only) are reported.
Prints and saves JSON (default bench/results/step-profile.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HFPeer, dataset_prompts, host_line, model_gguf, save  # noqa: E402


def stream_read_gbps(gb: float, reps: int = 5) -> float:
    """Practical memory read bandwidth: torch's multi-threaded sum over `gb` GB of f32."""
    import torch

    x = torch.ones(int(gb * 2**30 / 4), dtype=torch.float32)
    x.sum()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(ts) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256], help="prompt lengths P")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream-gb", type=float, default=2.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "step-profile.json"))
    a = ap.parse_args(argv)

    import jax

    import lookahead_jax as lj

    print(host_line(), flush=True)
    model, tok = lj.load(a.model, dtype="float32")
    engine = lj.engine_for(model)
    engine.keep_packed_only()  # one copy of our weights; HF holds its own
    # what a decode step reads: every weight but the embedding table (one row gathered;
    # a tied head reads its own packed copy, `packed_head`)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params)) - model.params["embed"].nbytes
    hf = HFPeer(model_gguf(a.model), "float32")
    n_params = sum(p.numel() for p in hf.model.parameters())  # tied embeddings counted once
    hf_bytes = 4 * (n_params - hf.model.get_input_embeddings().weight.numel())
    layer_params = sum(x.size for x in jax.tree.leaves(model.params["layers"]))  # prefill FLOPs: 2 x these x P

    prompts, _ = dataset_prompts("humaneval", 4, max_chars=20000)
    pool = [t for p in prompts for t in tok.encode(p)]
    while len(pool) < max(a.lengths):
        pool = pool + pool
    res = dict(model=a.model, dtype="float32", n_params=n_params, step_read_bytes=weight_bytes, hf_step_read_bytes=hf_bytes,
               steps=a.steps, reps=a.reps, lengths={})
    for P in a.lengths:
        ids = pool[:P]
        # warm-up: compile our prefill bucket and steps, let torch settle
        lj.generate(model, tok, [ids], max_new_tokens=1 + a.steps, ignore_eos=True)
        hf.generate(ids, 2)
        ours_pre, ours_step, hf_pre, hf_step = [], [], [], []
        all_same = True
        for r in range(a.reps):
            out = lj.generate(model, tok, [ids], max_new_tokens=1 + a.steps, ignore_eos=True)
            s = out.stats
            ours_pre.append(s["prefill_s"])
            ours_step.append((s["wall_s"] - s["prefill_s"]) / a.steps)
            t1 = hf.generate(ids, 1)[1]
            toks, tn = hf.generate(ids, 1 + a.steps)
            hf_pre.append(t1)
            hf_step.append((tn - t1) / a.steps)
            same = toks == out.rows[0].token_ids
            all_same &= same
            print(f"  P={P} round {r}: ours prefill {s['prefill_s']:.3f}s step {1e3 * ours_step[-1]:.1f}ms | "
                  f"HF prefill {t1:.3f}s step {1e3 * hf_step[-1]:.1f}ms | same tokens: {same}", flush=True)
        op, os_, hp, hs = (statistics.median(v) for v in (ours_pre, ours_step, hf_pre, hf_step))
        def side(pre, step, nbytes):
            return dict(prefill_s=round(pre, 4), step_ms=round(1e3 * step, 2),
                        prefill_gflops=round(2 * layer_params * P / pre / 1e9, 1),
                        step_read_gbps=round(nbytes / step / 1e9, 2))

        res["lengths"][P] = dict(
            ours=side(op, os_, weight_bytes), hf=side(hp, hs, hf_bytes),
            hf_over_ours_step_time=round(hs / os_, 3), hf_over_ours_prefill_time=round(hp / op, 3),
            same_tokens=all_same)
        print(f"P={P}: ours prefill {op:.3f}s, step {1e3 * os_:.1f}ms | HF prefill {hp:.3f}s, "
              f"step {1e3 * hs:.1f}ms (HF/ours: step {hs / os_:.2f}, prefill {hp / op:.2f})", flush=True)
    res["stream_read_gbps"] = round(stream_read_gbps(a.stream_gb), 2)
    res["step_floor_ms_at_stream_bandwidth"] = round(1e3 * weight_bytes / (res["stream_read_gbps"] * 1e9), 1)
    print(f"streaming read {res['stream_read_gbps']} GB/s: a step reading {weight_bytes / 1e9:.2f} GB "
          f"takes >= {res['step_floor_ms_at_stream_bandwidth']} ms", flush=True)
    save(res, a.out)


if __name__ == "__main__":
    main()
