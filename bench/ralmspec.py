"""RaLMSpec vs RaLM (iterative retrieval-augmented generation) and speculative KNN-LM.

    python bench/ralmspec.py                                        # 10 NQ questions, every retriever and method
    python bench/ralmspec.py --n 2 --max-new-tokens 24 --retrievers bm25 knnlm   # quick look
    python bench/ralmspec.py --retrievers dense hnsw --configs os3 async lookahead
    python bench/ralmspec.py --ignore-eos                           # fixed length: a separate, labelled result

Corpus: `wiki_passages.jsonl` (23,867 passages: the unique NQ gold passages and 10,033
Wikipedia lead summaries; found as bench/common.py finds its data, `$LOOKAHEAD_JAX_DATA`),
every index built once beforehand (a missing one stops the script with the command):

    python -m lookahead_jax.retrieval build --corpus wiki_passages.jsonl --retriever bm25
    python -m lookahead_jax.retrieval build --corpus wiki_passages.jsonl --retriever hnsw  # dense embeddings first

Questions: the first `--n` rows of `nq_rag.jsonl` whose gold passage is in the corpus, the
question alone as a chat message (the model's chat template, as `generate --chat`; RaLM
puts the passage inside the user turn, before the question, so a re-prefill keeps the K/V
of the template's head: `reused_tokens`). The default model (SmolLM2-135M-Instruct) in f32,
greedy, generation stopping at EOS (at most `--max-new-tokens`). Per question every method
runs back to back in one process (this machine's speed drifts 20-30% within minutes, so the
methods compared share the drift):

  retrievers bm25 | dense (exact MiniLM inner product) | hnsw (faiss HNSW, approximate):
    ralm         RaLM(stride=4): the top-1 passage before the prompt, re-retrieved from the
                 full index every 4 generated tokens. Run before and after the others; its
                 time is the mean of the two: the baseline of the rows below
    spec         RaLMSpec(speculation_stride=3, prefetch=1): each retrieval speculated from a
                 per-request cache of the top-1 of every real retrieval, 3 of them verified
                 by one batched retrieval, rollback to the first wrong one
    +prefetch    the same with prefetch=20 (the cache gets every real retrieval's top-20)
    +os3         speculation_stride="auto" (OS3 picks s from measured costs), prefetch=20
    +async       +os3 with async_verify=True (skipped, with a note, when RaLMSpec has no
                 such field)
    ralmspec+lookahead   the last of +async / +os3 available, with lookahead="auto"
                 (n-gram trie drafts; one trie per retriever, warm across the questions)
  knnlm (exact device search) | knnlm-hnsw (faiss HNSW over the datastore):
    knnlm        KNN-LM (k=32, lambda=0.25): a real search every token; before and after
                 the other, mean: the baseline
    knnlm-spec   speculative=True (RaLMSpec for KNN-LM), speculation_stride --knn-stride
    knnlm-spec-ivf   the same with knn_speculate="ivf": an approximate faiss IVF index's
                 candidates beside the cache (--knn-speculate picks the rows: cache ivf)
  none:
    greedy       plain greedy decoding without retrieval (a reference, one run)

Every RaLMSpec variant must give the ralm baseline's tokens for the same retriever, and
knnlm-spec knnlm's: checked per question; a difference prints a MISMATCH line and goes to
"mismatches" in the JSON (the run goes on).

KNN-LM datastore: the whole corpus would take ~9 h of a 2-core CPU, so the datastore is
built over a fixed subset (once: it is cached, keyed by the subset's sha256): the gold
passages of the first `--knn-gold` questions (32) plus passages evenly spaced over the
corpus, `--knn-passages` (256) in all, written to
`<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/bench/knnlm-subset-<sha12>.jsonl` and built
as `python -m lookahead_jax.knnlm build --corpus <that file> --hnsw` would (~6 min here).

Reported per retriever and method: time (perf_counter around generate, less the compile
seconds generate reports: compilation is excluded, as in every benchmark here, and summed
apart), retrieval (ralm/ralmspec: `retrieval_s`, every full-index call and cache lookup;
knnlm: `search_s`, the real searches, verification included; knnlm-spec's cache searches
run inside its decode step and count as decode), decode = time - retrieval, forward steps,
tokens/s, speculation accuracy (verified speculations that were right; knnlm-spec: the
speculated neighbour list equalled the true one), mean speculation stride (mean over the
questions of each call's), rollbacks, speedup = the baseline's time / the method's time
(summed over questions; the tokens are the same). The paper's speedups (RaLMSpec, Zhang et
al., ICML 2024; an A10 GPU, larger models and retrievers) are printed beside ours. Saves
JSON (command, host CPU) to bench/results/ralmspec.json and a bar plot of the speedups.

`--retrieval-server KIND=HOST:PORT` (repeatable): the KIND group (bm25 | dense | hnsw)
retrieves from a server started as `python -m lookahead_jax.retrieval serve --retriever KIND
--corpus <this corpus> --port PORT` instead of in this process (its kind and corpus sha256
are checked; the JSON's `retrieval_servers` names it). The search then runs outside this
process's GIL, so +async overlaps a real search with decoding; every call pays a local
round trip (~1 ms here).

`--retrieval-latency MS` (a SIMULATION, labelled in the output and the JSON): every full-index
call of bm25/dense/hnsw sleeps MS ms first, once per call whatever its number of queries, as
when one scan of a large index dominates (the paper's 21M-passage Wikipedia, a remote
service); the cache lookups are not slowed. It shows what RaLMSpec saves where retrieval
costs what it costs there; the real numbers above are the headline.

Fairness: every method is run once on the first question before timing (compiles; not
timed); the retrievers' batch shapes and the query encoder's length buckets are warmed
too. The dense retrievers remember query embeddings across calls (an LRU: within a call
the speculation and its verification must embed a query identically); it is emptied before
every timed call, so no method reuses embeddings that another computed for the question.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA, bar_plot, default_out, eos_mode, host_line, read_jsonl, save  # noqa: E402

RAG = ("bm25", "dense", "hnsw")
KNN = {"knnlm": "exact", "knnlm-hnsw": "hnsw"}  # group -> KNNLM.knn_search
# RaLMSpec ablations, in the paper's order: each adds one technique to the one before
CONFIGS = {
    "spec": dict(speculation_stride=3, prefetch=1),
    "prefetch": dict(speculation_stride=3, prefetch=20),
    "os3": dict(speculation_stride="auto", prefetch=20),
    "async": dict(speculation_stride="auto", prefetch=20, async_verify=True),
}
LABELS = {"spec": "spec", "prefetch": "+prefetch", "os3": "+os3", "async": "+async",
          "lookahead": "ralmspec+lookahead"}
# RaLMSpec (Zhang et al., ICML 2024), speedup over its RaLM / KNN-LM baselines on an A10 GPU
PAPER = {"bm25": "1.31-1.77x", "dense": "1.75-2.39x (exact)", "hnsw": "1.04-1.39x (approximate)",
         "knnlm": "up to 7.59x (exact)", "knnlm-hnsw": "up to 2.45x (approximate)"}
SUMS = ("time_s", "wall_s", "compile_s", "retrieval_s", "verify_s", "speculation_s", "forward_steps", "new_tokens",
        "full_index_queries", "retrieval_calls", "speculations", "speculation_checks", "speculation_hits",
        "tokens_kept", "rollbacks", "rollback_tokens", "reprefills", "passage_changes", "reprefill_tokens",
        "reused_tokens", "ivf_s", "verify_wait_s", "verify_wait_end_s", "blocking_verify_s")
ASYNC = ("verify_wait_s", "verify_wait_end_s", "blocking_verify_s")  # +async: the retrieval time not hidden


# ----------------------------------------------------------------------------- data
def load_questions(corpus, n: int) -> list:
    """The first n rows of nq_rag.jsonl (distinct questions) whose gold passage (`context`)
    is in the corpus, with its corpus position as `gold`."""
    pos = {}
    for i in range(len(corpus)):
        pos.setdefault(corpus[i].text, i)
    out, seen = [], set()
    for r in read_jsonl("nq_rag.jsonl", 1 << 30):
        q = r["question"].strip()
        if r["context"] in pos and q not in seen:
            seen.add(q)
            out.append(dict(question=q, answer=r["answer"], gold=pos[r["context"]]))
            if len(out) >= n:
                break
    return out


def knn_subset(corpus_path: Path, gold: list, total: int) -> tuple:
    """(path, positions): a JSON Lines file of the gold passages plus passages evenly spaced
    over the corpus, `total` in all, in corpus order, lines copied verbatim (the same
    arguments give the same bytes, hence the same cached datastore)."""
    from lookahead_jax.retrieval import cache_root

    lines = [ln for ln in corpus_path.read_text().splitlines() if ln.strip()]
    keep = list(dict.fromkeys(gold))[:total]
    others = total - len(keep)
    if others > 0:
        step = len(lines) / others
        chosen, have = [], set(keep)
        for j in range(len(lines)):  # evenly spaced, skipping the gold ones (then the next free)
            i = int(j * step) if j < others else j - others
            while i in have and i + 1 < len(lines):
                i += 1
            if i not in have:
                have.add(i)
                chosen.append(i)
            if len(chosen) == others:
                break
        keep += chosen
    positions = sorted(keep)
    text = "".join(lines[i] + "\n" for i in positions)
    sha = hashlib.sha256(text.encode()).hexdigest()
    path = cache_root().parent / "bench" / f"knnlm-subset-{sha[:12]}.jsonl"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path, positions


# ----------------------------------------------------------------------------- one call
class Latency:
    """A retriever whose full-index calls (`retrieve`) take `seconds` longer, once per call
    whatever the number of queries: a stand-in for an index whose scan dominates (the
    paper's 21M-passage Wikipedia; a remote service). Speculation (`retrieve_from`, the
    cache) is not slowed. time.sleep releases the GIL, as the real libraries do."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.corpus = inner, seconds, inner.corpus

    def retrieve(self, queries, k):
        time.sleep(self.seconds)
        return self.inner.retrieve(queries, k)

    def retrieve_from(self, queries, candidates, k):
        return self.inner.retrieve_from(queries, candidates, k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def forget_queries(retriever) -> None:
    """Empty a dense retriever's query-embedding LRU (module docstring: fairness)."""
    clear = getattr(retriever, "clear_query_cache", None)
    if clear is not None:
        clear()


def warm_retriever(r, text: str) -> None:
    """Compile the query encoder's length buckets and the search's batch shapes (dense;
    BM25 compiles nothing) before any timed call."""
    words = (text.split() * 200)[:200]
    qs = [" ".join(words[:n]) for n in (4, 16, 32, 48, 64, 96, 128, 160)]
    for q in qs:
        r.retrieve([q], 20)
    import numpy as np

    for Q in (1, 2, 4, 8, 16, 32):
        batch = [qs[i % len(qs)] + f" {i}" for i in range(Q)]
        r.retrieve(batch, 20)
        r.retrieve(batch, 1)
        r.retrieve_from(batch, [np.arange(min(20, len(r.corpus)))] * Q, 1)
    forget_queries(r)


def run(lj, model, tok, x, a, retriever=None, **kw) -> tuple:
    """(output, record): one timed generate call and the numbers this benchmark sums."""
    forget_queries(retriever)
    t0 = time.perf_counter()
    out = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos, **kw)
    dt = time.perf_counter() - t0
    s = out.stats
    rec = dict(time_s=dt - s["compile_s"], wall_s=s["wall_s"], compile_s=s["compile_s"],
               forward_steps=s["forward_steps"], new_tokens=s["new_tokens"])
    k = s.get("retrieval") or {}  # the run's counters (strategies/speculation.py: one shape)
    if "searches" in k:  # knnlm: searches of its datastore
        rec.update(retrieval_s=k["search_s"], full_index_queries=k["searches"], retrieval_calls=k["search_calls"])
    elif "retrievals" in k:  # ralm / ralmspec: calls to the full index
        rec.update(retrieval_s=k["retrieval_s"], full_index_queries=k["retrievals"],
                   retrieval_calls=k["retrieval_calls"], reprefills=k["reprefills"],
                   passage_changes=sum(len(h) - 1 for h in s["passages"]))
        if "reused_tokens" in k:  # context tokens the re-prefills forwarded / kept in the cache
            rec.update(reprefill_tokens=k["reprefill_tokens"], reused_tokens=k["reused_tokens"])
    if "speculations" in k:  # ralmspec, speculative knnlm (SpeculationStats)
        rec.update({x: k[x] for x in ("verify_s", "speculation_s", "speculations", "speculation_checks",
                                      "speculation_hits", "rollbacks", "rollback_tokens", "mean_speculation_stride")})
        if "tokens_kept" in k:  # knnlm: checked positions whose token stood
            rec["tokens_kept"] = k["tokens_kept"]
        if "ivf_s" in k:  # knnlm-spec-ivf: host time in the IVF index (inside the speculative steps)
            rec["ivf_s"] = k["ivf_s"]
        rec.update({x: k[x] for x in ASYNC if x in k})
    return out, rec


def mean_record(r1: dict, r2: dict) -> dict:
    """The baseline's record: the mean of its runs before and after the others."""
    return {key: (v + r2[key]) / 2 if isinstance(v, (int, float)) else v for key, v in r1.items()}


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------- report
def summarize(recs: list, base: list = None) -> dict:
    """One method's numbers over the questions (`base`: its baseline's records)."""
    tot = {key: sum(r.get(key, 0) for r in recs) for key in SUMS}
    t = tot["time_s"]
    m = dict(time_s=round(t, 3), retrieval_s=round(tot["retrieval_s"], 3),
             decode_s=round(t - tot["retrieval_s"], 3),
             retrieval_fraction=round(tot["retrieval_s"] / t, 3) if t > 0 else None,
             forward_steps=round(tot["forward_steps"], 1), new_tokens=round(tot["new_tokens"], 1),
             tokens_per_s=round(tot["new_tokens"] / t, 3) if t > 0 else 0.0,
             compile_s=round(tot["compile_s"], 3), runs_that_compiled=sum(r["compile_s"] > 0 for r in recs))
    for key in ("full_index_queries", "retrieval_calls", "reprefills", "passage_changes", "reprefill_tokens",
                "reused_tokens"):
        if any(key in r for r in recs):
            m[key] = round(tot[key], 1)
    if any("speculations" in r for r in recs):
        strides = [r["mean_speculation_stride"] for r in recs if r.get("speculations")]  # calls that speculated
        checks = tot["speculation_checks"]
        m.update(verify_s=round(tot["verify_s"], 3), speculation_s=round(tot["speculation_s"], 3),
                 speculations=tot["speculations"], speculation_checks=checks,
                 speculation_accuracy=round(tot["speculation_hits"] / checks, 4) if checks else None,
                 mean_speculation_stride=round(sum(strides) / len(strides), 3) if strides else None,
                 rollbacks=tot["rollbacks"], rollback_tokens=tot["rollback_tokens"])
        m.update({x: round(tot[x], 3) for x in ASYNC if any(x in r for r in recs)})
        if any("tokens_kept" in r for r in recs):
            m["tokens_kept_fraction"] = round(tot["tokens_kept"] / checks, 4) if checks else None
        if any("ivf_s" in r for r in recs):
            m["ivf_s"] = round(tot["ivf_s"], 3)
    if base is not None:
        bt = sum(r["time_s"] for r in base)
        br = sum(r.get("retrieval_s", 0) for r in base)
        m["speedup"] = round(bt / t, 3) if t > 0 else None
        m["retrieval_speedup"] = round(br / tot["retrieval_s"], 3) if tot["retrieval_s"] > 0 else None
        m["per_question_speedup"] = [round(b["time_s"] / r["time_s"], 3) for b, r in zip(base, recs)]
    return m


def table(result: dict) -> str:
    head = (f"{'retriever':11s} {'method':19s} {'time s':>8s} {'retr s':>7s} {'decode s':>8s} {'steps':>6s} "
            f"{'tok/s':>6s} {'acc':>6s} {'mean s':>6s} {'rollb':>5s} {'speedup':>7s}  same tokens / paper")
    lines = [head, "-" * len(head)]
    for g, grp in result["retrievers"].items():
        for name, m in grp["methods"].items():
            acc, s, sp = m.get("speculation_accuracy"), m.get("mean_speculation_stride"), m.get("speedup")
            acc = "" if acc is None else f"{acc:.2f}"
            s = "" if s is None else f"{s:.2f}"
            sp = "" if sp is None else f"{sp:.2f}x"
            lines.append(
                f"{g:11s} {name:19s} {m['time_s']:8.2f} {m['retrieval_s']:7.2f} {m['decode_s']:8.2f} "
                f"{m['forward_steps']:6.0f} {m['tokens_per_s']:6.2f} {acc:>6s} {s:>6s} "
                f"{m.get('rollbacks', ''):>5} {sp:>7s}  {m.get('identical_to_baseline', '')}")
        if g in PAPER:
            lines.append(f"{'':11s} {'paper (A10 GPU)':19s} {'':>67s}{PAPER[g]}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    groups = {g: dict(methods={n: m for n, m in grp["methods"].items() if m.get("speedup") is not None
                               and n != grp.get("baseline")})
              for g, grp in result["retrievers"].items() if grp.get("baseline")}
    groups = {g: v for g, v in groups.items() if v["methods"]}
    if not groups:
        return
    view = dict(result, datasets=groups, prompts_label=f"{result['questions']} NQ questions")
    bar_plot(view, path, f"speedup vs RaLM / KNN-LM (same tokens)\n{Path(result['model']).name} ({result['dtype']})",
             fmt="%.2f", key="speedup", ylabel="speedup vs baseline", ref_line=1.0)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    from lookahead_jax.presets import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local path (default: %(default)s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=10, help="NQ questions (default 10)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true", help="fixed length (a separate, labelled result)")
    ap.add_argument("--retrievers", nargs="+", default=[*RAG, *KNN], choices=[*RAG, *KNN],
                    help="groups to run (default: all): bm25 dense hnsw (RaLM / RaLMSpec), knnlm knnlm-hnsw")
    ap.add_argument("--configs", nargs="+", default=list(LABELS), choices=list(LABELS),
                    help="RaLMSpec rows (default: all): spec prefetch os3 async lookahead")
    ap.add_argument("--no-greedy", action="store_true", help="skip the plain greedy reference row")
    ap.add_argument("--stride", type=int, default=4, help="RaLM's retrieval stride in tokens (default 4)")
    ap.add_argument("--corpus", default=str(DATA / "wiki_passages.jsonl"), help="the passages (JSON Lines)")
    ap.add_argument("--knn-passages", type=int, default=256, help="passages in the KNN-LM datastore (default 256)")
    ap.add_argument("--knn-gold", type=int, default=32,
                    help="the gold passages of the first N questions are in it (default 32)")
    ap.add_argument("--knn-stride", default="auto", help="knnlm-spec's speculation_stride (default auto)")
    ap.add_argument("--knn-cache-next", type=int, default=None,
                    help="knnlm-spec's knn_cache_next: entries after each neighbour kept in its cache (default: the "
                         "strategy's)")
    ap.add_argument("--knn-speculate", nargs="+", default=["cache", "ivf"], choices=["cache", "ivf"],
                    help="knnlm-spec rows: cache (RaLMSpec's cache: knnlm-spec) and/or ivf (plus IVF "
                         "candidates: knnlm-spec-ivf); default both")
    ap.add_argument("--knn-nprobe", type=int, default=None, help="knnlm-spec-ivf's knn_nprobe (default: the "
                    "strategy's)")
    ap.add_argument("--retrieval-latency", type=float, default=0.0, metavar="MS",
                    help="SIMULATION: every full-index call of bm25/dense/hnsw takes MS ms longer (a "
                         "stand-in for a large or remote index; results are labelled; default 0)")
    ap.add_argument("--retrieval-server", action="append", default=[], metavar="KIND=HOST:PORT",
                    help="the KIND group (bm25|dense|hnsw) retrieves from this server (python -m "
                         "lookahead_jax.retrieval serve --retriever KIND --corpus <the corpus>); repeatable")
    ap.add_argument("--out", help="JSON path (PNG beside it); default bench/results/ralmspec.json")
    a = ap.parse_args(argv)
    servers = {}  # group -> HOST:PORT
    for spec in a.retrieval_server:
        g, _, addr = spec.partition("=")
        if g not in RAG or not addr:
            ap.error(f"--retrieval-server {spec!r}: expected KIND=HOST:PORT with KIND one of {', '.join(RAG)}")
        if g not in a.retrievers:
            ap.error(f"--retrieval-server {spec!r}: {g} is not among --retrievers {' '.join(a.retrievers)}")
        servers[g] = addr
    a.out = a.out or default_out("ralmspec" + (f"-latency{a.retrieval_latency:g}ms" if a.retrieval_latency else ""),
                                 a.ignore_eos)
    ie = a.ignore_eos
    corpus_path = Path(a.corpus).expanduser()
    if not corpus_path.is_file():
        sys.exit(f"error: {corpus_path} not found; set LOOKAHEAD_JAX_DATA to the folder holding wiki_passages.jsonl")

    import lookahead_jax as lj
    from lookahead_jax.core.budget import AcceptanceStats
    from lookahead_jax.drafters.trie import TrieDrafter
    from lookahead_jax.retrieval import IndexUnavailable, RemoteRetrievalError, RemoteRetriever, load_corpus, load_retriever
    from lookahead_jax.drafters.ngram_trie import NgramTrie

    sim = f" | SIMULATED: +{a.retrieval_latency:g} ms per full-index call" if a.retrieval_latency else ""
    print(host_line(), f"| {eos_mode(ie)}{sim}", flush=True)
    corpus = load_corpus(corpus_path)
    rag = [g for g in a.retrievers if g in RAG]
    knn = [g for g in a.retrievers if g in KNN]
    # every index first: a missing one stops the run (with its build command) before any work
    retrievers = {}
    for g in rag:
        try:
            if g in servers:  # the same corpus (sha256 checked), the server's index
                retrievers[g] = RemoteRetriever(servers[g], corpus=corpus)
                if retrievers[g].kind != g:
                    sys.exit(f"error: the server at {servers[g]} serves {retrievers[g].kind!r}, not {g!r}")
                print(f"{g}: {retrievers[g]!r}", flush=True)
            else:
                retrievers[g] = load_retriever(g, corpus)
            if a.retrieval_latency > 0:
                retrievers[g] = Latency(retrievers[g], a.retrieval_latency / 1e3)
        except (IndexUnavailable, RemoteRetrievalError, ValueError) as e:
            sys.exit(f"error: {e}")
    qs = load_questions(corpus, max(a.n, a.knn_gold if knn else 0))
    questions = qs[:a.n]
    model, tok = lj.load(a.model, dtype=a.dtype)
    # each question as a chat message (as generate --chat): RaLM puts the passage inside the
    # user turn before the question, so a re-prefill keeps the K/V of the template's head
    ids = [[{"role": "user", "content": q["question"]}] for q in questions]

    has_async = "async_verify" in {f.name for f in dataclasses.fields(lj.RaLMSpec)}
    skipped = {}
    configs = [c for c in a.configs if c != "lookahead"]
    if "async" in configs and not has_async:
        configs.remove("async")
        skipped["+async"] = "RaLMSpec has no async_verify field in this version"
        print("note: +async skipped: RaLMSpec has no async_verify field in this version", flush=True)
    la_base = "async" if has_async else "os3"

    def rag_methods(r) -> dict:
        ms = {"ralm": dict(strategy=lj.RaLM(retriever=r, stride=a.stride))}
        for c in configs:
            ms[LABELS[c]] = dict(strategy=lj.RaLMSpec(retriever=r, stride=a.stride, **CONFIGS[c]))
        if "lookahead" in a.configs:
            ms[LABELS["lookahead"]] = dict(strategy=lj.RaLMSpec(retriever=r, stride=a.stride, lookahead="auto",
                                                                **CONFIGS[la_base]))
        return ms

    la = lj.Lookahead()
    tries = {g: (NgramTrie(branch_length=la.branch_length), AcceptanceStats()) for g in rag}

    def drafter_kw(g, name, cold=False):
        """ralmspec+lookahead's drafter: the retriever's own trie (warm across its
        questions, as TrieDrafter.shared gives generate), or a throwaway one (warm-up)."""
        if name != LABELS["lookahead"]:
            return {}
        trie, stats = (NgramTrie(branch_length=la.branch_length), AcceptanceStats()) if cold else tries[g]
        return dict(drafter=TrieDrafter(la.branch_length, la.mode, trie=trie, acceptance=stats))

    knn_info = None
    groups = {g: rag_methods(r) for g, r in retrievers.items()}
    if knn:
        from lookahead_jax.knnlm import build_datastore, load_datastore

        gold = [q["gold"] for q in qs[:a.knn_gold]]
        sub, positions = knn_subset(corpus_path, gold, a.knn_passages)
        hnsw = "knnlm-hnsw" in knn  # the HNSW index only when a group searches it (minutes at 1M entries)
        cmd = (f"python -m lookahead_jax.knnlm build --model {a.model} --dtype {a.dtype} --corpus {sub}"
               + " --hnsw" * hnsw)
        print(f"KNN-LM datastore over {len(positions)} passages ({len(set(gold))} gold passages of the first "
              f"{len(gold)} questions + evenly spaced others): {sub}\n  (built once, as `{cmd}`)", flush=True)
        t0 = time.perf_counter()
        path = build_datastore(model, tok, sub, hnsw=hnsw, progress=True)
        ds = load_datastore(model, sub, path)
        files = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
        knn_info = dict(subset=str(sub), passages=len(positions), gold_passages=len(set(gold)),
                        gold_of_first_questions=len(gold), corpus_positions=positions, datastore=str(path),
                        entries=ds.size, dim=ds.dim, key_dtype=ds.meta.get("key_dtype"),
                        datastore_mib=round(ds.nbytes / 2**20, 1), files_mib=round(files / 2**20, 1),
                        build_s=ds.meta.get("build_s"), build_command=cmd)
        print(f"  {ds.size:,} entries x {ds.dim} ({knn_info['key_dtype']}), {knn_info['datastore_mib']} MiB "
              f"({knn_info['files_mib']} MiB on disk with the HNSW index), ready in {time.perf_counter() - t0:.0f} s "
              f"(build {knn_info['build_s']} s)", flush=True)
        if a.n > a.knn_gold:
            print(f"note: questions past the first {a.knn_gold} have no gold passage in the KNN-LM datastore")
        for g in knn:
            kw = dict(datastore=str(path), corpus=str(sub), knn_search=KNN[g])
            spec = dict(kw, speculative=True, speculation_stride=a.knn_stride,
                        **({} if a.knn_cache_next is None else dict(knn_cache_next=a.knn_cache_next)))
            groups[g] = {"knnlm": dict(strategy=lj.KNNLM(**kw))}
            if "cache" in a.knn_speculate:
                groups[g]["knnlm-spec"] = dict(strategy=lj.KNNLM(**spec))
            if "ivf" in a.knn_speculate:
                groups[g]["knnlm-spec-ivf"] = dict(strategy=lj.KNNLM(
                    **spec, knn_speculate="ivf", **({} if a.knn_nprobe is None else dict(knn_nprobe=a.knn_nprobe))))
    if not a.no_greedy:
        groups["none"] = {"greedy": dict()}
    baseline = {g: ("ralm" if g in RAG else "knnlm" if g in KNN else None) for g in groups}

    # ---- warm-up: every method once on the first question (compiles; not timed)
    t0 = time.perf_counter()
    for g, r in retrievers.items():
        warm_retriever(r, questions[0]["question"] + " " + corpus[questions[0]["gold"]].text)
    for g, ms in groups.items():
        for name, kw in ms.items():
            run(lj, model, tok, ids[0], a, retrievers.get(g), **kw, **drafter_kw(g, name, cold=True))
    print(f"warm-up (every method on question 0, not timed): {time.perf_counter() - t0:.0f} s", flush=True)

    result = dict(model=a.model, dtype=a.dtype, max_new_tokens=a.max_new_tokens, stop_at_eos=not ie,
                  simulated_retrieval_latency_ms=a.retrieval_latency or None,
                  retrieval_servers={g: dict(address=addr, simulated_latency_ms=retrievers[g].simulated_latency_ms
                                             or None) for g, addr in servers.items()} or None,
                  eos_token_ids=[] if ie else sorted(getattr(tok, "eos_token_ids", ()) or ()),
                  questions=a.n, stride=a.stride, corpus=dict(path=corpus_path.name, passages=len(corpus),
                                                              sha256=corpus.fingerprint),
                  chat_template=True, async_verify_available=has_async, lookahead_base=LABELS[la_base],
                  knnlm_datastore=knn_info, skipped=skipped, paper_targets_a10=PAPER, mismatches=[],
                  retrievers={})
    recs = {g: {n: [] for n in ms} for g, ms in groups.items()}
    same = {g: {n: 0 for n in ms} for g, ms in groups.items()}
    per_q = {g: [] for g in groups}
    for i, (q, x) in enumerate(zip(questions, ids)):
        for g, ms in groups.items():
            r = retrievers.get(g)
            outs = {}
            for name, kw in ms.items():
                outs[name] = run(lj, model, tok, x, a, r, **kw, **drafter_kw(g, name))
            base = baseline[g]
            if base is not None:  # the baseline again after the others: its time is the mean of the two
                again = run(lj, model, tok, x, a, r, **ms[base])
                ref = outs[base][0].rows[0].token_ids
                if again[0].rows[0].token_ids != ref:
                    bad = dict(question=i, retriever=g, method=f"{base} (again)",
                               position=first_difference(again[0].rows[0].token_ids, ref))
                    result["mismatches"].append(bad)
                    print(f"!!! MISMATCH: {g} {base} run twice gave different tokens on question {i} "
                          f"(from position {bad['position']})", flush=True)
                outs[base] = (outs[base][0], mean_record(outs[base][1], again[1]))
            line = f"[q{i} {g}] {len(outs[next(iter(outs))][0].rows[0].token_ids)} tok:"
            for name, (out, rec) in outs.items():
                recs[g][name].append(rec)
                toks = out.rows[0].token_ids
                if base is not None and name != base:
                    ok = toks == outs[base][0].rows[0].token_ids
                    same[g][name] += ok
                    if not ok:
                        bad = dict(question=i, retriever=g, method=name, tokens=len(toks),
                                   baseline_tokens=len(outs[base][0].rows[0].token_ids),
                                   position=first_difference(toks, outs[base][0].rows[0].token_ids))
                        result["mismatches"].append(bad)
                        print(f"!!! MISMATCH: {g} {name} differs from {base} on question {i} "
                              f"({q['question']!r}) from token {bad['position']} ({len(toks)} vs "
                              f"{bad['baseline_tokens']} tokens)", flush=True)
                line += f" {name} {rec['time_s']:.2f}s"
                if base is not None and name != base:
                    line += f" ({outs[base][1]['time_s'] / rec['time_s']:.2f}x" + ("" if toks == outs[base][0].rows[0].token_ids else ", DIFFERS") + ")"
            print(line, flush=True)
            first = outs[base or next(iter(outs))][0]
            per_q[g].append(dict(question=q["question"], gold_answer=q["answer"], answer=first.rows[0].text,
                                 tokens=len(first.rows[0].token_ids), finish=first.rows[0].finish_reason,
                                 **({"passages": first.stats["passages"][0]} if "passages" in first.stats else {})))
        # the table so far (partial results survive a run cut short)
        for g, ms in groups.items():
            base = baseline[g]
            methods = {}
            for name in ms:
                m = summarize(recs[g][name], recs[g][base] if base and name != base else None)
                if base and name != base:
                    m["identical_to_baseline"] = f"{same[g][name]}/{i + 1}"
                methods[name] = m
            result["retrievers"][g] = dict(baseline=base, paper_a10=PAPER.get(g), methods=methods,
                                           per_question=per_q[g])
        save(result, a.out)
    print(f"\n== {a.n} NQ questions, {a.model} ({a.dtype}), {eos_mode(ie)}, <= {a.max_new_tokens} new tokens{sim}; "
          f"speedup vs the group's baseline (ralm / knnlm), 'same tokens' = identical to it")
    print(table(result))
    if result["mismatches"]:
        print(f"!!! {len(result['mismatches'])} MISMATCHES (see 'mismatches' in {a.out})")
    else:
        print("every RaLMSpec / speculative KNN-LM output was identical to its baseline's")
    plot(result, str(Path(a.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
