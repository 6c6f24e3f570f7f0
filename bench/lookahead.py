"""Lookahead vs greedy vs HF transformers (greedy and prompt-lookup decoding).

    python bench/lookahead.py                                  # 20 prompts x 3 datasets
    python bench/lookahead.py --datasets nq --n 8 --no-hf      # quick look
    python bench/lookahead.py --configs auto suffix:auto suffix:7   # the trie vs the suffix drafter
    python bench/lookahead.py --datasets nq squad humaneval gsm8k nq-shared humaneval-x4 \
        --configs auto suffix:auto suffixdecoding suffixdecoding:aggressive promptlookup  # issue 28
    python bench/lookahead.py --model path/to/model.gguf --hf-device cuda   # a GGUF file, HF on GPU
    python bench/lookahead.py --ignore-eos                     # fixed length: a separate result

Same model (SmolLM2-135M by default, f32), same token ids. Every method stops at EOS (the
tokenizer's `eos_token_ids`; the HF peer is given the same ids), up to `--max-new-tokens`
tokens per prompt: what users get, the headline. `--ignore-eos` runs the old fixed-length
benchmark instead (`--max-new-tokens` tokens every prompt; past EOS this model repeats
itself and the trie drafts the repetition well, so it overstates lookahead), labelled
`stop_at_eos: false` in the JSON and "fixed length (EOS ignored)" in the plot, saved by
default to `lookahead-fixedlen.json` so it never replaces the headline.

Drafters, all verified by our engine (the same tree verification, so the comparison is of
the drafts): the n-gram trie (`auto`, `D:B:mode`), the suffix drafter (`suffix:...`),
SuffixDecoding's own drafter (`suffixdecoding[:aggressive]`, arctic-inference's C++ suffix
trees behind our drafter protocol: bench/peers/suffix_decoding.py, built by
bench/peers/build_suffix_decoding.sh, `--peer-dir`) and HF's prompt lookup algorithm
(`promptlookup[:K]`, bench/prompt_lookup.py); `parse_config` has the settings. Drafters
with a cache of earlier outputs (trie, suffix, suffixdecoding) share one per config across
a dataset's prompts, cold at its start.

Datasets (`common.DATASETS`): nq (NQ RAG), squad (Disfl-QA / SQuAD paragraphs, the
repository's data/), humaneval, gsm8k, and repeated traffic: nq-shared (3 NQ questions per
passage, one after another) and humaneval-x4 (each of `--n` tasks 4 times in a row, sampled
at temperature 0.7 with a seed per sample: there "greedy" is our plain sampling with the
same seed, every method is checked against it, and the HF peers do not run). Beside every
set the copy oracle of this run's greedy (plain sampling) outputs (`common.oracle`): tokens
per step if each step copied the longest true continuation found anywhere in the prompt,
references and output so far (own) / also in the set's earlier outputs (+ earlier), and
root-anchored (only spans after an occurrence of the root token: the ceiling of the trie and
suffix drafters), printed in the `== set` line and saved as `copy_oracle_tokens_per_step`.

Per prompt the methods run one after another: greedy, the lookahead configs, greedy again
(the machine's speed drifts by tens of percent within a minute, so greedy's time is the
mean of the two runs around the configs), HF greedy and prompt lookup, timed the same way
(the whole generate call, prefill included). Tokens/s of each method count the tokens that
method emitted (with EOS stopping, prompts emit different numbers of tokens). Lookahead's
output is checked token for token against our greedy (it must be identical) and so is HF's
(counted, not enforced: near-ties can differ across libraries). Per-prompt speedups and
the prompts below 0.95x go to the JSON. Reports per dataset and method: tokens/s, forward
steps, mean accepted tokens per step (tokens emitted per forward, so greedy = 1), host
drafting time (total, fraction and per step), speedups, and the prompt forward apart: `prefill_s` (time to the first token,
summed) and the tokens/s and speedup after the first token (`decode_*`), the part a
decoding strategy changes. Saves JSON (with the command and the host's CPU, cores and
jax/torch versions) and a bar plot (PNG).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (DATASETS, HFPeer, bar_plot, copy_oracles, dataset_prompts, dataset_sampling,  # noqa: E402
                    default_out, eos_mode, host_line, model_gguf, oracle_line, resolve_hf_device, save)


def parse_config(s: str) -> dict:
    """'auto:12:hierarchical' -> decoding_length, branch_length, mode; a fourth part 'cal'
    makes auto calibrate every tree size first (Lookahead(calibrate=True)) instead of
    starting from the platform's typical costs.

    'suffix[:DL[:ALPHA:OFFSET]][:cal]' -> the suffix drafter (Lookahead(drafts="suffix"))
    with decoding_length DL (default auto) and its tree cap alpha x match + offset (default
    the strategy's `SUFFIX_SETTINGS`), under "suffix"; e.g. 'suffix:auto', 'suffix:7',
    'suffix:auto:2:4'.

    'suffixdecoding[:aggressive]' -> SuffixDecoding's own drafter (bench/peers/suffix_decoding.py,
    arctic-inference's C++ suffix trees) at its simulator's defaults (depth 64, max_spec_factor
    1, offset 0, min_token_prob 0.1, tree speculation) or 'aggressive' (factor 4, offset 4, min
    prob 0.01), decoding_length 63, under "suffixdecoding".

    'promptlookup[:K]' -> HF's prompt lookup (bench/prompt_lookup.py): one chain of K
    tokens (default 10), decoding_length K, under "promptlookup"."""
    parts = s.split(":")
    if parts[0] == "suffixdecoding":
        from peers.suffix_decoding import DECODING_LENGTH, SETTINGS

        which = parts[1] if len(parts) > 1 else "defaults"
        if len(parts) > 2 or which not in SETTINGS:
            raise ValueError(f"config {s!r}: suffixdecoding[:{'|'.join(SETTINGS)}]")
        return dict(suffixdecoding=SETTINGS[which], decoding_length=DECODING_LENGTH)
    if parts[0] == "promptlookup":
        if len(parts) > 2:
            raise ValueError(f"config {s!r}: promptlookup[:K]")
        k = int(parts[1]) if len(parts) > 1 else 10
        return dict(promptlookup=k, decoding_length=k)
    if parts[0] == "suffix":
        from lookahead_jax.strategies.lookahead import SUFFIX_SETTINGS

        rest = parts[1:]
        cal = bool(rest) and rest[-1] == "cal"
        rest = rest[:-1] if cal else rest
        if len(rest) not in (0, 1, 3):
            raise ValueError(f"suffix config {s!r}: suffix[:DL[:ALPHA:OFFSET]][:cal]")
        dl = rest[0] if rest else "auto"
        alpha, offset = (float(rest[1]), float(rest[2])) if len(rest) == 3 else (
            SUFFIX_SETTINGS["alpha"], SUFFIX_SETTINGS["offset"])
        out = dict(drafts="suffix", decoding_length=dl if dl == "auto" else int(dl),
                   suffix=dict(SUFFIX_SETTINGS, alpha=alpha, offset=offset))
        return dict(out, calibrate=True) if cal else out
    if len(parts) == 4 and parts[3] == "cal":
        return dict(parse_config(":".join(parts[:3])), calibrate=True)
    dl, bl, mode = parts + ["auto", "12", "hierarchical"][len(parts):]  # '15:12' -> hierarchical
    return dict(decoding_length=dl if dl == "auto" else int(dl), branch_length=int(bl), mode=mode)


def plot(result: dict, path: str) -> None:
    bar_plot(result, path, f"{Path(result['model']).name} ({result['dtype']})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="preset name or a .gguf file (used by both us and HF)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--datasets", nargs="+", default=["nq", "humaneval", "gsm8k"],
                    help=f"of {', '.join(DATASETS)} (humaneval-x4: --n tasks, 4 samples each)")
    ap.add_argument("--n", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="at most (stops at EOS unless --ignore-eos)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="fixed length: every method generates --max-new-tokens tokens past EOS (a separate, "
                         "labelled result, default output lookahead-fixedlen.json; not the headline)")
    ap.add_argument("--configs", nargs="+", default=["auto:12:hierarchical", "8:8:hierarchical", "16:12:parallel"],
                    help="lookahead configs decoding_length:branch_length:mode[:cal] ('auto' = the default; "
                         "':cal': auto calibrated before decoding), or the suffix drafter "
                         "suffix[:decoding_length[:alpha:offset]][:cal] (e.g. suffix:auto, suffix:7), "
                         "SuffixDecoding's drafter suffixdecoding[:aggressive], or prompt lookup promptlookup[:K]")
    ap.add_argument("--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--peer-dir", default="/tmp/suffix-decoding-peer",
                    help="where bench/peers/build_suffix_decoding.sh built SuffixDecoding (configs suffixdecoding*)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-device", default="auto",
                    help="torch device of the HF peer: cpu, cuda, or auto (cuda when JAX runs on a GPU, else cpu)")
    ap.add_argument("--out", help="JSON path (PNG beside it); default bench/results/lookahead.json, "
                    "or lookahead-fixedlen.json with --ignore-eos")
    a = ap.parse_args(argv)
    for ds in a.datasets:  # an unknown name fails at once, with the list of names
        if ds not in DATASETS:
            dataset_prompts(ds, 0)
    a.out = a.out or default_out("lookahead", a.ignore_eos)
    ie = a.ignore_eos

    import lookahead_jax as lj
    from lookahead_jax.prompts import encode_prompts
    from lookahead_jax.drafters.trie import TrieDrafter
    from lookahead_jax.drafters.suffix import SuffixCache, SuffixDrafter
    from lookahead_jax.drafters.ngram_trie import NgramTrie
    from lookahead_jax.core.budget import AcceptanceStats
    from prompt_lookup import PromptLookupDrafter

    print(host_line(), f"| {eos_mode(ie)}", flush=True)
    model, tok = lj.load(a.model, dtype=a.dtype)  # a preset name or a .gguf path
    eos_ids = None if ie else sorted(getattr(tok, "eos_token_ids", ()) or ())  # what generate stops at
    hf_device = None if a.no_hf else resolve_hf_device(a.hf_device)
    hf = None if a.no_hf else HFPeer(model_gguf(a.model), a.dtype, device=hf_device)
    configs = {f"lookahead[{c}]": parse_config(c) for c in a.configs}
    peer_cls = None
    if any("suffixdecoding" in c for c in configs.values()):
        from peers.suffix_decoding import SuffixDecodingDrafter, load_cache_class, new_cache

        peer_cls = load_cache_class(a.peer_dir)
    own = ("suffix", "suffixdecoding", "promptlookup")  # a config's drafter settings, not generate's
    result = dict(model=a.model, dtype=a.dtype, max_new_tokens=a.max_new_tokens, stop_at_eos=not ie,
                  eos_token_ids=eos_ids, prompts_per_dataset=a.n, hf_device=hf_device, datasets={})
    for ds in a.datasets:
        prompts, refs = dataset_prompts(ds, a.n)
        sampling = dataset_sampling(ds, len(prompts))  # {} = greedy; else plain sampling is the reference
        sampled = any(sampling)
        ids = encode_prompts(tok, prompts, chat=False)  # chat messages use the template
        # each config has its own global trie (the suffix drafters: cache of earlier outputs)
        # and acceptance statistics (warm across this dataset's prompts, cold at its start),
        # as TrieDrafter.shared / SuffixDrafter.shared give generate()

        def shared_store(c):
            if "suffixdecoding" in c:
                return new_cache(peer_cls, c["suffixdecoding"]["depth"])
            if "promptlookup" in c:
                return None
            return SuffixCache() if "suffix" in c else NgramTrie(branch_length=c["branch_length"])

        tries = {n: shared_store(c) for n, c in configs.items()}
        stats = {n: AcceptanceStats() for n in configs}

        def drafter(name, cold=False):
            c = configs[name]
            if "suffixdecoding" in c:
                return SuffixDecodingDrafter(shared_store(c) if cold else tries[name], **c["suffixdecoding"],
                                             max_nodes=c["decoding_length"])
            if "promptlookup" in c:
                return PromptLookupDrafter(c["promptlookup"])
            if "suffix" in c:
                return SuffixDrafter(**c["suffix"], **({} if cold else dict(cache=tries[name], acceptance=stats[name])))
            if cold:
                return TrieDrafter(c["branch_length"], c["mode"])
            return TrieDrafter(c["branch_length"], c["mode"], trie=tries[name], acceptance=stats[name])

        def options(name):  # generate's strategy options of a config
            return {k: v for k, v in configs[name].items() if k not in own}

        acc = {m: dict(tokens=0, time=0.0, steps=0, host=0.0, identical=0, prefill=0.0, capped=0, restarts=0)
               for m in ["greedy", *configs] + ([] if not hf else ["hf_greedy", "hf_prompt_lookup"])}
        # warm-up: compile greedy and every lookahead bucket once (not timed)
        lj.generate(model, tok, [ids[0]], max_new_tokens=8, ignore_eos=True)
        for name in configs:
            lj.generate(model, tok, [ids[0]], max_new_tokens=8, ignore_eos=True, strategy="lookahead",
                        **options(name), drafter=drafter(name, cold=True))
        if hf:
            hf.generate(ids[0], 4)
        per_prompt = {n: [] for n in configs}
        lengths, eos_stops = [], 0  # greedy's new tokens per prompt; prompts that ended at EOS
        recs = []  # (prompt ids, reference ids, greedy's output) for the copy oracle
        for i, x in enumerate(ids):
            samp = sampling[i]  # the same temperature and seed for every method
            base = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie, **samp)
            rows = {"greedy": base}
            for name in configs:
                rows[name] = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie,
                                         strategy="lookahead", references=[refs[i]], **options(name),
                                         drafter=drafter(name), **samp)
            # greedy again after the configs: the machine's speed drifts by tens of percent
            # within a minute, so the prompt's greedy time is the mean of the two around them
            again = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=ie, **samp)
            ref_ids = base.rows[0].token_ids
            assert again.rows[0].token_ids == ref_ids
            recs.append((list(x), [tok.encode(t, add_special_tokens=False) for t in refs[i]], list(ref_ids)))
            lengths.append(len(ref_ids))
            eos_stops += bool(eos_ids) and bool(ref_ids) and ref_ids[-1] in eos_ids
            g_wall = (base.stats["wall_s"] + again.stats["wall_s"]) / 2
            for name, out in rows.items():
                s = out.stats
                acc[name]["tokens"] += s["new_tokens"]
                acc[name]["time"] += g_wall if name == "greedy" else s["wall_s"]
                acc[name]["steps"] += s["forward_steps"] if name != "greedy" else (s["forward_steps"] + again.stats["forward_steps"]) / 2
                acc[name]["host"] += s.get("host_s", 0.0)
                acc[name]["capped"] += s.get("suffixdecoding_capped", 0)  # SuffixDecoding's drafter only
                acc[name]["restarts"] += s.get("suffixdecoding_restarts", 0)
                acc[name]["prefill"] += (base.stats["prefill_s"] + again.stats["prefill_s"]) / 2 if name == "greedy" else s["prefill_s"]
                acc[name]["identical"] += out.rows[0].token_ids == ref_ids
                if name != "greedy":
                    per_prompt[name].append(round(g_wall / s["wall_s"] * s["new_tokens"] / base.stats["new_tokens"], 3))
            line = f"[{ds} {i}] " + " ".join(
                f"{n}={o.stats['tokens_per_s']:.1f}t/s,{o.stats['new_tokens'] / max(o.stats['forward_steps'], 1):.2f}acc"
                for n, o in rows.items()) + f" ({len(ref_ids)} tok)" + (
                f" greedy(again)={again.stats['tokens_per_s']:.1f}t/s " + " ".join(f"{n}:{v[-1]:.2f}x" for n, v in per_prompt.items()))
            if hf and not sampled:  # HF samples with its own generator: nothing to compare
                for name, k in (("hf_greedy", 0), ("hf_prompt_lookup", a.prompt_lookup)):
                    toks, dt = hf.generate(x, a.max_new_tokens, prompt_lookup=k, eos_ids=eos_ids)
                    acc[name]["tokens"] += len(toks)
                    acc[name]["time"] += dt
                    acc[name]["identical"] += toks == ref_ids
                    line += f" {name}={len(toks) / dt:.1f}t/s" + ("" if toks == ref_ids else f"(differs, {len(toks)} tok)")
            print(line, flush=True)
        methods = {}
        g = acc["greedy"]["tokens"] / acc["greedy"]["time"]
        # after the first token: the prompt forward (time to first token) is the same work
        # for every strategy, so this is what the strategies themselves change
        def decode_rate(v):  # one first token per prompt
            t = v["time"] - v["prefill"]
            return (v["tokens"] - len(ids)) / t if t > 0 else 0.0
        gd = decode_rate(acc["greedy"]) or float("nan")  # nan: every prompt ended at its first token
        for name, v in acc.items():
            if name.startswith("hf") and not v["time"]:
                continue  # a sampled set: the HF peers did not run
            tps = v["tokens"] / v["time"]
            m = dict(tokens_per_s=round(tps, 3), speedup_vs_our_greedy=round(tps / g, 3))
            if not name.startswith("hf"):
                m.update(prefill_s=round(v["prefill"], 3), decode_tokens_per_s=round(decode_rate(v), 3),
                         decode_speedup_vs_our_greedy=round(decode_rate(v) / gd, 3),
                         forward_steps=v["steps"], mean_accepted_tokens=round(v["tokens"] / v["steps"], 3),
                         host_s=round(v["host"], 3), host_fraction=round(v["host"] / v["time"], 4),
                         host_ms_per_step=round(1e3 * v["host"] / v["steps"], 3) if v["steps"] else 0.0,
                         identical_to_greedy=f"{v['identical']}/{len(ids)}")
            else:  # HF's tokens vs ours (f32 on the same weights: expected equal, bf16 rounds differently)
                m.update(identical_to_our_greedy=f"{v['identical']}/{len(ids)}", new_tokens=v["tokens"])
            if "suffixdecoding" in configs.get(name, {}):  # its trees cut by our cap; its rollbacks
                m.update(drafts_capped_by_decoding_length=v["capped"], rollback_restarts=v["restarts"])
            if name in per_prompt:  # per-prompt speedup over the mean of the two greedy runs
                m.update(prompts_below_0_95=sum(x < 0.95 for x in per_prompt[name]),
                         worst_prompt=min(per_prompt[name]), per_prompt_speedup=per_prompt[name])
            if hf and not sampled:
                for h in ("hf_greedy", "hf_prompt_lookup"):
                    m[f"speedup_vs_{h}"] = round(tps / (acc[h]["tokens"] / acc[h]["time"]), 3)
            methods[name] = m
        best = max(configs, key=lambda n: methods[n]["tokens_per_s"])
        oracles = copy_oracles(recs)  # on greedy's (plain sampling's) outputs of this run
        result["datasets"][ds] = dict(methods=methods, best_lookahead=best, new_tokens=sum(lengths),
                                      new_tokens_per_prompt=lengths, copy_oracle_tokens_per_step=oracles,
                                      sampling=sampling[0] and dict(sampling[0], seed="the prompt's index"),
                                      prompts_ended_at_eos=None if ie else eos_stops)
        print(f"== {ds} ({eos_mode(ie)}: {len(ids)} prompts, {sum(lengths)} tokens"
              + ("" if ie else f", {eos_stops}/{len(ids)} ended at EOS")
              + (f"; sampled, temperature {sampling[0]['temperature']}, a seed per prompt" if sampled else "")
              + f"; {oracle_line(oracles)}): "
              + "; ".join(f"{n}: {m['tokens_per_s']:.1f} tok/s ({m['speedup_vs_our_greedy']:.2f}x"
                          + (f", {m['mean_accepted_tokens']:.2f} tok/step, host {m['host_ms_per_step']:.2f} ms/step"
                             f", identical {m['identical_to_greedy']}" if "mean_accepted_tokens" in m else "")
                          + (f", after the first token {m['decode_speedup_vs_our_greedy']:.2f}x)"
                             if "decode_speedup_vs_our_greedy" in m else ")")
                          for n, m in methods.items()), flush=True)
        if ds != a.datasets[-1]:
            save(result, a.out)  # partial results survive a run cut short
    save(result, a.out)
    plot(result, str(Path(a.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
