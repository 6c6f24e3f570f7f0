"""Where an admission's time goes, and what a per-step prefill budget does to it: a greedy
stream decodes in `Slots` built as the server builds them (lookahead, 8 slots, a 2,048-slot
cache, log-probabilities, fallback; every program compiled first) while requests with
RAG-length prompts enter one after another (each runs to its end before the next). Every
configuration (`--configs` CHUNK:BUDGET, budget "none" = one prefill block a step, today's
server) runs the same requests in one process, alternated over `--rounds`.

Per configuration: the stream's gaps (an insert and the step after it are one gap: the
engine thread runs both before the stream's next chunk), p50 / p99 / max; each step with a
prefill split into its decode part and its blocks (`block_s`, and per-token block cost);
each arriving request's time to first token (insert to the step whose events carry it).

    python bench/admission.py --out bench/results/admission.json

Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def passage_ids(tok, n: int, k: int) -> list:
    """A RAG-like prompt of n tokens: passages of the repository's data, then a question."""
    lines = (ROOT / "data" / "passages.jsonl").read_text().splitlines()
    text = " ".join(json.loads(x).get("text", "") for x in lines[k * 5:k * 5 + 40])
    q = tok.encode("\nQuestion: what is the passage about? Answer:")
    return tok.encode(text)[:n - len(q)] + q


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def run_config(slots_for, tok, chunk, budget, prompts, stream_tokens):
    """One pass: the stream plus each prompt's request; returns the measurements."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request

    slots = slots_for(chunk, budget)
    blocks = []
    forward = slots._forward_chunks

    def timed_chunks(ss):
        t = time.perf_counter()
        n0 = sum(int(slots.state.lengths[s]) for s in ss)
        forward(ss)
        blocks.append((time.perf_counter() - t, sum(int(slots.state.lengths[s]) for s in ss) - n0))

    slots._forward_chunks = timed_chunks
    slots.insert(0, Request(tok.encode("Write a long story about a robot who learns to paint."), GenerationParams(max_new_tokens=stream_tokens)))
    for _ in range(6):  # the stream alone: its steps' times (the unit of the budget)
        slots.step()
    gaps, alone, steps, ttft = [], [], [], []
    for _ in range(8):
        t = time.perf_counter()
        slots.step()
        alone.append(time.perf_counter() - t)
    for ids in prompts:
        t_in = time.perf_counter()
        blocks.clear()
        slots.insert(1, Request(ids, GenerationParams(max_new_tokens=16)))
        pending = time.perf_counter() - t_in  # the insert holds the stream too
        first = None
        while slots.row(1).finish is None or 1 in slots.prefilling:
            blocks.clear()
            t = time.perf_counter()
            slots.step()
            dt = time.perf_counter() - t
            gaps.append(pending + dt)
            pending = 0.0
            if blocks:
                steps.append(dict(step_s=round(dt, 4), block_s=round(sum(b for b, _ in blocks), 4),
                                  blocks=len(blocks), tokens=sum(n for _, n in blocks)))
            if first is None and 1 not in slots.prefilling and slots.row(1).ids:
                first = time.perf_counter() - t_in
            if slots.row(1).finish is not None and 1 not in slots.prefilling:
                break
        ttft.append(first)
        slots.free(1)
        for _ in range(3):
            t = time.perf_counter()
            slots.step()
            gaps.append(time.perf_counter() - t)
    slots.close()
    per_tok = [s["block_s"] / s["tokens"] for s in steps if s["tokens"]]
    return dict(chunk=chunk, step_budget=budget, stream_step_s=round(statistics.median(alone), 4),
                gap_p50_s=round(percentile(gaps, 0.5), 4), gap_p99_s=round(percentile(gaps, 0.99), 4),
                gap_max_s=round(max(gaps), 4), ttft_s=[round(x, 3) for x in ttft],
                block_ms_per_token=round(statistics.median(per_tok) * 1e3, 2) if per_tok else None,
                prefill_steps=steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[300, 600, 900])
    ap.add_argument("--configs", nargs="+", default=["64:none", "16:none", "16:3", "32:3"],
                    help="CHUNK:BUDGET pairs (BUDGET a multiple of a decode step, or none)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / "bench/results/admission.json"))
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.slots import Slots
    from lookahead_jax.strategies import Lookahead
    from first_run import cpu_name

    enable_compilation_cache()
    model, tok = lj.load(a.model)[:2]
    engine = lj.engine_for(model)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    configs = [(int(c.split(":")[0]), None if c.split(":")[1] == "none" else float(c.split(":")[1]))
               for c in a.configs]

    def slots_for(chunk, budget):
        return Slots(engine, tok, a.max_batch, a.max_len, Lookahead(), logprobs=True, eos_ids=eos,
                     prefill_chunk=chunk, fallback=True, step_budget=budget)

    for chunk in sorted({c for c, _ in configs}):  # every program compiled before anything is timed
        t0 = time.perf_counter()
        s = slots_for(chunk, None)
        s.warm_up(wait="all")
        print(f"chunk {chunk}: warm-up {time.perf_counter() - t0:.1f} s, {len(s.programs())} programs", flush=True)
        s.close()
    prompts = [passage_ids(tok, n, k) for k, n in enumerate(a.prompt_tokens)]
    results = {c: [] for c in configs}
    for r in range(a.rounds + 1):  # round 0 warms every path (not counted)
        for c in configs:
            res = run_config(slots_for, tok, c[0], c[1], prompts, 1500)
            if r:
                results[c].append(res)
            print(f"{'warm-up' if not r else 'round ' + str(r)} chunk {c[0]:3d} budget {c[1]}: gaps p50 "
                  f"{res['gap_p50_s']:.3f} p99 {res['gap_p99_s']:.3f} max {res['gap_max_s']:.3f} s; TTFT "
                  f"{res['ttft_s']}; stream step {res['stream_step_s']:.3f} s; block {res['block_ms_per_token']} "
                  "ms/token", flush=True)
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model,
               max_batch=a.max_batch, max_len=a.max_len, prompt_tokens=a.prompt_tokens,
               configs=[dict(chunk=c[0], step_budget=c[1], rounds=results[c]) for c in configs])
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
