"""Open-loop load against the OpenAI-compatible server (`lookahead_jax.serve`), as `vllm
bench serve` measures it: requests arrive by a Poisson process (`--rate` per second, inf =
all at once) with at most `--concurrency` in flight; per level and strategy the output
throughput, time to first token (TTFT), time per output token after the first (TPOT) and
inter-chunk latency (ITL) p50 / p99 / max and each stream's own gaps (p50 / p99 / max, with
its arrival, start and end times: `streams` in the JSON), and from the server's /metrics the acceptance rate
(accepted / draft tokens) and mean acceptance length (1 + accepted / drafts).

    python bench/serve.py --strategies greedy lookahead --concurrency 1 4 8 --requests 16
    python bench/serve.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --strategies greedy lookahead specinfer --concurrency 1 4 --requests 8 --out bench/results/serve-qwen.json

Each (strategy, concurrency) gets a server of its own in this process, with --max-batch =
the concurrency (a step computes every slot: idle slots cost), warmed up first: every step
it may run compiled (`Scheduler.warm_up`, the server's --warmup), then unmeasured requests
on other prompts (lookahead's trie starts empty per server: what it holds when measuring
comes from them and the measured requests themselves). Strategies alternate within each
level (ABBA over --repeats), the host's speed drifting by tens of percent. Prompts come from
the repository's data/: NQ questions with their gold passage (chat, RAG), GSM8K questions
(chat), HumanEval prompts (completion), in turn. Writes bench/results/serve.json and
serve.png, the host named.

Repeated traffic and the prefix cache (issue 53): `--prompts nq-shared` sends NQ questions
three per passage (the passage's questions one after another, warm-up passages apart), and
a strategy written `NAME/nocache` runs with the prefix cache off (`--prefix-cache-mb 0`;
plain NAME: `--prefix-cache-mb`, by default the server's). The JSON then gives TTFT apart
for each passage's first question and its repeats (those sent once an earlier question of
their passage had its first token, `cached`, apart from those sent while it was still
prefilling the passage, `inflight`), and the cache's hit rate:

    python bench/serve.py --prompts nq-shared --strategies greedy/nocache greedy lookahead \
        --concurrency 4 --rate 2 --requests 24 --warmup 6 --max-tokens 128 \
        --out bench/results/serve-prefix.json

A strategy written `NAME/notree` runs with a step that carries a prefill block verifying
no speculation tree (`Slots.trees_while_prefilling` False, `budget.NoTree`; off by default):
its A/B, e.g. `--strategies lookahead lookahead/notree --concurrency 1 4 8`. `NAME/chunkN`
serves with prefill blocks of N prompt tokens (`--prefill-chunk N`), `NAME/budgetK` with a
step budget of K decode steps (`--step-budget K`), both as `NAME/chunkN+budgetK` (plain
NAME: the server's defaults), e.g. issue 57's `--strategies greedy greedy/chunk32 lookahead
lookahead/chunk32+budget3`. `+fcfs` (or `NAME/fcfs`): prefilling prompts take their blocks
oldest first, as before shortest-remaining-first (`Slots.shortest_first` False); `+notail`
(or `NAME/notail`): a prompt's short last piece takes the full block, as before the narrower
one (`Slots.narrow_tail` False); e.g. `--strategies greedy greedy/notail`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cold_stores, host_line, save, shared_prompts  # noqa: E402

DATA = ROOT / "data"


def repo_prompts() -> list:
    """(kind, prompt) in turn from data/: nq RAG chat, gsm8k chat, humaneval completion."""
    passages = {}
    for line in open(DATA / "passages.jsonl"):
        r = json.loads(line)
        passages[r["id"]] = r["text"]
    nq = [json.loads(x) for x in open(DATA / "nq_questions.jsonl")]
    gsm = [json.loads(x) for x in open(DATA / "gsm8k_sample.jsonl")]
    he = [json.loads(x) for x in open(DATA / "humaneval_sample.jsonl")]
    out = []
    for i in range(max(len(nq), len(gsm), len(he))):
        if i < len(nq) and len(passages.get(nq[i]["passage_id"], "")) <= 1200:
            q = nq[i]
            out.append(("chat", [{"role": "user", "content": "Answer the question using the passage.\n\nPassage: "
                                  f"{passages[q['passage_id']]}\n\nQuestion: {q['question']}"}]))
        if i < len(gsm):
            out.append(("chat", [{"role": "user", "content": gsm[i]["question"] + "\nLet's think step by step."}]))
        if i < len(he) and len(he[i]["prompt"]) <= 1200:
            out.append(("completion", he[i]["prompt"]))
    return out


def nq_shared(n_warm: int, n: int):
    """(warm-up, measured) prompts of `--prompts nq-shared`: ("chat", messages), three
    questions per passage, the warm-up's passages other than the measured ones', and per
    measured prompt its passage's index (a prompt whose passage an earlier one had is a repeat)."""
    per = 3
    n_warm, n = per * -(-n_warm // per), per * -(-n // per)
    prompts, refs = shared_prompts(n_warm + n, per, max_chars=2400)
    if len(prompts) < n_warm + n:
        sys.exit(f"error: the NQ data hold {len(prompts)} shared-passage prompts, fewer than --warmup + --requests")
    prompts = [("chat", m) for m in prompts]
    passages = [r[0] for r in refs[n_warm:]]
    return prompts[:n_warm], prompts[n_warm:], [passages.index(p) for p in passages]


def start_server(args, strategy: str, batch: int, model, tok):
    from lookahead_jax.serve import ServeConfig, make_server, start_in_thread

    strategy, _, variant = strategy.partition("/")
    sizes = {}  # chunkN / budgetK parts of the variant: the server's --prefill-chunk / --step-budget
    flags = {"fcfs", "notail"} & set(variant.split("+"))
    fcfs = "fcfs" in flags  # prefilling slots' blocks oldest first (`Slots.shortest_first` False)
    notail = "notail" in flags  # a short last piece in the full block (`Slots.narrow_tail` False)
    variant = "+".join(x for x in variant.split("+") if x not in flags)
    for part in variant.split("+") if variant.startswith(("chunk", "budget")) else ():
        key = "prefill_chunk" if part.startswith("chunk") else "step_budget" if part.startswith("budget") else None
        num = part[5:] if key == "prefill_chunk" else part[6:]
        if key is None or key in sizes or not (num if key == "prefill_chunk" else num.replace(".", "", 1)).isdigit():
            raise SystemExit(f"unknown strategy variant part {part!r} (chunkN or budgetK, joined by +)")
        sizes[key] = int(num) if key == "prefill_chunk" else float(num)
    if variant not in ("", "nocache", "notree") and not sizes:
        raise SystemExit(f"unknown strategy variant /{variant} (NAME, NAME/nocache, NAME/notree, NAME/fcfs, "
                         "NAME/notail or NAME/chunkN+budgetK[+fcfs][+notail])")
    cache_mb = 0 if variant == "nocache" else args.prefix_cache_mb
    from lookahead_jax.core.slots import Slots

    Slots.trees_while_prefilling = variant != "notree"  # (notree: a step with a prefill block drafts none)
    Slots.shortest_first = not fcfs
    Slots.narrow_tail = not notail
    opts = ()
    if strategy == "lookahead" and args.decoding_length:
        opts = (("decoding_length", args.decoding_length),)
    elif strategy.startswith("specinfer"):  # specinfer-auto / specinfer-fixed: that budget
        budget = strategy.partition("-")[2]
        opts = (("draft_model", args.draft),) + ((("budget", budget),) if budget else ())
        strategy = "specinfer"
    cfg = ServeConfig(model=args.model, strategy=strategy, strategy_options=opts, max_batch=batch,
                      max_len=args.max_len, max_waiting=100000, logprobs=False, prefix_cache_mb=cache_mb,
                      **sizes)
    # each run starts cold (its warm-up prompts seed it), not with what the last run wrote: the
    # measured prompts are the same in every run, so a kept cache of earlier outputs (the suffix
    # drafter's, lookahead's default) would draft their answers
    cold_stores(model)
    srv = make_server(cfg, model, tok)
    if args.server_warmup:  # every step the slots may run compiled before serving (the server's --warmup)
        srv.scheduler.warm_up()
    uv, th, url = start_in_thread(srv)
    return srv, uv, th, url


async def one(http, url: str, kind: str, prompt, max_tokens: int, model: str, strategy=None) -> dict:
    body = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
    if strategy:
        body["lookahead_jax"] = {"strategy": strategy}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body.update(messages=prompt) if kind == "chat" else body.update(prompt=prompt)
    t0 = time.perf_counter()
    times, n, text = [], 0, []
    async with http.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return dict(ok=False, status=r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "usage" in d and d.get("usage") and not d.get("choices"):
                n = d["usage"]["completion_tokens"]
                continue
            for c in d.get("choices", ()):
                delta = c.get("text") or (c.get("delta") or {}).get("content")
                if delta:
                    times.append(time.perf_counter())
                    text.append(delta)
    t1 = time.perf_counter()
    return dict(ok=True, tokens=n, text="".join(text), ttft=(times[0] - t0) if times else t1 - t0, e2e=t1 - t0,
                itl=list(np.diff(times)), tpot=(t1 - times[0]) / (n - 1) if times and n > 1 else None,
                start=t0, end=t1)


async def load(url: str, prompts: list, rate: float, concurrency: int, max_tokens: int, model: str, seed: int):
    import httpx

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 8)) as http:
        async def task(kind, p):
            arrival = time.perf_counter() - t0
            async with sem:
                r = await one(http, url, kind, p, max_tokens, model)
            r["arrival_s"] = round(arrival, 3)  # when it arrived (it may wait for a connection slot)
            if "start" in r:
                r["start_s"], r["end_s"] = round(r.pop("start") - t0, 3), round(r.pop("end") - t0, 3)
            return r
        tasks = []
        t0 = time.perf_counter()
        for kind, p in prompts:
            tasks.append(asyncio.create_task(task(kind, p)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        res = await asyncio.gather(*tasks)
        return res, time.perf_counter() - t0


def scrape(url: str) -> dict:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if (line.startswith("lookahead_jax:spec_decode_num") and "per_pos" not in line) or \
                line.startswith(("lookahead_jax:prefix_cache_queries", "lookahead_jax:prefix_cache_hits")):
            out[line.split("{")[0].split(":")[1]] = float(line.split()[-1])
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def ttft_groups(res, passages) -> dict:
    """Each request's TTFT group by its passage (`nq_shared`): "first" (the passage's first
    question), "repeat" (a later one), and each repeat again as "cached" (sent after an
    earlier question of its passage had its first token: the passage's blocks were in the
    cache) or "inflight" (sent while the earlier one was still prefilling the passage: it
    waits for those blocks, so its TTFT is partly theirs)."""
    out = {"first": [], "repeat": [], "cached": [], "inflight": []}
    for i, (r, p) in enumerate(zip(res, passages)):
        if not r["ok"]:
            continue
        if p not in passages[:i]:
            out["first"].append(r["ttft"])
            continue
        out["repeat"].append(r["ttft"])
        ready = any(q["ok"] and q["start_s"] + q["ttft"] <= r["start_s"]
                    for q, pq in zip(res[:i], passages[:i]) if pq == p)
        out["cached" if ready else "inflight"].append(r["ttft"])
    return out


def summarize(res, wall, before, after, passages=None) -> dict:
    ok = [r for r in res if r["ok"]]
    toks = sum(r["tokens"] for r in ok)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts, draft_tokens = d.get("spec_decode_num_drafts_total", 0), d.get("spec_decode_num_draft_tokens_total", 0)
    acc = d.get("spec_decode_num_accepted_tokens_total", 0)
    itl = [x for r in ok for x in r["itl"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    ttft = [r["ttft"] for r in ok]
    gap_max = [max(r["itl"]) for r in ok if r["itl"]]  # each stream's largest gap between two chunks
    digest = hashlib.sha256(json.dumps([r.get("text") for r in res]).encode()).hexdigest()[:16]
    queries, hits = d.get("prefix_cache_queries_total", 0), d.get("prefix_cache_hits_total", 0)
    split = {}
    if passages is not None:  # TTFT of each passage's first question and of its repeats apart
        for name, xs in ttft_groups(res, passages).items():
            split[f"ttft_{name}_p50_ms"] = pct(xs, 50) and pct(xs, 50) * 1e3
            split[f"ttft_{name}_mean_ms"] = float(np.mean(xs)) * 1e3 if xs else None
            split[f"ttft_{name}_n"] = len(xs)
    return dict(
        requests=len(res), failed=len(res) - len(ok), output_tokens=toks, outputs_sha256=digest,
        duration_s=round(wall, 3),
        output_tokens_per_s=round(toks / wall, 3), requests_per_s=round(len(ok) / wall, 4),
        ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
        tpot_p50_ms=pct(tpot, 50) and pct(tpot, 50) * 1e3, tpot_p99_ms=pct(tpot, 99) and pct(tpot, 99) * 1e3,
        itl_p50_ms=pct(itl, 50) and pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) and pct(itl, 99) * 1e3,
        itl_max_ms=max(itl) * 1e3 if itl else None,
        stream_gap_max_p50_ms=pct(gap_max, 50) and pct(gap_max, 50) * 1e3,
        stream_gap_max_p99_ms=pct(gap_max, 99) and pct(gap_max, 99) * 1e3,
        streams=[dict(arrival_s=r.get("arrival_s"), start_s=r.get("start_s"), end_s=r.get("end_s"),
                      ttft_ms=round(r["ttft"] * 1e3, 1),
                      gap_p50_ms=round(pct(r["itl"], 50) * 1e3, 1) if r["itl"] else None,
                      gap_p99_ms=round(pct(r["itl"], 99) * 1e3, 1) if r["itl"] else None,
                      gap_max_ms=round(max(r["itl"]) * 1e3, 1) if r["itl"] else None) for r in ok],
        spec_drafts=drafts, spec_draft_tokens=draft_tokens, spec_accepted_tokens=acc,
        acceptance_rate=acc / draft_tokens if draft_tokens else None,
        mean_acceptance_length=1 + acc / drafts if drafts else None,
        prefix_cache_queries=queries, prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries else None, **split)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for strat, levels in result["runs"].items():
        cs = sorted(int(c) for c in levels)
        for ax, key in zip(axes, ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")):
            ax.plot(cs, [levels[str(c)][key] for c in cs], marker="o", label=strat)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (slots)")
            ax.set_title(key, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"lookahead_jax.serve, {result['model']}, rate {result['rate']}/s, {result['requests']} requests "
                 f"per level, <= {result['max_tokens']} tokens\n{result['host_line']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--strategies", nargs="+", default=["greedy", "lookahead"],
                    help="greedy lookahead specinfer specinfer-auto specinfer-fixed (SpecInfer's budget: the "
                         "default, auto or fixed); NAME/nocache: with the prefix cache off; NAME/notree: no tree "
                         "in steps with a prefill block; NAME/chunkN+budgetK: prefill blocks of N prompt tokens, a "
                         "step budget of K decode steps (either alone too). Speedups "
                         "are against the first")
    ap.add_argument("--prompts", choices=("repo", "nq-shared"), default="repo",
                    help="repo: NQ RAG, GSM8K and HumanEval prompts of the repository's data/, shuffled; "
                         "nq-shared: NQ questions three per passage, in order (repeated traffic)")
    ap.add_argument("--prefix-cache-mb", type=float, default=None,
                    help="the prefix cache's size for strategies without /nocache (default: the server's)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once")
    ap.add_argument("--requests", type=int, default=32, help="measured requests per level")
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured requests per level (other prompts) first")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--decoding-length", type=int, default=0, help="lookahead's fixed budget (0: auto, the default)")
    ap.add_argument("--draft", default=None, help="specinfer's draft model (a preset or path, same tokenizer as "
                    "--model), e.g. qwen2.5-coder-0.5b for --model qwen2.5-coder-1.5b")
    ap.add_argument("--no-server-warmup", dest="server_warmup", action="store_false",
                    help="do not compile every step the slots may run before serving (the server's --warmup "
                    "none): the steps the unmeasured --warmup requests need compile as they come, the rest "
                    "while measuring (listed in the JSON as compiled_while_measuring). For large models on "
                    "a small CPU, where compiling every prompt bucket x tree size x window takes long")
    ap.add_argument("--repeats", type=int, default=2, help="runs per (strategy, concurrency), alternated ABBA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = ap.parse_args(argv)
    if args.prefix_cache_mb is None:
        from lookahead_jax.serve.server import DEFAULT_PREFIX_CACHE_MB
        args.prefix_cache_mb = DEFAULT_PREFIX_CACHE_MB
    if any(s.startswith("specinfer") for s in args.strategies) and not args.draft:
        ap.error("--strategies specinfer needs --draft NAME_OR_PATH (same tokenizer as --model), "
                 "e.g. --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b")

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    for name in ("httpx", "jax", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
    enable_compilation_cache()  # as the server does: a rerun loads its compiled steps
    model, tok = lj.load(args.model, progress=False)
    passages = None
    if args.prompts == "nq-shared":
        warm, measured, passages = nq_shared(args.warmup, args.requests)
    else:
        prompts = repo_prompts()
        random.Random(args.seed).shuffle(prompts)
        warm, measured = prompts[:args.warmup], prompts[args.warmup:args.warmup + args.requests]
    result = dict(model=args.model, draft=args.draft if any(s.startswith("specinfer") for s in args.strategies) else None, rate=args.rate, requests=len(measured), max_tokens=args.max_tokens,
                  prompts=args.prompts, prefix_cache_mb=args.prefix_cache_mb,
                  repeats=args.repeats, server_warmup=args.server_warmup, decoding_length=args.decoding_length or "auto",
                  host_line=host_line(), runs={st: {} for st in args.strategies}, reps={st: {} for st in args.strategies})
    print(host_line())
    for c in args.concurrency:
        for rep in range(args.repeats):  # strategies alternated (ABBA): the host's speed drifts
            for strat in (args.strategies if rep % 2 == 0 else args.strategies[::-1]):
                srv, uv, th, url = start_server(args, strat, c, model, tok)
                t = time.perf_counter()
                # (start_server compiled every step the slots may run: prompt buckets, tree sizes,
                # windows) unmeasured requests on other prompts: what the trie holds when
                # measuring comes from them
                asyncio.run(load(url, warm, float("inf"), c, args.max_tokens, srv.model_name, args.seed))
                warm_s = time.perf_counter() - t
                before = scrape(url)
                comp0 = len(srv.scheduler.engine.compiled.compilations)
                res, wall = asyncio.run(load(url, measured, args.rate, c, args.max_tokens, srv.model_name,
                                             args.seed))
                s = summarize(res, wall, before, scrape(url), passages)
                s["warmup_s"] = round(warm_s, 1)
                s["compiled_while_measuring"] = srv.scheduler.engine.compiled.compilations[comp0:]
                result["reps"][strat].setdefault(str(c), []).append(s)
                print(f"{strat:9s} c={c:2d} rep {rep}: {s['output_tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{s['ttft_p50_ms']:7.0f} p99 {s['ttft_p99_ms']:7.0f} ms  TPOT p50 {s['tpot_p50_ms'] or 0:6.1f} "
                      f"p99 {s['tpot_p99_ms'] or 0:6.1f} ms  ITL p99 {s['itl_p99_ms'] or 0:6.0f} max "
                      f"{s['itl_max_ms'] or 0:6.0f} ms  accept {s['acceptance_rate'] or 0:.3f} "
                      f"len {s['mean_acceptance_length'] or 1:.2f}  failed {s['failed']}  "
                      f"prefix hits {s['prefix_cache_hit_rate'] or 0:.2f}  "
                      + (f"TTFT first {s['ttft_first_p50_ms']:.0f} repeat {s['ttft_repeat_p50_ms']:.0f} "
                         f"cached {s['ttft_cached_p50_ms'] or 0:.0f} ms (p50s)  " if passages is not None else "") + f"(warm-up {warm_s:.0f} s, "
                      f"{len(s['compiled_while_measuring'])} compiled while measuring)", flush=True)
                uv.should_exit = True
                th.join(120)
        for strat in args.strategies:  # per level: the mean of the repeats' numbers
            reps = result["reps"][strat][str(c)]
            result["runs"][strat][str(c)] = {k: (round(float(np.mean([r[k] for r in reps])), 3)
                                                 if all(isinstance(r.get(k), (int, float)) for r in reps) else reps[-1][k])
                                             for k in reps[0]}
        base = args.strategies[0]  # speedups against the first strategy
        g = result["runs"][base][str(c)]
        for strat in args.strategies[1:]:
            r = result["runs"][strat][str(c)]
            r["baseline"] = base
            r["speedup_vs_baseline"] = round(r["output_tokens_per_s"] / g["output_tokens_per_s"], 3)
            if base == "greedy":
                r["speedup_vs_greedy"] = r["speedup_vs_baseline"]
            if passages is not None and r.get("ttft_repeat_mean_ms") and g.get("ttft_repeat_mean_ms"):
                r["ttft_repeat_vs_baseline"] = round(r["ttft_repeat_mean_ms"] / g["ttft_repeat_mean_ms"], 3)
            if passages is not None and r.get("ttft_cached_mean_ms") and g.get("ttft_first_mean_ms"):
                # a request whose passage was cached against an uncached one (the baseline's firsts)
                r["ttft_cached_vs_baseline_first"] = round(r["ttft_cached_mean_ms"] / g["ttft_first_mean_ms"], 3)
            print(f"  c={c}: {strat} / {base} = {r['speedup_vs_baseline']:.2f}x "
                  f"(per repeat: {[round(a['output_tokens_per_s'] / b['output_tokens_per_s'], 2) for a, b in zip(result['reps'][strat][str(c)], result['reps'][base][str(c)])]})"
                  + (f", repeats' TTFT {r['ttft_repeat_vs_baseline']:.2f}x" if 'ttft_repeat_vs_baseline' in r else "")
                  + (f", cached TTFT / {base}'s first questions' {r['ttft_cached_vs_baseline_first']:.2f}"
                     if 'ttft_cached_vs_baseline_first' in r else ""),
                  flush=True)
        digests = {r["outputs_sha256"] for st in args.strategies for r in result["reps"][st][str(c)]}
        result.setdefault("identical_outputs", {})[str(c)] = len(digests) == 1
        print(f"  c={c}: outputs identical across strategies and repeats: {len(digests) == 1}", flush=True)
        save(result, args.out)  # after every level: a long run keeps what it measured
    save(result, args.out)
    plot(result, str(Path(args.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
