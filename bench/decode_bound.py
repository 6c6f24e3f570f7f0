"""The decode-only ceiling of the server's nq-shared closed loop (issue 53's lookahead + cache target).

`bench/serve.py --prompts nq-shared --concurrency 4 --rate inf` times prefill and decoding
together; a prefix cache can at most take the prefill away. This runs the same measured
prompts (after the same warm-up prompts) through `Slots` built as the server builds them
(4 slots, the server's cache size), kept full as the closed loop keeps them (a request
enters as soon as a slot frees), but with each prompt prefilled whole at insert and that
time kept apart, so the steps are decoding only. Output tokens over the steps' time alone
is what the server could give with a free prefill. No cache can skip the prefill of each
passage's first question, so lookahead's decoding plus that prefill bounds what lookahead
with any prefix cache can reach against greedy without one (its decoding plus every
prefill): `lookahead_cache_ceiling_speedup` (the repeats' uncached tails counted as free,
so a ceiling). Greedy
and lookahead (auto budget, the suffix drafter) alternate over --rounds, each run as a fresh
server's (the drafter's stores emptied, the warm-up prompts first, unmeasured); their tokens
must be equal (a mismatch stops the run).

    python bench/decode_bound.py            # prints and saves bench/results/decode-bound.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cold_stores, host_line, save  # noqa: E402
from serve import nq_shared  # noqa: E402


def run(engine, tok, strategy, prompts, slots_n: int, max_len: int, max_tokens: int, eos, first=None) -> dict:
    """Every prompt through `slots_n` slots kept full: decode tokens, decode s, prefill s (and
    that of the prompts `first` marks: each passage's first question), outputs."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.request import Request
    from lookahead_jax.core.slots import Slots

    slots = Slots(engine, tok, slots_n, max_len, strategy, eos_ids=eos, prefill_chunk=None)
    queue, holder, out = list(enumerate(prompts)), {}, {}
    prefill_s = decode_s = first_s = 0.0
    tokens = steps = 0
    try:
        while queue or slots.busy:
            while queue and slots.free_slots:
                i, ids = queue.pop(0)
                s = slots.free_slots[-1]
                holder[s] = i
                t = time.perf_counter()
                slots.insert(s, Request(ids, GenerationParams(max_new_tokens=max_tokens)))
                dt = time.perf_counter() - t
                prefill_s += dt
                first_s += dt if first is not None and first[i] else 0.0
            t = time.perf_counter()
            events = slots.step()
            decode_s += time.perf_counter() - t
            steps += 1
            for ev in events:
                tokens += len(ev.tokens)
                if ev.finish:
                    out[holder[ev.slot]] = list(slots.free(ev.slot).ids)
    finally:
        slots.close()
    return dict(decode_tokens=tokens, decode_s=decode_s, prefill_s=prefill_s, prefill_first_s=first_s, steps=steps,
                outputs=[out[i] for i in range(len(prompts))])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--slots", type=int, default=4, help="the closed loop's concurrency (default 4)")
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode-bound.json"))
    args = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.prompts import encode_prompts
    from lookahead_jax.serve.server import ServeConfig
    from lookahead_jax.strategies import Lookahead

    enable_compilation_cache()
    print(host_line(), flush=True)
    model, tok = lj.load(args.model, progress=False)
    engine = lj.engine_for(model)
    eos = tuple(sorted(getattr(tok, "eos_token_ids", ()) or ()))
    warm, measured, passages = nq_shared(args.warmup, args.requests)
    first = [p not in passages[:i] for i, p in enumerate(passages)]
    warm_ids = encode_prompts(tok, [m for _, m in warm], chat=True)
    ids = encode_prompts(tok, [m for _, m in measured], chat=True)
    max_len = ServeConfig.max_len
    strategies = {"greedy": lambda: None, "lookahead": Lookahead}
    runs = {name: [] for name in strategies}
    want = None
    for rnd in range(args.rounds):
        for name in (list(strategies) if rnd % 2 == 0 else list(strategies)[::-1]):
            # as bench/serve.py's servers: the drafter's stores emptied, then the warm-up
            # prompts (unmeasured; round 0's also compile every step), then the measured ones
            cold_stores(model)
            strat = strategies[name]()
            run(engine, tok, strat, warm_ids, args.slots, max_len, args.max_tokens, eos)
            r = run(engine, tok, strat, ids, args.slots, max_len, args.max_tokens, eos, first)
            want = want or r["outputs"]
            if r["outputs"] != want:
                sys.exit(f"MISMATCH: {name} round {rnd} gave other tokens than greedy")
            row = {k: v for k, v in r.items() if k != "outputs"}
            row["decode_tokens_per_s"] = round(r["decode_tokens"] / r["decode_s"], 2)
            runs[name].append(row)
            print(f"round {rnd} {name:9s}: {row['decode_tokens_per_s']:7.1f} tok/s decoding only "
                  f"({r['decode_tokens']} tokens in {r['decode_s']:.1f} s, {r['steps']} steps; prefill "
                  f"{r['prefill_s']:.1f} s apart)", flush=True)
    mean = {name: float(np.mean([r["decode_tokens_per_s"] for r in rs])) for name, rs in runs.items()}
    med = lambda name, k: float(np.median([r[k] for r in runs[name]]))  # noqa: E731
    # greedy without a cache: every prompt prefilled, greedy's decoding. The ceiling of any prefix
    # cache under lookahead: lookahead's decoding plus the prefill no cache can skip, each
    # passage's first question (the repeats' own tails, which it cannot skip either, counted as free)
    plain_s = med("greedy", "decode_s") + med("greedy", "prefill_s")
    ceiling_s = med("lookahead", "decode_s") + med("greedy", "prefill_first_s")
    result = dict(host_line=host_line(), model=args.model, slots=args.slots, requests=len(ids), warmup=len(warm_ids),
                  max_tokens=args.max_tokens, max_len=max_len, rounds=args.rounds, runs=runs,
                  decode_tokens_per_s=mean, lookahead_vs_greedy=round(mean["lookahead"] / mean["greedy"], 3),
                  greedy_no_cache_s=round(plain_s, 2), lookahead_cache_ceiling_s=round(ceiling_s, 2),
                  lookahead_cache_ceiling_speedup=round(plain_s / ceiling_s, 3))  # (save adds the command)
    print(f"decoding only, {args.slots} slots: greedy {mean['greedy']:.1f} tok/s, lookahead {mean['lookahead']:.1f} "
          f"tok/s ({result['lookahead_vs_greedy']:.2f}x). Greedy without a cache {plain_s:.1f} s (prefill and "
          f"decoding); lookahead with a perfect cache at least {ceiling_s:.1f} s (its decoding and each passage's "
          f"first prefill): at most {result['lookahead_cache_ceiling_speedup']:.2f}x", flush=True)
    save(result, args.out)
    plot(result, str(Path(args.out).with_suffix(".png")))


def plot(result: dict, path: str) -> None:
    """Bars of seconds: greedy without a cache (prefill + decoding) against lookahead with a
    perfect cache (its decoding + the first questions' prefill)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = lambda name, k: float(np.median([r[k] for r in result["runs"][name]]))  # noqa: E731
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rows = [("greedy, no cache", med("greedy", "decode_s"), med("greedy", "prefill_s")),
            ("lookahead, perfect cache", med("lookahead", "decode_s"), med("greedy", "prefill_first_s"))]
    for y, (name, dec, pre) in enumerate(rows):
        ax.barh(y, dec, color="tab:blue", label="decoding" if y == 0 else None)
        ax.barh(y, pre, left=dec, color="tab:orange", label="prefill" if y == 0 else None)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel(f"seconds for {result['requests']} nq-shared requests, {result['slots']} slots")
    ax.set_title(f"ceiling of lookahead + prefix cache: {result['lookahead_cache_ceiling_speedup']:.2f}x", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, result["host_line"], fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("saved", path)


if __name__ == "__main__":
    main()
