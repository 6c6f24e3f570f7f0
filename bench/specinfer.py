"""SpecInfer (a draft model's token tree) vs our greedy, lookahead, and HF transformers.

    python bench/specinfer.py                                   # Qwen2.5-Coder 0.5B -> 1.5B, 3 prompts x 3 datasets
    python bench/specinfer.py --n 1 --max-new-tokens 32 --no-hf # quick look
    python bench/specinfer.py --target smollm2-135m --draft PATH --no-hf   # a distilled draft

Same target (f32), same prompts and token ids for every method; generation stops at EOS
(`--ignore-eos`: a fixed length, a separate labelled result). Per prompt the methods run
one after another, in one process, so the machine's drift hits them alike:

  greedy            our plain greedy decoding (run before and after the others; its time
                    is the mean of the two)
  specinfer[E]      greedy SpecInfer with expansion E (token-identical to greedy: checked)
  lookahead[C]      the n-gram trie (decoding_length:branch_length)
  merged[N]         SpecInfer's draft tree + N nodes of lookahead's trie merged into it
                    (SpecInfer(lookahead_nodes=N)), greedy
  sample            plain sampling at --temperature (the reference of the two below)
  specinfer-mss     exact speculative sampling (the target's distribution)
  specinfer-inv     drafter-invariant sampling (token-identical to `sample`: checked)
  hf_greedy         HF transformers greedy, and hf_assisted: HF assisted generation with
                    the same draft model (num_assistant_tokens = the tree depth), both in
                    their own process (weights dequantized from the same GGUF files), fed
                    the same token ids and EOS ids; `--no-hf` skips them.

Reported per dataset and method: tokens/s, forward steps, accepted tokens per step, the
draft's time per step, speedups vs our greedy and vs HF greedy / assisted. Saves JSON
(command, host CPU) and a bar plot. Memory: the target and the draft keep only their
packed weights (`Engine.keep_packed_only`): the 1.5B target + 0.5B draft take ~10 GB, the HF
process as much again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bar_plot, dataset_prompts, default_out, eos_mode, host_line, model_gguf, save  # noqa: E402


# ----------------------------------------------------------------------------- HF worker
def hf_worker(target_gguf: str, draft_gguf: str, dtype: str) -> None:
    """Reads JSON lines {ids, max_new, eos, assisted, draft_tokens}; answers {tokens, seconds}."""
    from common import HFPeer

    peer = HFPeer(target_gguf, dtype)
    draft = HFPeer(draft_gguf, dtype) if draft_gguf else None
    torch = peer.torch
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        x = torch.tensor([req["ids"]])
        kw = dict(max_new_tokens=req["max_new"], do_sample=False, use_cache=True, pad_token_id=0)
        if req["eos"]:
            kw["eos_token_id"] = req["eos"]
        if req["assisted"]:
            draft.model.generation_config.eos_token_id = None
            kw.update(assistant_model=draft.model)
            peer.model.generation_config.num_assistant_tokens = req["draft_tokens"]
            peer.model.generation_config.num_assistant_tokens_schedule = "constant"
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = peer.model.generate(x, **kw)
            dt = time.perf_counter() - t0
        print(json.dumps({"tokens": out[0, len(req["ids"]):].tolist(), "seconds": dt}), flush=True)


class HFProcess:
    def __init__(self, target: str, draft: str, dtype: str):
        cmd = [sys.executable, __file__, "--hf-worker", "--target", str(model_gguf(target)),
               "--draft", str(model_gguf(draft)) if draft else "", "--dtype", dtype]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.p.stdout.readline()
        if not ready:
            raise SystemExit("the HF worker died while loading (see its stderr above)")

    def generate(self, ids, max_new, eos, assisted=False, draft_tokens=5):
        self.p.stdin.write(json.dumps(dict(ids=ids, max_new=max_new, eos=eos, assisted=assisted,
                                           draft_tokens=draft_tokens)) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        return r["tokens"], r["seconds"]

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


# ----------------------------------------------------------------------------- plot
def plot(result: dict, path: str) -> None:
    bar_plot(result, path, f"{result['target']} <- draft {result['draft']} ({result['dtype']})", fmt="%.1f")


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="preset or path of the draft model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "nq"])
    ap.add_argument("--n", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", help="fixed length (a separate, labelled result)")
    ap.add_argument("--expansions", nargs="+", default=["1,1,1,1", "1,1,3,1,1,1,1,1"],
                    help="greedy SpecInfer tree shapes (widths per depth)")
    ap.add_argument("--lookahead", nargs="*", default=["7:12"], help="lookahead decoding_length:branch_length")
    ap.add_argument("--merged", nargs="*", type=int, default=[8],
                    help="trie nodes merged into the first SpecInfer shape's tree (lookahead_nodes)")
    ap.add_argument("--draft-weights", nargs="+", default=["bfloat16"], choices=("bfloat16", "float32"),
                    help="storage of the draft's CPU weights (SpecInfer draft_weights); several: each greedy "
                         "SpecInfer shape runs with each (sampling uses the first)")
    ap.add_argument("--temperature", type=float, default=0.7, help="for sample / specinfer-mss / -inv")
    ap.add_argument("--no-sampling", action="store_true", help="skip the three sampling methods")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="JSON path (PNG beside it); default bench/results/specinfer.json")
    a = ap.parse_args(argv)
    if a.hf_worker:
        return hf_worker(a.target, a.draft, a.dtype)
    a.out = a.out or default_out("specinfer", a.ignore_eos)
    ie = a.ignore_eos

    import lookahead_jax as lj
    from lookahead_jax.prompts import encode_prompts
    from lookahead_jax.strategies.specinfer import load_draft

    print(host_line(), f"| {eos_mode(ie)}", flush=True)
    model, tok = lj.load(a.target, dtype=a.dtype)
    engine = lj.engine_for(model)
    engine.keep_packed_only()
    draft = load_draft(engine, a.draft)  # loaded once, packed only, vocabulary checked
    eos = [] if ie else sorted(getattr(tok, "eos_token_ids", ()) or ())
    hf = None if a.no_hf else HFProcess(a.target, a.draft, a.dtype)
    short = {"bfloat16": "bf16", "float32": "f32"}
    exps = {f"specinfer[{e}]" + (f"/{short[w]}" if len(a.draft_weights) > 1 else ""):
            (tuple(int(v) for v in e.split(",")), w) for e in a.expansions for w in a.draft_weights}
    looks = {f"lookahead[{c}]": dict(decoding_length=int(c.split(":")[0]), branch_length=int(c.split(":")[1]))
             for c in a.lookahead}
    T = a.temperature
    main_exp, main_w = next(iter(exps.values()))
    methods = {"greedy": dict()}
    methods.update({n: dict(strategy=lj.SpecInfer(draft_model=draft, expansion=e, draft_weights=w))
                    for n, (e, w) in exps.items()})
    methods.update({n: dict(strategy="lookahead", **c) for n, c in looks.items()})
    methods.update({f"merged[{k}]": dict(strategy=lj.SpecInfer(draft_model=draft, expansion=main_exp,
                                                              draft_weights=main_w, lookahead_nodes=k))
                    for k in a.merged})
    if not a.no_sampling:
        methods.update({
            "sample": dict(temperature=T, seed=0),
            "specinfer-mss": dict(strategy=lj.SpecInfer(draft_model=draft, expansion=main_exp, draft_weights=main_w),
                                  temperature=T, seed=0),
            "specinfer-inv": dict(strategy=lj.SpecInfer(draft_model=draft, expansion=main_exp, sampler="invariant",
                                                        draft_weights=main_w),
                                  temperature=T, seed=0),
        })
    hf_methods = [] if hf is None else ["hf_greedy", "hf_assisted"]
    result = dict(target=a.target, draft=a.draft, dtype=a.dtype, draft_weights=a.draft_weights,
                  max_new_tokens=a.max_new_tokens,
                  stop_at_eos=not ie, eos_token_ids=eos, prompts_per_dataset=a.n, temperature=T,
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  datasets={})
    depth = len(main_exp)
    for ds in a.datasets:
        prompts, refs = dataset_prompts(ds, a.n)
        ids = encode_prompts(tok, prompts, chat=False)
        for kw in methods.values():  # warm-up: compile every method's steps (not timed)
            lj.generate(model, tok, [ids[0]], max_new_tokens=8, ignore_eos=True, **kw)
        acc = {m: dict(tokens=0, time=0.0, steps=0, draft_s=0.0, draft_steps=0, identical=0, prefill_s=0.0)
               for m in [*methods, *hf_methods]}
        for i, x in enumerate(ids):
            outs = {}
            for name, kw in methods.items():
                extra = dict(references=[refs[i]]) if name.startswith(("lookahead", "merged")) else {}
                outs[name] = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie, **kw, **extra)
            again = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie)
            ref = outs["greedy"].rows[0].token_ids
            assert again.rows[0].token_ids == ref
            line = f"[{ds} {i}] {len(ref)} tok:"
            for name, out in outs.items():
                s, v = out.stats, acc[name]
                v["tokens"] += s["new_tokens"]
                # greedy ran twice (before and after the others): the mean of its two times
                t = {k: (s[k] + again.stats[k]) / 2 if name == "greedy" else s[k] for k in ("wall_s", "prefill_s")}
                v["time"] += t["wall_s"]
                v["prefill_s"] += t["prefill_s"]
                v["steps"] += s["forward_steps"]
                v["draft_s"] += s.get("draft_s", 0.0)
                v["draft_steps"] += s["forward_steps"] - 1 if "draft_s" in s else 0
                sampled = name in ("sample", "specinfer-mss", "specinfer-inv")
                same = out.rows[0].token_ids == (outs["sample"].rows[0].token_ids if sampled else ref)
                v["identical"] += same
                if name not in ("sample", "specinfer-mss") and not same:
                    raise SystemExit(f"{name} differs from its reference on {ds} prompt {i}: a losslessness bug")
                line += f" {name}={s['tokens_per_s']:.2f}t/s,{s['new_tokens'] / max(s['forward_steps'], 1):.2f}acc"
            if hf:
                for name in hf_methods:
                    toks, dt = hf.generate(x, a.max_new_tokens, eos, assisted=name == "hf_assisted", draft_tokens=depth)
                    v = acc[name]
                    v["tokens"] += len(toks)
                    v["time"] += dt
                    v["identical"] += toks == ref
                    line += f" {name}={len(toks) / dt:.2f}t/s" + ("" if toks == ref else "(differs)")
            print(line, flush=True)
        g = acc["greedy"]["tokens"] / acc["greedy"]["time"]
        res = {}
        for name, v in acc.items():
            tps = v["tokens"] / v["time"]
            m = dict(tokens_per_s=round(tps, 3), speedup_vs_our_greedy=round(tps / g, 3), new_tokens=v["tokens"])
            if name in methods:
                m.update(forward_steps=v["steps"], mean_accepted_tokens=round(v["tokens"] / v["steps"], 3),
                         prefill_share=round(v["prefill_s"] / v["time"], 3))
                if name != "sample":  # the sampling methods' reference is plain sampling (mss: differs by design)
                    ref_name = "sample" if name in ("specinfer-mss", "specinfer-inv") else "greedy"
                    m[f"identical_to_{ref_name}"] = f"{v['identical']}/{len(ids)}"
            else:
                m["identical_to_our_greedy"] = f"{v['identical']}/{len(ids)}"
            if v["draft_steps"]:
                m["draft_ms_per_step"] = round(1e3 * v["draft_s"] / v["draft_steps"], 2)
            for h in hf_methods:
                m[f"speedup_vs_{h}"] = round(tps / (acc[h]["tokens"] / acc[h]["time"]), 3)
            res[name] = m
        # the ceiling of any speculation: the prefill (one forward over the prompt) does not shrink
        gp = acc["greedy"]["prefill_s"] / acc["greedy"]["time"]
        result["datasets"][ds] = dict(methods=res, greedy_prefill_share=round(gp, 3),
                                      speedup_ceiling_if_decoding_were_free=round(1 / gp, 2) if gp else None)
        print(f"== {ds}: " + "; ".join(f"{n} {m['tokens_per_s']:.2f} t/s ({m['speedup_vs_our_greedy']:.2f}x"
                                       + (f", {m['mean_accepted_tokens']:.2f} acc" if "mean_accepted_tokens" in m else "")
                                       + ")" for n, m in res.items()), flush=True)
        save(result, a.out)
    if hf:
        hf.close()
    plot(result, str(Path(a.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
