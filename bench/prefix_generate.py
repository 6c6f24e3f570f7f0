"""`generate(prefix_cache=)` on an evaluation loop: GSM8K questions behind one 8-shot
header, greedy, stopping at EOS, with the prefix cache and without, alternated (ABBA) in one
process.

The header: the first 8 examples of the repository's data/gsm8k_sample.jsonl (question and
worked answer, calculator marks <<...>> removed), as "Question: ...\\nAnswer: ...\\n\\n"; the
questions: the next `--questions` of GSM8K's test split ($LOOKAHEAD_JAX_DATA/gsm8k_test.jsonl,
rows 8 on; without it the repository's sample, rows 8 on: 32 at most), each prompt the
header + "Question: <q>\\nAnswer:". `--batch` rows per generate call (default: all in one
call); every call gets one cache length (as the CLI's batches), so later calls can hit.

Off: generate as it is (whole prompts). On: prompts in 64-token blocks through the prefix
cache, emptied before every run, so each run prefills the header once (its first row) and
every other row takes its blocks. Every configuration runs once untimed first (compilation
excluded; on the first call's rows), then `--rounds` x ABBA (off, on, on, off; `--order AB`:
off, on). Per run: the calls' wall time, the
generate stats' wall (compilation excluded) and prefill (time to every row's first token),
prompt tokens forwarded (prompt tokens - cache hits), header tokens forwarded (rows x
header - hits: the header's last, partial block is forwarded by every row), hit rate (hit
tokens / looked-up tokens) and the tokens (the same in every run: checked; where they are
not, one more run prefills in blocks with a cache too small to keep one, which tells block
prefill's numerics, e.g. bf16 on an accelerator, apart from the cache: only the latter fails).

    python bench/prefix_generate.py                      # 40 questions, 128 new tokens
    python bench/prefix_generate.py --questions 3 --max-new-tokens 8 --out /tmp/smoke.json

Prints a line per run and a summary; JSON to bench/results/prefix-generate.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA, ROOT, host_line, read_jsonl, save  # noqa: E402

SHOTS = 8


def _example(row: dict, answer: bool = True) -> str:
    q = f"Question: {row['question']}\nAnswer:"
    return q + " " + re.sub(r"<<[^>]*>>", "", row["answer"]).strip() + "\n\n" if answer else q


def prompts(n: int) -> tuple:
    """(header text, its 8 example questions, the n question prompts, where they came from)."""
    sample = read_jsonl(ROOT / "data" / "gsm8k_sample.jsonl", 40)
    header = "".join(_example(r) for r in sample[:SHOTS])
    full = DATA / "gsm8k_test.jsonl"
    if full.exists():
        rows, source = read_jsonl(full, SHOTS + n)[SHOTS:], f"{full} rows {SHOTS}.."
    else:
        rows, source = sample[SHOTS:SHOTS + n], f"data/gsm8k_sample.jsonl rows {SHOTS}.. (no {full})"
    shots = {r["question"] for r in sample[:SHOTS]}
    if any(r["question"] in shots for r in rows):
        sys.exit("error: a question of the run is one of the header's examples")
    return header, [header + _example(r, answer=False) for r in rows], source


def run(model, tok, texts: list, batch: int, S: int, max_new: int, cache: int) -> dict:
    """Every prompt through generate in calls of `batch` rows: wall time, stats, tokens."""
    from lookahead_jax.generate import generate

    tokens, stats = [], []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        out = generate(model, tok, texts[i:i + batch], max_new_tokens=max_new, max_cache_len=S,
                             first_index=i, prefix_cache=cache or None)
        tokens += out.token_ids
        stats.append(out.stats)
    call_s = time.perf_counter() - t0

    def total(k):
        return sum(s.get(k, 0) for s in stats)

    return dict(call_s=round(call_s, 4), wall_s=round(total("wall_s"), 4), prefill_s=round(total("prefill_s"), 4),
                compile_s=round(total("compile_s"), 3), prompt_tokens=total("prompt_tokens"),
                hits=total("prefix_cache_hits"), queries=total("prefix_cache_queries"),
                stored=total("prefix_cache_stored"), new_tokens=total("new_tokens"), tokens=tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--batch", type=int, default=0, help="rows per generate call (default 0: all in one call)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds (off, on, on, off) after the warm-up")
    ap.add_argument("--order", default="ABBA", choices=("ABBA", "AB"),
                    help="a round's runs: ABBA (off, on, on, off; the default) or AB (off, on: one run each, "
                         "for long sets; labelled in the JSON)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="no untimed first runs (the stats' wall times exclude compilation anyway; the calls' "
                         "times then include it)")
    ap.add_argument("--prefix-cache-mb", type=float, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefix-generate.json"))
    a = ap.parse_args(argv)
    if a.questions < 1 or a.batch < 0 or a.max_new_tokens < 1 or a.rounds < 1 or not a.prefix_cache_mb > 0:
        ap.error("--questions, --max-new-tokens, --rounds and --prefix-cache-mb must be positive, --batch >= 0")

    import lookahead_jax as lj
    from lookahead_jax.core.buckets import CACHE_ROUND
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.prefix_cache import PrefixCache

    print(host_line(), flush=True)
    enable_compilation_cache()
    model, tok = lj.load(a.model, dtype=a.dtype)[:2]
    engine = lj.engine_for(model)
    header, texts, source = prompts(a.questions)
    H = len(tok.encode(header))  # with BOS
    longest = max(len(tok.encode(t)) for t in texts)
    S = max(CACHE_ROUND, 1 << (longest + a.max_new_tokens).bit_length())  # one cache length for every call
    batch = a.batch or len(texts)
    budget = int(a.prefix_cache_mb * 2 ** 20)
    print(f"{len(texts)} questions ({source}), header {H} tokens, longest prompt {longest}, cache {S}, "
          f"{batch} rows a call", flush=True)

    runs = {"off": [], "on": []}
    round_ = ["off", "on", "on", "off"] if a.order == "ABBA" else ["off", "on"]
    warm = 0 if a.no_warm_up else 2
    order = ["off", "on"][:warm] + round_ * a.rounds  # the first `warm`: warm-up (compilation), one call's rows
    for i, name in enumerate(order):
        engine.stores.clear(PrefixCache)  # every run prefills the header once
        res = run(model, tok, texts[:batch] if i < warm else texts, batch, S, a.max_new_tokens,
                  budget if name == "on" else 0)
        rows = len(texts[:batch]) if i < warm else len(texts)
        res["prompt_forwarded"] = res["prompt_tokens"] - res["hits"]
        res["header_forwarded"] = rows * H - res["hits"]
        res["hit_rate"] = round(res["hits"] / res["queries"], 4) if res["queries"] else 0.0
        print(f"{'warm-up' if i < warm else 'run'} {name:3}: calls {res['call_s']:.2f} s, wall {res['wall_s']:.2f} s, "
              f"prefill {res['prefill_s']:.2f} s, compile {res['compile_s']:.1f} s, prompt tokens forwarded "
              f"{res['prompt_forwarded']} of {res['prompt_tokens']} (header {res['header_forwarded']} of {rows * H}), "
              f"hit rate {res['hit_rate']:.3f}, {res['new_tokens']} new tokens", flush=True)
        if i >= warm:
            runs[name].append(res)
        else:
            runs.setdefault("warm_up", []).append(dict(res, config=name))
    want = runs["off"][0]["tokens"]
    same = all(r["tokens"] == want for rs in runs.values() for r in rs)
    chunked_same = None
    if not same:  # whole vs block prefill (other matmul shapes) or the cache? A 1-byte cache: blocks, none kept
        engine.stores.clear(PrefixCache)
        chunked = run(model, tok, texts, batch, S, a.max_new_tokens, 1)["tokens"]
        chunked_same = all(r["tokens"] == chunked for r in runs["on"])
        print(f"tokens differ from whole-prompt prefill; the cache's runs equal block prefill without it: "
              f"{chunked_same}", flush=True)

    def med(name, k):
        return round(statistics.median(r[k] for r in runs[name]), 4)

    summary = {f"{k}_{name}": med(name, k) for k in ("call_s", "wall_s", "prefill_s") for name in ("off", "on")}
    summary.update(
        prefill_speedup=round(summary["prefill_s_off"] / summary["prefill_s_on"], 3) if summary["prefill_s_on"] else None,
        wall_speedup=round(summary["wall_s_off"] / summary["wall_s_on"], 3) if summary["wall_s_on"] else None,
        header_forwarded_on=runs["on"][0]["header_forwarded"], header_forwarded_off=runs["off"][0]["header_forwarded"],
        prompt_forwarded_on=runs["on"][0]["prompt_forwarded"], prompt_tokens=runs["on"][0]["prompt_tokens"],
        hit_rate=runs["on"][0]["hit_rate"], same_tokens=same,
        **({} if same else {"on_same_as_block_prefill_without_cache": chunked_same}))
    print(json.dumps(summary), flush=True)
    for rs in runs.values():  # tokens once, checked equal
        for r in rs:
            r.pop("tokens")
    save(dict(model=a.model, dtype=a.dtype, questions=len(texts), source=source, shots=SHOTS, header_tokens=H,
              batch=batch, max_new_tokens=a.max_new_tokens, stop_at_eos=True, cache_len=S, order=a.order,
              rounds=a.rounds,
              prefix_cache_mb=a.prefix_cache_mb, warm_up=not a.no_warm_up, summary=summary, runs=runs, tokens=want), a.out)
    if not same and not chunked_same:
        print("error: the prefix cache changed the tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
