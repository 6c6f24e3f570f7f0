"""Replay drafters on recorded greedy outputs: tokens per step, drafted per step, host time.

Lossless decoding makes draft quality a replay question: with greedy's tokens for a prompt
recorded once (bench/suffix_record.py: f32, stop at EOS), the tokens a draft tree gets
accepted at a position are the longest root-to-node path matching greedy's next tokens,
plus one (the verify step's own token). Every drafter here is replayed on the same records,
requests in the order they ran, in one process (so caches over earlier requests warm up
exactly as in a server):

* trie T: today's `TrieDrafter` (lookahead), through the drafter protocol, with a fixed
  budget of T nodes and its global trie shared across the set's requests;
* suffixdecoding: SuffixDecoding's own drafter (arctic-inference 0.3.0, built by
  bench/peers/build_suffix_decoding.sh), driven as its simulator does: `start_request`
  with the prompt (+ references), `speculate` on prompt + output, `add_active_response`
  with the emitted tokens, `stop_request`; its global cache of earlier responses on.
  "defaults" is its simulator's defaults (tree depth 64, max_spec_factor 1, min_token_prob
  0.1, tree speculation); "aggressive" drafts more (factor 4, offset 4, min prob 0.01);
* oracle: the copy oracle: at each step, the longest prefix of the true continuation that
  occurs anywhere in the prompt + references + output so far (any span, any position:
  unlimited tree width and depth); "+ earlier" also in earlier requests' outputs;
  "root-anchored": only spans that follow an occurrence of the root token (the ceiling of
  the trie's and the suffix drafters' kind, which match at least the root);
* suffix (...): the new `drafters.suffix.SuffixDrafter` at a few settings; "cost-trimmed"
  cuts each tree to the prefix with the most expected tokens per unit of verify time
  (`COSTS`, its acceptance calibrated online per match class);
* "... auto budget": the engine's way under decoding_length="auto" (`BudgetAdapter`): the
  drafter proposes its full tree and `core.budget.AutoBudget`, with `COSTS` as its costs
  and the drafter's acceptance statistics, picks the tree size each step (from the nodes'
  calibrated path probabilities for the suffix drafter, from its match classes for the
  trie), as `core.decode.step` does at batch 1.

Besides tokens and drafted tokens per step and host drafting time, `est_speedup` is tokens
per unit of verify time with the measured relative verify costs `COSTS` (a tree is padded
to the next bucket), over greedy's one token per plain step.

    python bench/suffix_replay.py --records /tmp/suffix-records.pkl --peer-dir /tmp/suffix-decoding-peer
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from types import SimpleNamespace

import numpy as np

from common import copy_oracles, host_line, save
from lookahead_jax.core.budget import accepted_length


def accepted(tokens, parents, truth) -> int:
    """Longest root-to-node path of the tree matching `truth` (greedy's next tokens)."""
    return accepted_length(tokens, parents, truth, len(tokens))


# verify cost of a tree of T nodes relative to T = 0 (one token), per tree bucket T (the
# verify step pads a tree to the next bucket), SmolLM2-135M on this 2-core CPU, S = 512
# (bench/results/replay.json: relative_verify_cost)
COSTS = {0: 1.0, 1: 1.0071, 3: 1.15, 7: 1.4878, 15: 1.8759, 31: 3.1741, 63: 5.2473}


def bucket_cost(n: int) -> float:
    return COSTS[next(T for T in COSTS if T >= n)]


def replay_set(recs, make, budget):
    """Replay a drafter over a set's records in order; make() -> adapter with begin(prompt,
    refs, first), propose(context, budget) -> (tokens, parents), emit(tokens), end().
    est_speedup: tokens per unit of verify time over greedy's one token per t(0), with the
    relative costs `COSTS` (decode steps only, host time excluded)."""
    d = make()
    tokens = steps = drafted = 0
    host = cost = 0.0
    for prompt, refs, out in recs:
        d.begin(prompt, refs, out[:1])
        j = 0
        while j < len(out) - 1:
            ctx = prompt + out[:j + 1]
            t0 = time.perf_counter()
            toks, pars = d.propose(ctx, budget)
            host += time.perf_counter() - t0
            a = min(accepted(toks, pars, out[j + 1:]), len(out) - 2 - j)
            tokens += a + 1
            steps += 1
            drafted += len(toks)
            cost += bucket_cost(len(toks))
            d.emit(out[j + 1:j + a + 2])
            j += a + 1
        d.end()
    return dict(tokens_per_step=round(tokens / steps, 3), drafted_per_step=round(drafted / steps, 2),
                est_speedup=round(tokens / cost, 3),
                host_ms_per_step=round(1000 * host / steps, 3), steps=steps)


class _State:
    """A one-row stand-in for the decode state (as bench/replay.py's)."""

    def __init__(self, prompt, first):
        self.row = SimpleNamespace(prompt_ids=list(prompt), ids=list(first))
        self.batch, self.rows, self.active = 1, [self.row], [True]

    def context(self, b):
        return self.row.prompt_ids + self.row.ids


class ProtocolAdapter:
    """Any drafter of the project's protocol (drafters/base.py)."""

    def __init__(self, drafter):
        self.d = drafter

    def begin(self, prompt, refs, first):
        self.state = _State(prompt, first)
        self.d.begin(self.state, [refs])

    def propose(self, ctx, budget):
        dr = self.d.propose(self.state, budget).drafts[0]
        return dr.tokens, dr.parents

    def emit(self, toks):
        self.state.row.ids.extend(toks)
        self.d.update(self.state, SimpleNamespace(kept=[list(toks)]))

    def end(self):
        self.d.end()


class BudgetAdapter(ProtocolAdapter):
    """A drafter whose trees `AutoBudget` sizes, as `core.decode.step` does at batch 1:
    propose the full tree, `plan` the step's size, truncate; `score` after the tokens are
    known. One budget per request (as one per `generate` call) over the drafter's shared
    acceptance statistics; the costs are `COSTS` (no real steps correct them here)."""

    def __init__(self, drafter, budget: int):
        super().__init__(drafter)
        from lookahead_jax.core.budget import AcceptanceStats

        self.buckets = tuple(T for T in COSTS if T <= budget)
        if self.d.acceptance is None:
            self.d.acceptance = AcceptanceStats()

    def begin(self, prompt, refs, first):
        from lookahead_jax.core.budget import AutoBudget

        super().begin(prompt, refs, first)
        self.state.row.finish = None
        self.budget = AutoBudget(self.buckets, {T: COSTS[T] for T in self.buckets}, self.d.acceptance)

    def propose(self, ctx, budget):
        drafts = self.d.propose(self.state, self.budget.max_nodes)
        dr = drafts.truncated(self.budget.plan(drafts, self.state)).drafts[0]
        return dr.tokens, dr.parents

    def emit(self, toks):
        super().emit(toks)
        self.budget.score(self.state)

    def end(self):
        self.state.row.finish = "end"
        self.budget.score(self.state)
        super().end()


class SuffixDecodingAdapter:
    """arctic-inference's SuffixDecodingCache, as its simulator drives it."""

    def __init__(self, cache_cls, depth=64, factor=1.0, offset=0.0, min_prob=0.1, tree=True):
        self.cache = cache_cls(max_tree_depth=depth, max_cached_requests=-1)
        self.kw = dict(max_spec_factor=factor, max_spec_offset=offset, min_token_prob=min_prob, use_tree_spec=tree)
        self.depth = depth
        self.req = 0

    def begin(self, prompt, refs, first):
        self.req += 1
        inputs = list(prompt)
        for r in refs:  # the references are the prompt's passage: its own context, as ours
            inputs += r
        self.cache.start_request(self.req, np.asarray(inputs, np.int32))
        self.cache.add_active_response(self.req, np.asarray(first, np.int32))

    def propose(self, ctx, budget):
        r = self.cache.speculate(self.req, np.asarray(ctx, np.int32), max_spec_tokens=min(budget, self.depth), **self.kw)
        return list(r.token_ids), list(r.parents)

    def emit(self, toks):
        self.cache.add_active_response(self.req, np.asarray(toks, np.int32))

    def end(self):
        self.cache.stop_request(self.req)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="pickle from bench/suffix_record.py")
    ap.add_argument("--peer-dir", default="/tmp/suffix-decoding-peer",
                    help="where bench/peers/build_suffix_decoding.sh built SuffixDecoding (skipped if absent)")
    ap.add_argument("--budget", type=int, default=63, help="most draft nodes per step for the suffix drafters")
    ap.add_argument("--repeat", type=int, default=3, help="replays per drafter; host time is the least "
                    "(the drafts are the same every time; a busy host only adds time)")
    ap.add_argument("--only", nargs="*", help="run only drafters whose name contains one of these")
    ap.add_argument("--out", default=None, help="default bench/results/suffix-replay.json")
    a = ap.parse_args(argv)

    from lookahead_jax.drafters.ngram_trie import NgramTrie
    from lookahead_jax.drafters.suffix import SuffixCache, SuffixDrafter
    from lookahead_jax.drafters.trie import TrieDrafter

    print(host_line(), flush=True)
    sys.path.insert(0, a.peer_dir)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        print(f"SuffixDecoding peer not available ({e}); run bench/peers/build_suffix_decoding.sh")
        SuffixDecodingCache = None

    rec = pickle.loads(open(a.records, "rb").read())
    drafters = {}
    for T in (4, 8, 16, 32):
        drafters[f"trie {T}"] = (lambda T=T: ProtocolAdapter(TrieDrafter(12, "hierarchical", max_nodes=T,
                                                                          trie=NgramTrie(branch_length=12))), T)
    if SuffixDecodingCache is not None:
        drafters["suffixdecoding defaults"] = (lambda: SuffixDecodingAdapter(SuffixDecodingCache), 63)
        drafters["suffixdecoding aggressive"] = (
            lambda: SuffixDecodingAdapter(SuffixDecodingCache, factor=4.0, offset=4.0, min_prob=0.01), 63)
    settings = {"alpha 2, offset 4": dict(alpha=2.0, offset=4.0, min_prob=0.03, backoff=0.0),
                "alpha 4, offset 4 (default)": dict(alpha=4.0, offset=4.0, min_prob=0.03, backoff=0.3),
                "alpha 8, offset 8": dict(alpha=8.0, offset=8.0, min_prob=0.03, backoff=0.3),
                "alpha 1, offset 2, cost-trimmed": dict(alpha=1.0, offset=2.0, min_prob=0.03, backoff=0.3,
                                                        costs=COSTS),
                "alpha 2, offset 4, cost-trimmed": dict(alpha=2.0, offset=4.0, min_prob=0.03, backoff=0.3,
                                                        costs=COSTS)}
    for name, kw in settings.items():
        drafters[f"suffix {name}"] = (
            lambda kw=kw: ProtocolAdapter(SuffixDrafter(max_nodes=a.budget, cache=SuffixCache(), **kw)), a.budget)
    # the engine's auto path: AutoBudget sizes every tree (tree sizes up to 31, as
    # Lookahead(drafts="suffix") with the drafter's max_nodes 32)
    from lookahead_jax.strategies.lookahead import SUFFIX_SETTINGS

    drafters["trie auto budget"] = (lambda: BudgetAdapter(TrieDrafter(12, "hierarchical", trie=NgramTrie(
        branch_length=12)), 63), 63)
    for name, kw in {"alpha 1, offset 2 (Lookahead's)": dict(SUFFIX_SETTINGS),
                     "alpha 2, offset 4": dict(SUFFIX_SETTINGS, alpha=2.0, offset=4.0),
                     "alpha 4, offset 4": dict(SUFFIX_SETTINGS, alpha=4.0, offset=4.0)}.items():
        drafters[f"suffix {name}, auto budget"] = (
            lambda kw=kw: BudgetAdapter(SuffixDrafter(cache=SuffixCache(), **kw), 31), 31)
    if a.only:
        drafters = {k: v for k, v in drafters.items() if any(s in k for s in a.only)}
    result = dict(model=rec["model"], max_new_tokens=rec["max_new_tokens"], stop_at_eos=rec["stop_at_eos"],
                  records=dict(command=rec.get("command"), host=rec.get("host")),
                  relative_verify_cost={str(T): c for T, c in COSTS.items()}, sets={})
    for s, recs in rec["sets"].items():
        rows = {k: dict(tokens_per_step=v) for k, v in copy_oracles(recs).items()}
        print(f"== {s} ({len(recs)} prompts, {sum(len(o) for *_, o in recs)} tokens): oracle "
              f"{rows['oracle (own)']['tokens_per_step']} / {rows['oracle (+ earlier outputs)']['tokens_per_step']}; "
              f"root-anchored {rows['root-anchored oracle (own)']['tokens_per_step']} / "
              f"{rows['root-anchored oracle (+ earlier outputs)']['tokens_per_step']}",
              flush=True)
        for name, (make, budget) in drafters.items():
            r = replay_set(recs, make, budget)
            for _ in range(a.repeat - 1):
                again = replay_set(recs, make, budget)
                assert again["tokens_per_step"] == r["tokens_per_step"]
                r["host_ms_per_step"] = min(r["host_ms_per_step"], again["host_ms_per_step"])
            rows[name] = r
            print(f"  {name:40s} {r['tokens_per_step']:.3f} tok/step, drafted {r['drafted_per_step']:.1f}/step, "
                  f"est. {r['est_speedup']:.2f}x, host {r['host_ms_per_step']:.3f} ms/step", flush=True)
        result["sets"][s] = rows
    save(result, a.out or str(__import__("pathlib").Path(__file__).resolve().parent / "results" / "suffix-replay.json"))


if __name__ == "__main__":
    main()
