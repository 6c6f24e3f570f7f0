"""Plain decoding with K steps per device call (`Greedy(device_steps=K)`) vs one step per
call: same model, same prompts, same tokens (checked), stopping at EOS.

    python bench/device_steps.py                         # 4 prompts x 3 datasets, K = 1, 8, 32
    python bench/device_steps.py --ks 1 16 --n 2 --datasets nq

Per prompt the K values run in turn, alternated ABBA over `--repeats` (the host's speed
drifts), each as a `generate` call on one warm engine (compilation excluded: a first
unmeasured call per K compiles its steps). Reported per dataset and K: decode tokens/s
(tokens after the first over the time after the first token), end-to-end tokens/s,
forward steps, and the speedup over K = 1. The gain is the host's per-step work and the
device round trip that a while loop on the device saves: small on a CPU, where a step is
tens of ms of compute; the reason for it on a GPU, where a small model's step is mostly
launch and synchronisation overhead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bar_plot, dataset_prompts, default_out, eos_mode, host_line, save  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datasets", nargs="+", default=["nq", "humaneval", "gsm8k"])
    ap.add_argument("--n", type=int, default=4, help="prompts per dataset")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 8, 32], help="device_steps values (first: the reference)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=default_out("device-steps", False))
    args = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.strategies import Greedy

    print(host_line())
    model, tok = lj.load(args.model, progress=False)
    engine = lj.engine_for(model)
    result = dict(model=args.model, ks=args.ks, max_new_tokens=args.max_new_tokens, stop_at_eos=True,
                  prompts_per_dataset=args.n, repeats=args.repeats, length_mode=eos_mode(False), datasets={})

    def run(prompt, k):
        out = lj.generate(engine, tok, [prompt], max_new_tokens=args.max_new_tokens, strategy=Greedy(device_steps=k),
                          chat=not isinstance(prompt, str))
        return out.rows[0].token_ids, out.stats["wall_s"], out.stats  # generate's wall: compilation excluded

    identical = True
    for ds in args.datasets:
        prompts, _ = dataset_prompts(ds, args.n)
        for k in args.ks:  # compile every K's steps first (unmeasured)
            run(prompts[0], k)
        per = {k: dict(tokens=0, wall=0.0, decode_tokens=0, decode_s=0.0, steps=0) for k in args.ks}
        for i, p in enumerate(prompts):
            want = None
            for rep in range(args.repeats):
                for k in (args.ks if rep % 2 == 0 else args.ks[::-1]):
                    ids, wall, st = run(p, k)
                    want = ids if want is None else want
                    identical &= ids == want
                    a = per[k]
                    a["tokens"] += len(ids)
                    a["wall"] += wall
                    a["decode_tokens"] += max(0, len(ids) - 1)
                    a["decode_s"] += max(0.0, wall - st["ttft_s"])
                    a["steps"] += st["forward_steps"]
            print(f"{ds} prompt {i}: {len(want)} tokens, identical so far: {identical}", flush=True)
        methods = {}
        for k in args.ks:
            a = per[k]
            methods[f"K={k}"] = dict(tokens_per_s=round(a["tokens"] / a["wall"], 2),
                                     decode_tokens_per_s=round(a["decode_tokens"] / max(a["decode_s"], 1e-9), 2),
                                     forward_steps=a["steps"] // args.repeats, tokens=a["tokens"] // args.repeats)
        ref = methods[f"K={args.ks[0]}"]
        for m in methods.values():
            m["speedup_vs_k1"] = round(m["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 3)
        result["datasets"][ds] = dict(methods=methods)
        print(ds, {m: (v["decode_tokens_per_s"], v["speedup_vs_k1"]) for m, v in methods.items()}, flush=True)
    result["identical_tokens"] = bool(identical)
    print(f"tokens identical across K: {identical}")
    save(result, args.out)
    bar_plot(result, str(Path(args.out).with_suffix(".png")), f"{args.model} greedy, K steps per device call",
             key="decode_tokens_per_s", ylabel="decode tokens / s")


if __name__ == "__main__":
    main()
