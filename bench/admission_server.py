"""Where a stream's gap goes through the real server (issue 57): the server as
`python -m lookahead_jax.serve --strategy lookahead --max-batch 8` builds it, in this
process (every program compiled first), one greedy stream of `--stream-tokens` open while
`--requests` sampled chat requests with RAG-length prompts (bench/cold_start.py's mixed
load: 120 .. 3,500 characters of passages, every other one with penalties) arrive one
after another. The engine thread's work is timed (each loop turn's admit / insert /
step / deliver / warm, and inside a step the verify step and each prefill block), so the
stream's largest gaps are shown with what the engine thread did during them.

    python bench/admission_server.py --out bench/results/admission-server.json
    python bench/admission_server.py --configs trees=1 trees=0 --rounds 2

`--configs`: `KEY=VALUE,...` server settings alternated in one run (step_budget=K: the
server's --step-budget; prefix_cache_mb=M; prefill_chunk=C; trees=1: a step that carries
a prefill block verifies a speculation tree too (`Slots.trees_while_prefilling`, the
default); trees=0: no tree in such a step, `budget.NoTree`;
insert=0: an insert while others decode forwards no block, the steps take them one each
(`Slots.blocks_at_insert`; insert=1, the default: its first block, two if that ends it). Prints each configuration's
gaps (p50 / p99 / max), the requests' latencies and the top gaps' breakdown; saves JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


class Timeline:
    """Wall-clock intervals (name, t0, t1) of the engine thread's calls."""

    def __init__(self):
        self.spans = []

    def wrap(self, obj, name, label=None):
        fn = getattr(obj, name)
        spans = self.spans

        def timed(*a, **k):
            t = time.time()
            try:
                return fn(*a, **k)
            finally:
                spans.append((label or name, t, time.time()))

        setattr(obj, name, timed)

    def during(self, t0, t1):
        """Seconds per name of the spans overlapping [t0, t1] (clipped)."""
        out = {}
        for n, a, b in self.spans:
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                out[n] = round(out.get(n, 0.0) + hi - lo, 4)
        return out


def instrument(srv, tl: Timeline):
    sched = srv.scheduler
    for n in ("_admit", "_insert", "_step", "_deliver", "_warm", "_free_cancelled"):
        tl.wrap(sched, n)
    orig_new = sched._new_slots

    def new_slots(*a, **k):
        s = orig_new(*a, **k)
        wrap_slots(s, tl)
        return s

    sched._new_slots = new_slots
    wrap_slots(sched.slots, tl)


def wrap_slots(slots, tl: Timeline):
    if getattr(slots, "_timed", False):
        return
    slots._timed = True
    tl.wrap(slots, "_forward_chunks", "block")
    tl.wrap(slots, "_activate", "activate")
    tl.wrap(slots.state, "flush", "flush")
    if slots.prefix is not None:
        tl.wrap(slots.prefix, "fill", "prefix_fill")
        tl.wrap(slots.prefix, "save", "prefix_save")
        tl.wrap(slots.prefix, "ready", "prefix_ready")


def run_config(args, cfg_over: dict, model, tok):
    import cold_start
    from common import cold_stores
    from lookahead_jax.serve import ServeConfig, make_server, start_in_thread

    from lookahead_jax.core.slots import Slots

    over = dict(cfg_over)
    Slots.trees_while_prefilling = bool(over.pop("trees", 1))  # (every Slots the server builds)
    Slots.blocks_at_insert = bool(over.pop("insert", 1))
    cfg = ServeConfig(model=args.model, strategy="lookahead", max_batch=args.max_batch, max_len=2048, **over)
    cold_stores(model)  # (each configuration drafts and caches prefixes from nothing)
    srv = make_server(cfg, model, tok)
    t0 = time.perf_counter()
    srv.scheduler.warm_up()
    warm = time.perf_counter() - t0
    tl = Timeline()
    instrument(srv, tl)
    uv, th, url = start_in_thread(srv)
    a = argparse.Namespace(model=args.model, stream_tokens=args.stream_tokens, mixed_requests=args.requests,
                           mixed_tokens=args.request_tokens)
    t_start = time.time()
    try:
        r = asyncio.run(cold_start.mixed_load(a, url, t_start))
    finally:
        uv.should_exit = True
        th.join()
    ts = [t + t_start for t in r["chunk_t"]]
    gaps = [y - x for x, y in zip(ts, ts[1:])]
    top = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:args.show]
    worst = [dict(gap_s=round(gaps[i], 4), at=round(ts[i] - t_start, 3), engine=tl.during(ts[i], ts[i + 1]))
             for i in top]
    blocks = [(a, b) for n, a, b in tl.spans if n == "block" and ts[0] <= a <= ts[-1]]
    steps = [(a, b) for n, a, b in tl.spans if n == "_step" and ts[0] <= a <= ts[-1]]
    carried = [any(a <= x < b for x, _ in blocks) for a, b in steps]  # a step that forwarded a block
    with_block = [b - a for (a, b), c in zip(steps, carried) if c]
    plain = [b - a for (a, b), c in zip(steps, carried) if not c]
    calls = dict(blocks=len(blocks), block_s_p50=pct([b - a for a, b in blocks], 50),
                 steps_with_blocks=len(with_block), step_with_blocks_s_p50=pct(with_block, 50),
                 steps_without=len(plain), step_without_s_p50=pct(plain, 50))
    return dict(config=cfg_over, warm_up_s=round(warm, 1), chunks=len(ts), calls=calls,
                gap_p50_s=round(pct(gaps, 50), 4), gap_p99_s=round(pct(gaps, 99), 4), gap_max_s=round(max(gaps), 4),
                sampled=r["sampled"], worst=worst,
                engine_total=tl.during(ts[0], ts[-1]))


def parse_config(s: str) -> dict:
    out = {}
    for kv in filter(None, s.split(",")):
        k, v = kv.split("=")
        out[k] = None if v == "none" else float(v) if "." in v else int(v)
    if out.get("step_budget") == 0:
        out["step_budget"] = None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--configs", nargs="+", default=[""])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--stream-tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--request-tokens", type=int, default=32)
    ap.add_argument("--show", type=int, default=5, help="the largest gaps broken down")
    ap.add_argument("--out", default=str(ROOT / "bench/results/admission-server.json"))
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from first_run import cpu_name

    enable_compilation_cache()
    model, tok = lj.load(a.model)[:2]
    results = []
    for r in range(a.rounds):
        for c in a.configs:
            res = run_config(a, parse_config(c), model, tok)
            res["round"] = r + 1
            results.append(res)
            print(f"round {r + 1} {c or 'default'}: gaps p50 {res['gap_p50_s']} p99 {res['gap_p99_s']} max "
                  f"{res['gap_max_s']} s over {res['chunks']} chunks; requests "
                  f"(prompt tokens, TTFT, latency) {[(s['prompt_tokens'], s['ttft_s'], s['latency_s']) for s in res['sampled']]}",
                  flush=True)
            print(f"   engine calls while streaming: {res['calls']}", flush=True)
            for w in res["worst"]:
                print(f"   gap {w['gap_s']:.3f} s at {w['at']}: {w['engine']}", flush=True)
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model, runs=results)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
