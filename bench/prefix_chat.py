"""Multi-turn chat through the server: the second turn's time to first token (TTFT) with the
prefix cache (its warm jobs cache turn 1's answer while the user thinks) and without it
(`--prefix-cache-mb 0`), alternated.

MT-bench is not in the repository's data/ (nor in $LOOKAHEAD_JAX_DATA here), so the
conversations are MT-bench-like two-turn chats built from data/: a GSM8K question (turn 1)
then a follow-up asking to check the solution another way, and an NQ question with its gold
passage then a follow-up asking to explain the answer from the passage, in turn (as MT-bench's
second turns, the follow-up needs the first answer: the whole conversation is the prompt).

Per conversation and configuration (cache on / off, the order alternating ABBA over
conversations and rounds): turn 1 is sent (streamed, `--max-tokens`), its answer becomes
the assistant turn, and `--think-s` seconds after turn 1 ended turn 2 is sent (streamed,
`--max-tokens-2`): its TTFT (send to first content) is the measure. With the cache on, the
server queued a warm job when turn 1 ended, which forwards [turn 1's prompt, answer, end of
turn] in prefill blocks into the cache while nobody waits (`core.prefix_warm`); turn 2's
prompt then takes those blocks. Turn 1's and turn 2's texts are checked equal between the
configurations (greedy; lossless), and the cache's counters recorded (/metrics). Before
each conversation the on-server's cache is emptied (its warm job done first), so a round
repeats nothing of the last one. Both servers run in this process on one engine (one
conversation at a time), every step program compiled before anything is timed, and one
unmeasured conversation per server first; greedy by default (the engine's drafting stores
are shared: the second configuration would draft turn 1 from the first's answer; TTFT,
a prefill and one token, does not depend on the strategy). `warm_done_before_turn2` says
whether the warm job had ended when turn 2 was sent (if not, turn 2 takes the blocks it
had stored and prefills the rest itself).

    python bench/prefix_chat.py --conversations 8 --rounds 2 --out bench/results/prefix-chat.json
    python bench/prefix_chat.py --conversations 2 --rounds 1 --max-tokens 96 --out /tmp/smoke.json  # a smoke run

Prints a line per conversation and saves JSON.
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
FOLLOW_UPS = {"gsm8k": "Check your solution by solving the problem another way. Do both ways agree?",
              "nq": "Explain your answer in two sentences, quoting the passage."}


def conversations(n: int) -> list:
    """n (kind, turn-1 messages, turn-2 question) from data/: GSM8K and NQ RAG in turn."""
    data = ROOT / "data"
    passages = {}
    for line in open(data / "passages.jsonl"):
        r = json.loads(line)
        passages[r["id"]] = r["text"]
    gsm = [json.loads(x) for x in open(data / "gsm8k_sample.jsonl")]
    nq = [json.loads(x) for x in open(data / "nq_questions.jsonl")
          if len(passages.get(json.loads(x)["passage_id"], "")) <= 1200]
    out = []
    for i in range(n):
        if i % 2 == 0:
            q = gsm[(i // 2) % len(gsm)]["question"]
            out.append(("gsm8k", [{"role": "user", "content": q}], FOLLOW_UPS["gsm8k"]))
        else:
            q = nq[(i // 2) % len(nq)]
            out.append(("nq", [{"role": "user", "content": "Answer the question using the passage.\n\nPassage: "
                                f"{passages[q['passage_id']]}\n\nQuestion: {q['question']}?"}], FOLLOW_UPS["nq"]))
    return out


def turn(url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat request: its text, TTFT (send to first content) and end."""
    import httpx

    body = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    t0, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", ()):
                delta = (c.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    t1 = time.perf_counter()
    return dict(text="".join(text), ttft_s=round((first or t1) - t0, 4), e2e_s=round(t1 - t0, 4))


def counters(url: str) -> dict:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("lookahead_jax:prefix_cache") or line.startswith("lookahead_jax:prompt_tokens_total"):
            name = line.split("{")[0].split(":")[1]
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def idle(srv, timeout: float = 600.0) -> None:
    """Until the server holds no job and no warm job (so nothing overlaps what is timed next)."""
    sched, end = srv.scheduler, time.time() + timeout
    while (sched.running or sched.waiting or sched.warm_pending) and time.time() < end:
        time.sleep(0.02)


def chat(srv, url: str, model: str, conv, a) -> dict:
    """Turn 1, the think time, turn 2 (module docstring); with the server's counters gained."""
    _, msgs, follow = conv
    before = counters(url)
    one = turn(url, model, msgs, a.max_tokens)
    time.sleep(a.think_s)
    warm_done = not srv.scheduler.warm_pending  # did the warm job end within the think time?
    two = turn(url, model, msgs + [{"role": "assistant", "content": one["text"]}, {"role": "user", "content": follow}],
               a.max_tokens_2)
    idle(srv)
    after = counters(url)
    gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return dict(turn1=one, turn2=two, warm_done_before_turn2=warm_done, counters=gained)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--strategy", default="greedy", help="the servers' (both share one engine: with lookahead the "
                    "second configuration's turn 1 would draft from the first's identical answer)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the conversations (orders alternate)")
    ap.add_argument("--max-tokens", type=int, default=256, help="turn 1's answer length at most")
    ap.add_argument("--max-tokens-2", type=int, default=16, help="turn 2's (only its TTFT is measured)")
    ap.add_argument("--think-s", type=float, default=2.0, help="seconds between turn 1's end and turn 2")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--prefix-cache-mb", type=float, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefix-chat.json"))
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.serve import ServeConfig, make_server, start_in_thread
    from common import cold_stores
    from first_run import cpu_name

    enable_compilation_cache()
    model, tok = lj.load(a.model)[:2]
    cold_stores(model)
    servers = {}
    for on in (False, True):
        cfg = ServeConfig(model=a.model, strategy=a.strategy, max_batch=a.max_batch, max_len=a.max_len,
                          prefill_chunk=a.prefill_chunk, prefix_cache_mb=a.prefix_cache_mb if on else 0,
                          warmup="none")
        srv = make_server(cfg, model, tok)
        srv.scheduler.warm_up()  # every step program compiled before anything is timed
        uv, th, url = start_in_thread(srv)
        servers[on] = (srv, uv, th, url)
    convs = conversations(a.conversations)
    rows = {False: [], True: []}
    try:
        for on in (True, False):  # one unmeasured conversation each: every path run once
            srv, _, _, url = servers[on]
            chat(srv, url, a.model, conversations(a.conversations + 1)[-1], a)
        k = 0
        for r in range(a.rounds):
            for i, conv in enumerate(convs):
                order = (True, False) if k % 4 in (0, 3) else (False, True)  # ABBA
                k += 1
                res = {}
                for on in order:
                    srv, _, _, url = servers[on]
                    if on:
                        idle(srv)
                        srv.scheduler.slots.prefix.cache.clear()  # (idle: nothing else touches it)
                    res[on] = chat(srv, url, a.model, conv, a)
                same = all(res[True][t]["text"] == res[False][t]["text"] for t in ("turn1", "turn2"))
                for on in (False, True):
                    rows[on].append(dict(round=r, conversation=i, kind=conv[0], same_text=same, **res[on]))
                c = res[True]["counters"]
                print(f"round {r} conv {i} ({conv[0]}): turn-2 TTFT on {res[True]['turn2']['ttft_s']:.3f} s, "
                      f"off {res[False]['turn2']['ttft_s']:.3f} s; turn-1 answer "
                      f"{len(tok.encode(res[True]['turn1']['text'], add_special_tokens=False))} tokens; warm "
                      f"{c.get('prefix_cache_warm_tokens_total', 0):.0f} tokens, done before turn 2: "
                      f"{res[True]['warm_done_before_turn2']}; same text: {same}", flush=True)
    finally:
        for srv, uv, th, _ in servers.values():
            uv.should_exit = True
            th.join(120)

    def med(on, key):
        return statistics.median(x[key]["ttft_s"] for x in rows[on])

    hits = sum(x["counters"].get("prefix_cache_hits_total", 0) for x in rows[True])
    queries = sum(x["counters"].get("prefix_cache_queries_total", 0) for x in rows[True])
    summary = dict(turn2_ttft_on_s=med(True, "turn2"), turn2_ttft_off_s=med(False, "turn2"),
                   turn1_ttft_on_s=med(True, "turn1"), turn1_ttft_off_s=med(False, "turn1"),
                   same_text=all(x["same_text"] for x in rows[True]), pairs=len(rows[True]),
                   warm_done_before_turn2=sum(x["warm_done_before_turn2"] for x in rows[True]),
                   hit_rate=round(hits / max(queries, 1), 3))
    summary["turn2_on_over_off"] = round(summary["turn2_ttft_on_s"] / summary["turn2_ttft_off_s"], 3)
    summary["turn2_on_over_off_per_pair_median"] = round(statistics.median(
        x["turn2"]["ttft_s"] / y["turn2"]["ttft_s"] for x, y in zip(rows[True], rows[False])), 3)
    print(json.dumps(summary))
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model, strategy=a.strategy,
               max_batch=a.max_batch, max_len=a.max_len, prefill_chunk=a.prefill_chunk,
               prefix_cache_mb=a.prefix_cache_mb, think_s=a.think_s, max_tokens=a.max_tokens,
               max_tokens_2=a.max_tokens_2, data="MT-bench-like 2-turn chats from data/ (GSM8K, NQ RAG): "
               "MT-bench is not in the repository", follow_ups=FOLLOW_UPS, summary=summary,
               conversations={"on": rows[True], "off": rows[False]})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
