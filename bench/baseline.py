"""Our jitted greedy vs HF transformers greedy: same model, same prompts, same tokens.

    python bench/baseline.py                       # SmolLM2-135M, 8 NQ chat prompts, f32+bf16
    python bench/baseline.py --n 4 --dtypes float32 --max-new-tokens 64

Prompts are NQ RAG chat prompts (passage + question) from ../shared/data. Each prompt is
run by us and by HF alternately (so machine noise hits both alike); both generate exactly
`--max-new-tokens` tokens (EOS ignored), timed end to end (prefill included, our
compilation excluded and reported separately). Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HFPeer, dataset_prompts, save  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-hf", action="store_true", help="skip the HF peer")
    ap.add_argument("--out", default="bench/results/baseline.json")
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.generate import encode_prompts
    from lookahead_jax.fetch import gguf_path

    result = dict(model=a.model, prompts=a.n, max_new_tokens=a.max_new_tokens, runs={})
    for dtype in a.dtypes:
        model, tok = lj.load(a.model, dtype=dtype)
        prompts, _ = dataset_prompts("nq", a.n)
        ids = encode_prompts(tok, prompts, chat=False)  # chat messages use the template
        hf = None if a.no_hf else HFPeer(gguf_path(a.model), dtype)
        # warm-up: compile our shapes, and let torch settle
        lj.generate(model, tok, [ids[0]], max_new_tokens=a.max_new_tokens, ignore_eos=True)
        if hf:
            hf.generate(ids[0], 8)
        ours, theirs, same = [], [], []
        compile_s = 0.0
        for i, x in enumerate(ids):
            out = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=True)
            compile_s += out.stats["compile_s"]
            ours.append(out.stats["new_tokens"] / out.stats["wall_s"])
            line = f"[{dtype}] prompt {i} ({len(x)} tok): ours {ours[-1]:.1f} tok/s"
            if hf:
                toks, dt = hf.generate(x, a.max_new_tokens)
                theirs.append(len(toks) / dt)
                # tokens equal up to the first divergence (near-ties differ across libraries)
                n = next((k for k, (p, q) in enumerate(zip(out.token_ids[0], toks)) if p != q), len(toks))
                same.append(n)
                line += f" | HF {theirs[-1]:.1f} tok/s | first {n} tokens identical"
            print(line, flush=True)
        run = dict(
            ours_tokens_per_s=statistics.mean(ours), ours_per_prompt=ours,
            ours_compile_s_after_warmup=compile_s,
        )
        if hf:
            run.update(hf_tokens_per_s=statistics.mean(theirs), hf_per_prompt=theirs,
                       speedup_vs_hf=statistics.mean(ours) / statistics.mean(theirs),
                       identical_prefix_tokens=same)
        result["runs"][dtype] = run
        print(f"[{dtype}] ours {run['ours_tokens_per_s']:.1f} tok/s"
              + (f", HF {run['hf_tokens_per_s']:.1f} tok/s, ratio {run['speedup_vs_hf']:.2f}x" if hf else ""))
        del model, hf
    save(result, a.out)


if __name__ == "__main__":
    main()
