"""Warm decode speed of two checkouts, alternated: the CLI's greedy and lookahead runs on
the first `--n` prompts of a prompts file, each a fresh process with the checkout as its
working directory (its own `lookahead_jax`), the compilation caches warm (a first pass per
checkout and strategy fills them and is not counted). Reports the summary's decode time
(`wall_s`: compilation excluded) and tokens per second, median over `--rounds`, and checks
that both checkouts give the same tokens.

    git worktree add /tmp/old <commit>
    python bench/ab_trees.py --trees . /tmp/old --rounds 2 --out bench/results/ab-trees.json

Caveat: with the package installed editable, `lookahead_jax.models` (the `models/` folder,
the CPU kernels) is the installed checkout's for both sides; only `lookahead_jax` itself
(core, drafters, strategies, generate) is the checkout's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from first_run import cpu_name

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, prompts: Path, strategy: str, max_new: int) -> dict:
    args = ["--prompts-file", str(prompts), "--max-new-tokens", str(max_new), "--strategy", strategy, "--json"]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.generate", *args], cwd=tree, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{tree}: {strategy} failed:\n{p.stderr[-2000:]}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    s = lines[-1]["summary"]
    return dict(process_s=round(time.perf_counter() - t0, 2), decode_s=s["wall_s"], compile_s=s["compile_s"],
                tokens=s["new_tokens"], tok_s=round(s["new_tokens"] / s["wall_s"], 2),
                ids=[x.get("token_ids") for x in lines[:-1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, help="the new checkout, then the old one")
    ap.add_argument("--prompts-file", default=str(ROOT / "data" / "humaneval_sample.jsonl"))
    ap.add_argument("--n", type=int, default=6, help="the first n prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ab-trees.json"))
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in a.trees]
    lines = Path(a.prompts_file).read_text().splitlines()[:a.n]
    prompts = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    runs = {(t.name or str(t), s): [] for t in trees for s in ("greedy", "lookahead")}
    for t in trees:  # warm the caches (not counted)
        for s in ("greedy", "lookahead"):
            run(t, prompts, s, a.max_new_tokens)
    for r in range(a.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for s in ("greedy", "lookahead"):
            for t in order:
                out = run(t, prompts, s, a.max_new_tokens)
                runs[(t.name or str(t), s)].append(out)
                print(f"round {r} {t} {s}: decode {out['decode_s']:.2f} s, {out['tok_s']} tok/s", flush=True)
    ids = {k: v[0]["ids"] for k, v in runs.items()}
    same = len({json.dumps(x) for x in ids.values()}) == 1
    summary = {f"{k[0]} {k[1]}": dict(tok_s_median=statistics.median(x["tok_s"] for x in v),
                                      decode_s=[x["decode_s"] for x in v]) for k, v in runs.items()}
    for k, v in summary.items():
        print(f"{k}: {v['tok_s_median']} tok/s (decode s {v['decode_s']})")
    print("same tokens on both checkouts and strategies:", same)
    Path(a.out).write_text(json.dumps(dict(host=cpu_name(), command=" ".join(sys.argv), trees=[str(t) for t in trees],
                                           n=a.n, max_new_tokens=a.max_new_tokens, same_tokens=same, summary=summary,
                                           runs={f"{k[0]} {k[1]}": [{x: y for x, y in r.items() if x != "ids"}
                                                                     for r in v] for k, v in runs.items()}),
                                      indent=1))


if __name__ == "__main__":
    main()
