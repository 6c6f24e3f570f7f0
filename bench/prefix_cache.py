"""The prefix cache's time to first token: one passage and three questions, through
`Slots` built as the server builds them (lookahead, `--max-batch` slots, a 2,048-slot cache,
64-token chunks, log-probabilities, fallback; every program compiled first), with the
cache (`--prefix-cache-mb`) and without, alternated over `--rounds` in one process.

Per configuration and round, each request runs alone to its end (the slots idle between
them, so a prompt is prefilled at insert: every block at once): the first question's
time to first token (its passage not cached in either configuration: the cache is emptied
at the start of each round) and the second and third's (passage cached with the cache on),
their tokens (the same with and without: checked), and the cache's counters (hit rate =
hit tokens / queried tokens).

    python bench/prefix_cache.py --out bench/results/prefix-cache.json

Prints a line per round and saves JSON.
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
QUESTIONS = ["\nQuestion: who is the passage about? Answer:", "\nQuestion: where does it take place? Answer:",
             "\nQuestion: what happens first? Answer:"]


def passage_ids(tok, n: int, k: int) -> list:
    """About n tokens of the repository's passages (from line k * 5 on)."""
    lines = (ROOT / "data" / "passages.jsonl").read_text().splitlines()
    text = " ".join(json.loads(x).get("text", "") for x in lines[k * 5:k * 5 + 40])
    return tok.encode(text)[:n]


def one_pass(slots, tok, passage: list, max_new: int) -> dict:
    """The three questions one after another; per request its TTFT (insert to first token:
    an idle slots' insert forwards every block) and tokens."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request

    ttft, tokens = [], []
    for q in QUESTIONS:
        ids = passage + tok.encode(q, add_special_tokens=False)
        t0 = time.perf_counter()
        slots.insert(0, Request(ids, GenerationParams(max_new_tokens=max_new)))
        ttft.append(time.perf_counter() - t0)
        while slots.busy:
            slots.step()
        tokens.append(slots.free(0).ids)
    return dict(ttft_s=[round(x, 4) for x in ttft], tokens=tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--passage-tokens", type=int, default=700)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--prefix-cache-mb", type=float, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefix-cache.json"))
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.prefix_cache import PrefixCache
    from lookahead_jax.core.slots import Slots
    from lookahead_jax.strategies import Lookahead
    from first_run import cpu_name

    enable_compilation_cache()
    model, tok = lj.load(a.model)[:2]
    engine = lj.engine_for(model)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    budget = int(a.prefix_cache_mb * 2 ** 20)

    def slots_for(cache: bool):
        return Slots(engine, tok, a.max_batch, a.max_len, Lookahead(), logprobs=True, eos_ids=eos,
                     prefill_chunk=a.chunk, fallback=True, penalty_rows=True,
                     prefix_cache=budget if cache else None)

    for cache in (False, True):  # every program compiled before anything is timed
        s = slots_for(cache)
        s.warm_up(wait="all")
        engine.compiled.settle()
        s.close()
    passage = passage_ids(tok, a.passage_tokens, 0)
    rows = {False: [], True: []}
    for r in range(a.rounds + 1):  # round 0 warms every path (not counted)
        for cache in ((False, True) if r % 2 else (True, False)):  # alternated: ABBA
            engine.stores.clear(PrefixCache)  # the passage is new to every round
            slots = slots_for(cache)
            res = one_pass(slots, tok, passage, a.max_new_tokens)
            if cache:
                res["counters"] = slots.prefix.cache.summary()
            slots.close()
            if r:
                rows[cache].append(res)
            print(f"{'warm-up' if not r else 'round ' + str(r)} cache {'on ' if cache else 'off'}: TTFT "
                  f"{res['ttft_s']} s", flush=True)
    same = all(x["tokens"] == y["tokens"] for x, y in zip(rows[False], rows[True]))

    def med(cache, i):
        return statistics.median(res["ttft_s"][i] for res in rows[cache])

    summary = dict(
        ttft_first_off_s=med(False, 0), ttft_first_on_s=med(True, 0),
        ttft_cached_on_s=statistics.median([med(True, 1), med(True, 2)]),
        ttft_cached_off_s=statistics.median([med(False, 1), med(False, 2)]), same_tokens=same)
    summary["cached_over_uncached"] = round(summary["ttft_cached_on_s"] / summary["ttft_cached_off_s"], 3)
    c = rows[True][-1]["counters"]
    summary["hit_rate"] = round(c["prefix_cache_hits"] / max(c["prefix_cache_queries"], 1), 3)
    print(json.dumps(summary))
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model, max_batch=a.max_batch,
               max_len=a.max_len, chunk=a.chunk, passage_tokens=len(passage), questions=QUESTIONS,
               summary=summary, rounds={"off": rows[False], "on": rows[True]})
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
