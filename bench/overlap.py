"""The overlapped decode loop vs the plain one (`generate(overlap=True)`: the budget's scoring
and the suffix / trie drafter's store update run while the next step computes), interleaved in
one process on one model: NQ RAG prompts (chat, their passages as references), lookahead
with the auto budget.

    python bench/overlap.py                       # batch 1 and 16, 64 tokens, 3 rounds
    python bench/overlap.py --batches 16 --rounds 5

Each batch is warmed up once per side (compilation, calibration), then every round runs
off and on in alternating order (ABBA), each with the engine's drafting stores emptied first
(`common.cold_stores`; before, every run drafted from the earlier runs' outputs of the same
prompts: `overlap.json` was measured so). Reported per batch and side: decode wall
(generate's wall_s), host_s (the loop's host work), forward steps, and whether the tokens
equal the plain loop's; the spread is the min / median / max over rounds
(the host is shared). Saves JSON with the host to bench/results/overlap.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cold_stores, dataset_prompts, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/overlap.json")
    args = ap.parse_args()
    from lookahead_jax import load
    from lookahead_jax.generate import generate

    model, tok = load(args.model)
    result = dict(model=args.model, tokens=args.tokens, rounds=args.rounds, batches={})
    for B in [int(b) for b in args.batches.split(",")]:
        prompts, refs = dataset_prompts("nq", B)
        kw = dict(max_new_tokens=args.tokens, strategy="lookahead", chat=True, references=refs)
        for ov in (False, True):  # warm-up: compilation and calibration, untimed
            generate(model, tok, prompts, overlap=ov, **kw)
        runs = {False: [], True: []}
        for r in range(args.rounds):
            for ov in ((False, True) if r % 2 == 0 else (True, False)):
                cold_stores(model)  # no run drafts from an earlier run's outputs of these prompts
                o = generate(model, tok, prompts, overlap=ov, **kw)
                runs[ov].append(dict(wall_s=o.stats["wall_s"], host_s=o.stats["host_s"],
                                     steps=o.stats["forward_steps"], tokens=o.token_ids))
        ref = runs[False][0]["tokens"]
        row = {}
        for ov, name in ((False, "off"), (True, "on")):
            rs = runs[ov]
            row[name] = {k: dict(min=min(x[k] for x in rs), median=statistics.median(x[k] for x in rs),
                                 max=max(x[k] for x in rs)) for k in ("wall_s", "host_s", "steps")}
            row[name]["same_tokens"] = all(x["tokens"] == ref for x in rs)
            print(f"batch {B:3d} overlap {name:3s}: wall {row[name]['wall_s']['median']:.2f} s "
                  f"[{row[name]['wall_s']['min']:.2f}, {row[name]['wall_s']['max']:.2f}]  "
                  f"host {row[name]['host_s']['median']:.3f} s  steps {row[name]['steps']['median']}  "
                  f"same tokens {row[name]['same_tokens']}", flush=True)
        result["batches"][B] = row
    save(result, args.out)


if __name__ == "__main__":
    main()
