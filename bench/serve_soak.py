"""Soak run of the server (`lookahead_jax.serve`): a long stream of short requests with
random cancellations (a stream closed after a few chunks) and malformed bodies mixed in,
resident memory sampled throughout.

    python bench/serve_soak.py --requests 1000 --concurrency 16

Checks: every request is answered (none lost: a malformed one with 400, a normal one
with its tokens), greedy requests of the same prompt and length give the same tokens
whatever they were batched with (none corrupted), all slots are free at the end; reports
RSS after warm-up and at the end. Writes bench/results/serve-soak.json.

The prefix cache under load (issue 53): `--rag` gives that share of the normal requests a
long prompt, an NQ question with its passage (60 prompts, three per passage: hits), and a
small `--prefix-cache-mb` makes it evict all along; the cache's bytes are sampled with the
RSS and must stay within the bound, and the same prompt still gives the same tokens:

    python bench/serve_soak.py --requests 1000 --concurrency 16 --rag 0.3 --prefix-cache-mb 32 \
        --out bench/results/serve-soak-prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, host_line, save  # noqa: E402
from common import shared_prompts  # noqa: E402
from serve import repo_prompts, start_server  # noqa: E402

BAD = [
    b'{"prompt": "hi", "max_tokens": ',  # broken JSON
    json.dumps({"prompt": 3}).encode(),
    json.dumps({"prompt": "hi", "temperature": -1}).encode(),
    json.dumps({"prompt": "hi", "max_tokens": 10 ** 6}).encode(),
    json.dumps({"prompt": "hi", "n": 0}).encode(),
    json.dumps({"prompt": "hi", "lookahead_jax": {"strategy": "nope"}}).encode(),
    json.dumps({"prompt": [10 ** 9]}).encode(),
    b"not json at all",
]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run(url: str, model: str, n: int, concurrency: int, seed: int, p_cancel: float, p_bad: float,
              progress: list, rag: float = 0.0):
    import httpx

    rng = random.Random(seed)
    prompts = [p for p in repo_prompts() if len(json.dumps(p[1])) <= 400][:40]  # short: many requests
    long = [("chat", m) for m in shared_prompts(60, 3, max_chars=2400)[0]]  # a passage and a question
    sem = asyncio.Semaphore(concurrency)
    seen: dict = {}
    stats = dict(ok=0, bad_400=0, cancelled=0, lost=0, corrupted=0, other=[])

    async def one(i: int, http):
        kind = rng.random()
        async with sem:
            try:
                if kind < p_bad:
                    r = await http.post(url + "/v1/completions", content=rng.choice(BAD),
                                        headers={"content-type": "application/json"})
                    if r.status_code == 400 and r.json()["error"]["message"]:
                        stats["bad_400"] += 1
                    else:
                        stats["other"].append(f"malformed body got {r.status_code}")
                    return
                k, p = rng.choice(long if rng.random() < rag else prompts)
                max_tokens = rng.choice((2, 4, 8))
                body = dict(model=model, max_tokens=max_tokens, temperature=0, return_token_ids=True)
                path = "/v1/chat/completions" if k == "chat" else "/v1/completions"
                body.update(messages=p) if k == "chat" else body.update(prompt=p)
                if kind < p_bad + p_cancel:
                    body["stream"] = True
                    body["max_tokens"] = 32
                    async with http.stream("POST", url + path, json=body) as r:
                        got = 0
                        async for line in r.aiter_lines():
                            got += line.startswith("data: ")
                            if got >= rng.choice((1, 2, 3)):
                                break
                    stats["cancelled"] += 1
                    return
                r = await http.post(url + path, json=body)
                if r.status_code != 200:
                    stats["lost"] += 1
                    stats["other"].append(f"request got {r.status_code}: {r.text[:200]}")
                    return
                ids = r.json()["choices"][0]["token_ids"]
                key = (json.dumps(p), max_tokens)
                if key in seen and seen[key] != ids:
                    stats["corrupted"] += 1
                seen.setdefault(key, ids)
                stats["ok"] += 1 if ids else 0
                stats["lost"] += 0 if ids else 1
            except Exception as e:  # noqa: BLE001 - count it as lost, with why
                stats["lost"] += 1
                stats["other"].append(f"{type(e).__name__}: {e}")
            finally:
                progress[0] += 1
                if progress[0] % 50 == 0:
                    print(f"{progress[0]} requests, rss {rss_mb():.0f} MB, {stats['ok']} ok, {stats['bad_400']} "
                          f"bad, {stats['cancelled']} cancelled, {stats['lost']} lost", flush=True)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as http:
        await asyncio.gather(*(one(i, http) for i in range(n)))
    stats["distinct_greedy_requests"] = len(seen)
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--strategy", default="lookahead")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--decoding-length", type=int, default=0, help="lookahead's tree budget (0: the server's default, auto)")
    ap.add_argument("--draft", default=None, help="specinfer's draft model (as bench/serve.py)")
    ap.add_argument("--no-server-warmup", dest="server_warmup", action="store_false",
                    help="skip the server's warm-up (steps compile during the first requests)")
    ap.add_argument("--p-cancel", type=float, default=0.1)
    ap.add_argument("--p-bad", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rag", type=float, default=0.0, help="share of normal requests with an NQ passage (long "
                    "prompts, three questions per passage: the prefix cache hits; default 0)")
    ap.add_argument("--prefix-cache-mb", type=float, default=None,
                    help="the server's prefix cache (default: the server's default; 0: off)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve-soak.json"))
    args = ap.parse_args(argv)
    if args.prefix_cache_mb is None:
        from lookahead_jax.serve.server import DEFAULT_PREFIX_CACHE_MB
        args.prefix_cache_mb = DEFAULT_PREFIX_CACHE_MB

    import lookahead_jax as lj
    from lookahead_jax.core.prefix_cache import PrefixCache

    model, tok = lj.load(args.model, progress=False)
    srv, uv, th, url = start_server(args, args.strategy, args.max_batch, model, tok)
    progress, samples, stop = [0], [], threading.Event()

    def cache_bytes() -> int:
        pc = srv.scheduler.engine.stores.peek(PrefixCache)
        return pc.bytes if pc is not None else 0

    def sample():  # (seconds, requests done, RSS MB, prefix cache bytes)
        t0 = time.perf_counter()
        while not stop.is_set():
            samples.append((round(time.perf_counter() - t0, 1), progress[0], round(rss_mb(), 1), cache_bytes()))
            stop.wait(2.0)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    stats = asyncio.run(run(url, srv.model_name, args.requests, args.concurrency, args.seed, args.p_cancel,
                            args.p_bad, progress, args.rag))
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    sched = srv.scheduler
    deadline = time.time() + 120  # prefix-cache warm jobs (chat answers) run once nothing else does:
    while sched.warm_pending and time.time() < deadline:  # each holds a slot until its last block
        time.sleep(0.1)
    stats.update(slots_free_at_end=len(sched.slots.free_slots), max_batch=args.max_batch,
                 running_at_end=len(sched.running), waiting_at_end=len(sched.waiting), engine_errors=sched.errors,
                 warm_jobs_pending_at_end=sched.warm_pending)
    stop.set()
    warm = [s for s in samples if s[1] >= args.requests // 10]
    stats.update(wall_s=round(wall, 1), rss_mb_after_warmup=warm[0][2] if warm else None,
                 rss_mb_end=samples[-1][2] if samples else None, rss_mb_max=max(s[2] for s in samples),
                 rss_samples=samples, other=stats["other"][:20])
    pc = srv.scheduler.engine.stores.peek(PrefixCache)
    if pc is not None:
        bound = int(args.prefix_cache_mb * 2 ** 20)
        stats.update(prefix_cache=pc.summary(), prefix_cache_bound=bound,
                     prefix_cache_bytes_max=max(s[3] for s in samples),
                     prefix_cache_within_bound=max(s[3] for s in samples) <= bound)
    uv.should_exit = True
    th.join(120)
    print(host_line())
    print({k: v for k, v in stats.items() if k != "rss_samples"})
    save(dict(strategy=args.strategy, decoding_length=args.decoding_length or "auto (server default)",
              rag=args.rag, prefix_cache_mb=args.prefix_cache_mb,
              server_warmup=args.server_warmup, requests=args.requests, concurrency=args.concurrency, **stats), args.out)


if __name__ == "__main__":
    main()
