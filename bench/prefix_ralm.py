"""The prefix cache in RaLMSpec (issue 53): re-prefill time with and without it.

    python bench/prefix_ralm.py                          # 18 NQ questions, 3 per passage, dense
    python bench/prefix_ralm.py --n 6 --corpus-size 500 --max-new-tokens 32   # quick look

A retrieval run re-prefills `[head, passage, question, answer so far]` whenever the passage
changes; with the prefix cache a passage some request had before (after the same chat
head) comes from the cache, and the re-prefill forwards only the rest. This runs NQ
questions, three per gold passage (repeated traffic, as a RAG service sees it), the
question alone as a chat message (RaLM puts the passage inside the user turn), through
`Slots` built as the server builds them (`--slots` slots, 64-token prefill blocks,
requests inserted as slots free), with RaLMSpec (OS3's stride, prefetch 20) and a retriever
over a subset of the shared corpus (`wiki_passages.jsonl`: the questions' gold passages
plus passages evenly spaced over it, `--corpus-size` in all; the dense index is built once
and cached). Per round (alternated ABBA over `--rounds`): RaLMSpec with the cache, RaLMSpec
without, and (round 0) RaLM with the cache, each on an emptied cache. Reported: wall time,
re-prefills and their seconds, tokens they forwarded / kept / took from the cache, the
cache's hit rate over every lookup and the re-prefills' own (the share of the tokens they
forward without the cache that it supplied); every run's tokens and passages must equal RaLM's (checked; a
difference is a MISMATCH in the JSON). Compile time is excluded (a first unmeasured pass
over other questions compiles every step). SmolLM2-135M f32, greedy, stop at EOS.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, ROOT, host_line, read_jsonl, save  # noqa: E402
from ralmspec import knn_subset  # noqa: E402

CHUNK = 64  # the server's prefill block


def shared_questions(corpus, n: int, per: int = 3, skip: int = 0) -> list:
    """n NQ questions, `per` distinct ones per gold passage found in the corpus, the
    questions of one passage one after another (after skipping `skip` passages):
    [(question, corpus position of its gold passage)]."""
    pos = {}
    for i in range(len(corpus)):
        pos.setdefault(corpus[i].text, i)
    by = defaultdict(list)
    for r in read_jsonl("nq_rag.jsonl", 1 << 30):
        if r["context"] in pos:
            q = r["question"].strip()
            if q not in by[r["context"]]:
                by[r["context"]].append(q)
    out = []
    for ctx, qs in by.items():
        if len(qs) >= per:
            if skip:
                skip -= 1
                continue
            out += [(q, pos[ctx]) for q in qs[:per]]
        if len(out) >= n:
            break
    return out[:n]


def run(engine, tok, strat, questions, args, cache: bool, eos) -> dict:
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.prefix_cache import PrefixCache
    from lookahead_jax.core.slots import Request, Slots
    from lookahead_jax.prompts import encode_prompts

    engine.stores.clear(PrefixCache)  # every run starts with an empty cache
    msgs = [[{"role": "user", "content": q + "?"}] for q, _ in questions]
    ids, spans = encode_prompts(tok, msgs, chat=True, spans=True)
    reqs = [Request(x, GenerationParams(max_new_tokens=args.max_new_tokens), question_span=sp)
            for x, sp in zip(ids, spans)]
    slots = Slots(engine, tok, args.slots, args.max_len, strat, eos_ids=eos, prefill_chunk=CHUNK,
                  prefix_cache=(args.prefix_cache_mb << 20) if cache else None)
    queue, holder, out = list(enumerate(reqs)), {}, {}
    t0 = time.perf_counter()
    try:
        while queue or slots.busy:
            while queue and slots.free_slots:  # a request enters as soon as a slot is free
                i, req = queue.pop(0)
                s = slots.free_slots[-1]
                holder[s] = i
                slots.insert(s, req)
            for ev in slots.step():
                if ev.finish:
                    row = slots.free(ev.slot)
                    out[holder[ev.slot]] = (row.ids, [tuple(p.values()) for p in row.retrieval["passages"]])
        wall = time.perf_counter() - t0
        c = slots.run.counters()
    finally:
        slots.close()
    res = dict(wall_s=round(wall, 3), tokens=sum(len(v[0]) for v in out.values()), outputs=[out[i] for i in range(len(reqs))])
    res.update({k: c[k] for k in ("reprefills", "reprefill_s", "reprefill_tokens", "reused_tokens", "retrievals")})
    if cache:
        s = slots.prefix.cache.summary()
        res.update(prefix_cache_queries=s["prefix_cache_queries"], prefix_cache_hits=s["prefix_cache_hits"],
                   prefix_cache_hit_rate=round(s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1), 4))
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=18, help="NQ questions, 3 per passage (default 18)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--retriever", default="dense", choices=["dense", "bm25"])
    ap.add_argument("--corpus", default=str(DATA / "wiki_passages.jsonl"))
    ap.add_argument("--corpus-size", type=int, default=2000, help="passages of the subset (default 2000)")
    ap.add_argument("--stride", type=int, default=4, help="RaLM's retrieval stride (default 4)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--prefix-cache-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix-ralm.json"))
    args = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax import retrieval as R
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.strategies import RaLM, RaLMSpec

    print(host_line(), flush=True)
    full = R.Corpus.from_jsonl(args.corpus)
    measured = shared_questions(full, args.n)
    warm = shared_questions(full, 3, skip=args.n // 3 + 1)  # other passages: compiles every step first
    path, _ = knn_subset(Path(args.corpus), [g for _, g in measured + warm], args.corpus_size)
    corpus = R.Corpus.from_jsonl(path)
    if not R.is_built(args.retriever, corpus):
        print(f"building the {args.retriever} index over {len(corpus)} passages (once; cached)", flush=True)
        R.build_index(args.retriever, corpus, progress=True)
    retriever = R.load_retriever(args.retriever, corpus)
    model, tok = lj.load(args.model, progress=False)
    engine = engine_for(model)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    kw = dict(retriever=retriever, stride=args.stride, query_tokens=32)
    spec = RaLMSpec(**kw, speculation_stride="auto", prefetch=20)
    ralm = RaLM(**kw)
    run(engine, tok, spec, warm, args, True, eos)  # compiles (unmeasured)
    run(engine, tok, spec, warm, args, False, eos)
    base = run(engine, tok, ralm, measured, args, True, eos)
    result = dict(host=host_line(),
                  model=args.model, retriever=args.retriever, corpus_passages=len(corpus), questions=len(measured),
                  max_new_tokens=args.max_new_tokens, slots=args.slots, prefill_chunk=CHUNK,
                  ralm_with_cache={k: v for k, v in base.items() if k != "outputs"}, rounds=[], mismatches=[])
    for rnd in range(args.rounds):
        for cache in ((True, False) if rnd % 2 == 0 else (False, True)):
            r = run(engine, tok, spec, measured, args, cache, eos)
            if r["outputs"] != base["outputs"]:
                bad = [i for i, (a, b) in enumerate(zip(r["outputs"], base["outputs"])) if a != b]
                result["mismatches"].append(dict(round=rnd, cache=cache, questions=bad))
                print(f"MISMATCH round {rnd} cache={cache}: questions {bad}", flush=True)
            row = {k: v for k, v in r.items() if k != "outputs"}
            row.update(round=rnd, cache=cache)
            result["rounds"].append(row)
            print(f"round {rnd} ralmspec {'with' if cache else 'without'} the cache: wall {r['wall_s']:.1f} s, "
                  f"{r['reprefills']} re-prefills in {r['reprefill_s']:.2f} s forwarding {r['reprefill_tokens']} "
                  f"tokens (kept {r['reused_tokens']})"
                  + (f", hit rate {r['prefix_cache_hit_rate']:.2f}" if cache else ""), flush=True)
    on = [r for r in result["rounds"] if r["cache"]]
    off = [r for r in result["rounds"] if not r["cache"]]
    med = lambda rs, k: float(np.median([r[k] for r in rs]))  # noqa: E731
    result["summary"] = dict(
        wall_s_with=med(on, "wall_s"), wall_s_without=med(off, "wall_s"),
        reprefill_s_with=med(on, "reprefill_s"), reprefill_s_without=med(off, "reprefill_s"),
        reprefill_tokens_with=med(on, "reprefill_tokens"), reprefill_tokens_without=med(off, "reprefill_tokens"),
        hit_rate=med(on, "prefix_cache_hit_rate"),
        identical_to_ralm=not result["mismatches"])
    s = result["summary"]
    s["reprefill_time_ratio"] = round(s["reprefill_s_with"] / s["reprefill_s_without"], 3) if s["reprefill_s_without"] else None
    # the re-prefills' own hit rate: the share of the tokens they forward without the cache that
    # the cache supplied (both runs re-prefill the same rows at the same tokens: their outputs
    # are RaLM's). `hit_rate` is the cache's over every lookup, the prompts' first blocks too.
    s["reprefill_hit_rate"] = round(1 - s["reprefill_tokens_with"] / s["reprefill_tokens_without"], 4) \
        if s["reprefill_tokens_without"] else None
    print(f"re-prefill time {s['reprefill_s_with']:.2f} s with the cache vs {s['reprefill_s_without']:.2f} s without "
          f"(x{s['reprefill_time_ratio']}), forwarded tokens {s['reprefill_tokens_with']:.0f} vs "
          f"{s['reprefill_tokens_without']:.0f} (the re-prefills' hit rate {s['reprefill_hit_rate']:.3f}), the "
          f"cache's hit rate {s['hit_rate']:.2f}; wall {s['wall_s_with']:.1f} vs "
          f"{s['wall_s_without']:.1f} s; identical to RaLM: {s['identical_to_ralm']}", flush=True)
    save(result, args.out)


if __name__ == "__main__":
    main()
