"""Speculative KNN-LM, decided at the start (speculative="auto") or forced, vs plain KNN-LM.

    python bench/knnlm_spec.py                              # a ~26K-entry store, 6 questions x 48 tokens
    python bench/knnlm_spec.py --passages 208 1024          # and a ~130K-entry one
    python bench/knnlm_spec.py --n 2 --max-new-tokens 8 --passages 8 --out /tmp/smoke.json   # smoke

Datastores: as bench/ralmspec.py builds its KNN-LM store (`knn_subset`): the gold passages of
the first `--gold` (32) NQ questions plus passages evenly spaced over wiki_passages.jsonl,
`--passages` in all (208 ~ 26K entries, 256 ~ 35K, 8400 ~ 1M), built once with
`python -m lookahead_jax.knnlm build` and cached. Questions: the first `--n` NQ questions
whose gold passage is in the corpus, each as a chat message, greedy, SmolLM2-135M in f32,
stopping at EOS (at most `--max-new-tokens`), batch 1. Methods, per store:

    plain    KNNLM(speculative=False): a real search every token (the baseline)
    auto     KNNLM(speculative="auto", speculation_stride="auto"): speculates only where the
             costs measured at the start (a search against a forward, strategies/knnlm_decision.py)
             predict a gain, else plain KNN-LM
    forced   KNNLM(speculative=True, speculation_stride=--forced-stride (default 4, the
             strategy's default)): speculates whatever it costs

Timing: perf_counter around generate less the compile seconds it reports. Every method runs
once untimed first (compilation, and auto's cost measurement: once per engine, datastore,
settings and batch, kept on the engine as compilation is; its seconds are reported as
`auto_measure_s`; `--measure-every-call` measures again in every timed call instead: the
worst case). Per question the methods run in a rotated order (q0: plain auto forced, q1:
auto forced plain, ...), `--rounds` times, so drift on a shared host is shared. Every
method's tokens must equal plain's (a MISMATCH line and "mismatches" in the JSON otherwise).
Reported: time, tokens/s, searches, speedup = plain's summed time / the method's, auto's
decision (costs, choice, predicted speedup). JSON: bench/results/knnlm-spec-auto.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, eos_mode, host_line, save  # noqa: E402
from ralmspec import first_difference, knn_subset, load_questions  # noqa: E402

METHODS = ("plain", "auto", "forced")


def strategies(lj, path, sub, a) -> dict:
    kw = dict(datastore=str(path), corpus=str(sub))
    return {"plain": lj.KNNLM(**kw, speculative=False),
            "auto": lj.KNNLM(**kw, speculative="auto", speculation_stride="auto"),
            "forced": lj.KNNLM(**kw, speculative=True, speculation_stride=a.forced_stride)}


def clear_costs(engine) -> None:
    """Forget auto's measured costs (every datastore and setting) on this engine."""
    from lookahead_jax.knnlm.search import KnnlmStore

    for m in engine.stores.of(KnnlmStore).os3.values():
        m.costs.clear()


def one(lj, model, tok, x, strat, a) -> tuple:
    t0 = time.perf_counter()
    out = lj.generate(model, tok, [x], strategy=strat, max_new_tokens=a.max_new_tokens)
    dt = time.perf_counter() - t0
    s, k = out.stats, out.stats["retrieval"]
    rec = dict(time_s=dt - s["compile_s"], compile_s=s["compile_s"], new_tokens=s["new_tokens"],
               searches=k["searches"], search_s=k["search_s"], speculations=k.get("speculations", 0),
               rollbacks=k.get("rollbacks", 0), decision_s=k.get("decision_s", 0.0))
    return out, rec, k.get("speculation_decision")


def bench_store(lj, model, tok, engine, corpus_path, qs, passages: int, a) -> dict:
    from lookahead_jax.knnlm import build_datastore, load_datastore

    gold = [q["gold"] for q in qs[:a.gold]]
    sub, positions = knn_subset(corpus_path, gold, passages)
    t0 = time.perf_counter()
    path = build_datastore(model, tok, sub, progress=True)
    ds = load_datastore(model, sub, path)
    print(f"store: {len(positions)} passages, {ds.size:,} entries ({path}), ready in {time.perf_counter() - t0:.0f} s",
          flush=True)
    strats = strategies(lj, path, sub, a)
    msgs = [[{"role": "user", "content": q["question"]}] for q in qs[:a.n]]
    warm = {}
    clear_costs(engine)  # auto measures in its warm-up call, not in a timed one
    for name in METHODS:  # compilation (and auto's measurement) out of the timed calls
        warm[name] = one(lj, model, tok, msgs[0], strats[name], a)[1]
    recs = {m: [] for m in METHODS}
    decisions, mismatches, per_q = [], [], []
    for r in range(a.rounds):
        for i, x in enumerate(msgs):
            k = (i + r) % len(METHODS)
            order = METHODS[k:] + METHODS[:k]
            outs = {}
            for name in order:
                if name == "auto" and a.measure_every_call:
                    clear_costs(engine)
                out, rec, d = one(lj, model, tok, x, strats[name], a)
                outs[name] = out.rows[0].token_ids
                recs[name].append(rec)
                if name == "auto":
                    decisions.append(d)
            for name in METHODS[1:]:
                if outs[name] != outs["plain"]:
                    bad = dict(round=r, question=i, method=name,
                               position=first_difference(outs[name], outs["plain"]))
                    mismatches.append(bad)
                    print(f"!!! MISMATCH: {name} differs from plain on question {i} from token {bad['position']}",
                          flush=True)
            line = " ".join(f"{n} {recs[n][-1]['time_s']:.2f}s" for n in METHODS)
            print(f"[{ds.size:,} entries, round {r} q{i}] {len(outs['plain'])} tok: {line} "
                  f"(auto: {(decisions[-1] or {}).get('speculate')})", flush=True)
            if r == 0:
                per_q.append(dict(question=qs[i]["question"], tokens=len(outs["plain"])))
    base = sum(x["time_s"] for x in recs["plain"])
    methods = {}
    for name, rs in recs.items():
        t = sum(x["time_s"] for x in rs)
        toks = sum(x["new_tokens"] for x in rs)
        methods[name] = dict(time_s=round(t, 3), new_tokens=toks, tokens_per_s=round(toks / t, 3) if t else None,
                             speedup=round(base / t, 3) if t else None,
                             per_call_speedup=[round(b["time_s"] / x["time_s"], 3) for b, x in zip(recs["plain"], rs)],
                             searches=sum(x["searches"] for x in rs), search_s=round(sum(x["search_s"] for x in rs), 3),
                             speculations=sum(x["speculations"] for x in rs),
                             rollbacks=sum(x["rollbacks"] for x in rs),
                             decision_s=round(sum(x["decision_s"] for x in rs), 4),
                             compile_s=round(sum(x["compile_s"] for x in rs), 3),
                             identical_to_plain=f"{len(rs) - sum(m['method'] == name for m in mismatches)}/{len(rs)}")
    return dict(passages=len(positions), entries=ds.size, datastore=str(path), subset=str(sub),
                build_s=ds.meta.get("build_s"), methods=methods, auto_measure_s=round(warm["auto"]["decision_s"], 4),
                auto_decisions=decisions, auto_speculated=sum(bool(d and d["speculate"]) for d in decisions),
                mismatches=mismatches, per_question=per_q)


def main(argv=None):
    from lookahead_jax.presets import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local path (default: %(default)s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=6, help="NQ questions (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--passages", type=int, nargs="+", default=[208],
                    help="datastore sizes in passages, one store each (default 208: ~26K entries)")
    ap.add_argument("--gold", type=int, default=32, help="gold passages of the first GOLD questions in every store")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the questions (default 1)")
    ap.add_argument("--forced-stride", default="4", help="forced's speculation_stride (default 4; or auto)")
    ap.add_argument("--measure-every-call", action="store_true",
                    help="auto measures its costs in every timed call (default: once per engine, untimed)")
    ap.add_argument("--corpus", default=str(DATA / "wiki_passages.jsonl"), help="the passages (JSON Lines)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "knnlm-spec-auto.json"))
    a = ap.parse_args(argv)
    if a.n < 1 or a.max_new_tokens < 1 or a.rounds < 1 or any(p < 1 for p in a.passages):
        ap.error("--n, --max-new-tokens, --rounds and --passages must be >= 1")
    a.forced_stride = a.forced_stride if a.forced_stride == "auto" else int(a.forced_stride)
    corpus_path = Path(a.corpus).expanduser()
    if not corpus_path.is_file():
        sys.exit(f"error: {corpus_path} not found; set LOOKAHEAD_JAX_DATA to the folder holding wiki_passages.jsonl")

    import lookahead_jax as lj
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.retrieval import load_corpus

    print(host_line(), f"| {eos_mode(False)}", flush=True)
    qs = load_questions(load_corpus(corpus_path), max(a.n, a.gold))
    model, tok = lj.load(a.model, dtype=a.dtype)
    engine = engine_for(model)
    result = dict(model=a.model, dtype=a.dtype, questions=a.n, max_new_tokens=a.max_new_tokens, rounds=a.rounds,
                  forced_stride=a.forced_stride, measure_every_call=a.measure_every_call, stores=[])
    for p in a.passages:
        result["stores"].append(bench_store(lj, model, tok, engine, corpus_path, qs, p, a))
        save(result, a.out)
    print(f"\n== {a.n} NQ questions x <= {a.max_new_tokens} tokens, {a.model} ({a.dtype}), {a.rounds} round(s); "
          f"speedup vs plain KNN-LM (same tokens required)")
    for st in result["stores"]:
        m = st["methods"]
        print(f"{st['entries']:>10,} entries: " + "  ".join(
            f"{n} {m[n]['time_s']:.2f}s ({m[n]['speedup']:.3f}x)" for n in METHODS)
            + f"  auto speculated in {st['auto_speculated']}/{len(st['auto_decisions'])} calls"
            + f", measured once in {st['auto_measure_s']:.3f}s")
    bad = sum(len(st["mismatches"]) for st in result["stores"])
    print(f"!!! {bad} MISMATCHES (see {a.out})" if bad else "every output identical to plain KNN-LM's")


if __name__ == "__main__":
    main()
