"""What carrying every row's penalties as data costs the server's slots (issue 50):
`Slots(penalty_rows=True)` (the server's: neutral penalties and zero `seen` / `counts` in
every verify and prefill step, `sampling.penalize` under a `lax.cond`) against
`penalty_rows=False` (no penalty fields while no request has penalties), on the same
requests, alternated A B B A per round.

    python bench/penalty_rows.py --out bench/results/penalty-rows.json
    python bench/penalty_rows.py --option scores --out bench/results/scores-on-demand.json

`--option scores`: the same for top / prompt log-probabilities on demand on slots that
return log-probabilities (the server's, `Slots(logprobs=True)`: every step compiled with 20
alternatives and, for a prefill, the prompt's log-probabilities, under a `lax.cond` that no
request here takes) against `DecodeState.scores_on_demand = False` (programs without them).

Each side: fresh `Slots` of `--slots` rows and a `--max-len` cache, `--strategy`
(lookahead or greedy, i.e. plain decoding), `--prefill-chunk` 64 as the server; the
prompts (HumanEval, `--n`) are inserted at once and decoded to EOS or `--max-new` tokens
(stops at EOS: what users get), the drafting stores emptied before every run
(`common.cold_stores`: no run drafts from an earlier run's answers). Both sides are
compiled first (one untimed run each).
Reports per side the median wall seconds of a run, tokens, steps, tokens/s, and checks
that both sides give the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--strategy", default="lookahead", choices=("lookahead", "greedy"))
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="prompts (one per slot, inserted together)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--option", default="penalty_rows", choices=("penalty_rows", "scores"),
                    help="what is carried as data on one side (module docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/penalty-rows.json"))
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from common import cold_stores, dataset_prompts, save
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from lookahead_jax.strategies import Greedy, Lookahead

    enable_compilation_cache()
    model, tok = lj.load(a.model)
    eng = lj.engine_for(model)
    prompts = [tok.encode(t) for t in dataset_prompts("humaneval", a.n)[0]][:a.slots]
    eos = tuple(getattr(tok, "eos_token_ids", ()) or ())

    def run(on: bool):
        cold_stores(model)  # no run drafts from an earlier run's outputs of the same prompts
        strat = Lookahead() if a.strategy == "lookahead" else Greedy()
        kw = dict(penalty_rows=on) if a.option == "penalty_rows" else dict(logprobs=True)
        slots = Slots(eng, tok, a.slots, a.max_len, strat, eos_ids=eos, prefill_chunk=a.prefill_chunk, **kw)
        if a.option == "scores":
            slots.state.scores_on_demand = on
        t0 = time.perf_counter()
        slots.insert(list(range(len(prompts))), [Request(p, GenerationParams(max_new_tokens=a.max_new)) for p in prompts])
        while slots.busy:
            slots.step()
        wall, steps = time.perf_counter() - t0, slots.state.steps
        ids = [slots.free(b).ids for b in range(len(prompts))]
        slots.close()
        return dict(wall_s=wall, steps=steps, tokens=sum(map(len, ids)), ids=ids,
                    compile_s=slots.state.compile_s)

    data = a.option  # the side that carries the option as data
    sides = {data: True, "plain": False}
    for pr in sides.values():  # compiled (and auto calibrated) before anything is timed
        run(pr)
    runs = {k: [] for k in sides}
    for r in range(a.rounds):
        order = ["plain", data] if r % 2 == 0 else [data, "plain"]
        for k in order + order[::-1]:
            runs[k].append(run(sides[k]))
            print(f"round {r} {k:13s} {runs[k][-1]['wall_s']:.2f} s {runs[k][-1]['tokens']} tokens "
                  f"{runs[k][-1]['steps']} steps", flush=True)
    same = all(x["ids"] == runs["plain"][0]["ids"] for k in runs for x in runs[k])
    summary = {}
    for k, xs in runs.items():
        wall = statistics.median(x["wall_s"] for x in xs)
        summary[k] = dict(median_wall_s=round(wall, 3), walls=[round(x["wall_s"], 3) for x in xs],
                          tokens=xs[0]["tokens"], steps=xs[0]["steps"], tokens_per_s=round(xs[0]["tokens"] / wall, 2))
    ratio = summary["plain"]["median_wall_s"] / summary[data]["median_wall_s"]
    result = dict(config=vars(a), same_tokens=same,
                  **{f"speed_ratio_{data}_vs_plain": round(ratio, 3)},
                  note=f"tokens/s of {data} over plain (> 1: {data} faster); runs stop at EOS or "
                       "max_new tokens", **summary)
    print(f"same tokens: {same}; {data} / plain speed: {ratio:.3f} "
          f"(medians {summary[data]['median_wall_s']} vs {summary['plain']['median_wall_s']} s)")
    save(result, a.out)


if __name__ == "__main__":
    main()
