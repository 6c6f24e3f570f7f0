"""Our jitted greedy vs HF transformers greedy: same model, same prompts, same tokens.

    python bench/baseline.py                       # SmolLM2-135M, 8 NQ chat prompts, f32+bf16
    python bench/baseline.py --n 4 --dtypes float32 --max-new-tokens 64
    python bench/baseline.py --ignore-eos          # fixed length: baseline-fixedlen.json

Prompts are NQ RAG chat prompts (passage + question) from ../shared/data. Each prompt is
run by us and by HF alternately (so machine noise hits both alike), fed the same token ids;
both stop at EOS (our tokenizer's `eos_token_ids`, given to HF too), up to
`--max-new-tokens` tokens, timed the same way, end to end (prefill included; our
compilation excluded and reported separately). Tokens/s count the tokens each emitted;
HF's tokens are compared with ours (identical sequences and the identical prefix length
are counted; near-ties can differ across libraries). `--ignore-eos` generates exactly
`--max-new-tokens` tokens (a separate result, `stop_at_eos: false`). Prints and saves JSON
with the host (CPU model, cores, jax/torch versions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HFPeer, dataset_prompts, default_out, eos_mode, host_line, save  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="at most (stops at EOS unless --ignore-eos)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="fixed length past EOS (a separate result, default output baseline-fixedlen.json)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true", help="skip the HF peer")
    ap.add_argument("--out", help="default bench/results/baseline.json (baseline-fixedlen.json with --ignore-eos)")
    a = ap.parse_args(argv)
    a.out = a.out or default_out("baseline", a.ignore_eos)
    ie = a.ignore_eos

    import lookahead_jax as lj
    from lookahead_jax.prompts import encode_prompts
    from lookahead_jax.fetch import gguf_path

    print(host_line(), f"| {eos_mode(ie)}", flush=True)

    result = dict(model=a.model, prompts=a.n, max_new_tokens=a.max_new_tokens, stop_at_eos=not ie, runs={})
    for dtype in a.dtypes:
        model, tok = lj.load(a.model, dtype=dtype)
        eos_ids = None if ie else sorted(getattr(tok, "eos_token_ids", ()) or ())  # what generate stops at
        result["eos_token_ids"] = eos_ids
        prompts, _ = dataset_prompts("nq", a.n)
        ids = encode_prompts(tok, prompts, chat=False)  # chat messages use the template
        hf = None if a.no_hf else HFPeer(gguf_path(a.model), dtype)
        # warm-up: compile our shapes, and let torch settle
        lj.generate(model, tok, [ids[0]], max_new_tokens=a.max_new_tokens, ignore_eos=True)
        if hf:
            hf.generate(ids[0], 8)
        ours, theirs, same, identical = [], [], [], 0
        tot = dict(ours_tokens=0, ours_s=0.0, hf_tokens=0, hf_s=0.0)
        lengths = []
        compile_s = 0.0
        for i, x in enumerate(ids):
            out = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie)
            mine = out.rows[0].token_ids
            compile_s += out.stats["compile_s"]
            ours.append(out.stats["new_tokens"] / out.stats["wall_s"])
            tot["ours_tokens"] += out.stats["new_tokens"]
            tot["ours_s"] += out.stats["wall_s"]
            lengths.append(len(mine))
            line = f"[{dtype}] prompt {i} ({len(x)} tok -> {len(mine)}): ours {ours[-1]:.1f} tok/s"
            if hf:
                toks, dt = hf.generate(x, a.max_new_tokens, eos_ids=eos_ids)
                theirs.append(len(toks) / dt)
                tot["hf_tokens"] += len(toks)
                tot["hf_s"] += dt
                # tokens equal up to the first divergence (near-ties differ across libraries)
                n = next((k for k, (p, q) in enumerate(zip(mine, toks)) if p != q), min(len(mine), len(toks)))
                same.append(n)
                identical += toks == mine
                line += (f" | HF {theirs[-1]:.1f} tok/s ({len(toks)} tok) | "
                         + ("identical" if toks == mine else f"first {n} tokens identical"))
            print(line, flush=True)
        run = dict(
            ours_tokens_per_s=tot["ours_tokens"] / tot["ours_s"],  # tokens emitted / time, all prompts
            ours_mean_per_prompt_tokens_per_s=statistics.mean(ours), ours_per_prompt=ours,
            new_tokens=tot["ours_tokens"], new_tokens_per_prompt=lengths,
            ours_compile_s_after_warmup=compile_s,
        )
        if hf:
            hf_tps = tot["hf_tokens"] / tot["hf_s"]
            run.update(hf_tokens_per_s=hf_tps, hf_mean_per_prompt_tokens_per_s=statistics.mean(theirs),
                       hf_per_prompt=theirs, hf_new_tokens=tot["hf_tokens"],
                       speedup_vs_hf=run["ours_tokens_per_s"] / hf_tps,
                       identical_to_hf=f"{identical}/{len(ids)}", identical_prefix_tokens=same)
        result["runs"][dtype] = run
        print(f"[{dtype}] ours {run['ours_tokens_per_s']:.1f} tok/s"
              + (f", HF {run['hf_tokens_per_s']:.1f} tok/s, ratio {run['speedup_vs_hf']:.2f}x" if hf else ""))
        del model, hf
    save(result, a.out)


if __name__ == "__main__":
    main()
