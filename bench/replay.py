"""Replay lookahead's budget choice on recorded acceptances: policies and their ceiling.

Lossless decoding makes the draft budget a pure scheduling question: the tokens are
greedy's whatever T is. So this records, once per prompt, greedy's tokens (up to
`--max-new-tokens`, stopping at EOS as generation does by default; `--ignore-eos` records a
fixed length past EOS instead, a separate result in `replay-fixedlen.json` that overstates
real use: past EOS the model repeats itself and the trie drafts it well) and, at every
position, the trie's full draft (as lookahead would propose it: same global trie,
references and streaming) and how many drafts every tree bucket T would accept there.
Then it replays budget policies on those records with verify costs t(T) measured on the
real model, without the machine's run-to-run noise:

* fixed T for every bucket;
* auto: the library's own `AutoBudget` + `AcceptanceStats` (per draft class, kept across
  the dataset's prompts, scored as soon as the outcome is decided), exactly as `generate`
  drives them;
* oracle: the best T at every step with hindsight (dynamic programming over positions):
  the ceiling of *any* budget policy with this drafter on this machine;
* class hindsight: the best fixed T per draft class (`Draft.key`, and with the previous
  position's hits too), chosen with hindsight over the whole dataset: the ceiling of a
  policy that decides from those features, however well it estimates them (the oracle
  also knows which individual drafts will fail, which no feature here predicts);
* n-gram bound: tokens per step of *any* n-gram drafter over the same sources (the
  prompt with its references, this output so far, earlier prompts' outputs) with an
  unbounded tree: at each step the longest continuation of the root token, up to the
  branch length, that occurs anywhere in them, chosen with hindsight. A ceiling on the
  trie's tokens per step that no budget, scoring or mode can pass.

Speedups are over decode steps (prefill excluded, the same for every strategy). The JSON
records `stop_at_eos`, the command and the host (CPU model, cores, jax version).

    python bench/replay.py --n 20     # prints and saves bench/results/replay.json
    python bench/replay.py --n 20 --records /tmp/rec.pkl --costs 1 1.01 1.15 1.49 1.88 3.17 5.25
                                      # record once, replay again without re-running greedy
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np

from common import dataset_prompts, default_out, eos_mode, host_line, save


def record(model, tok, drafter_cls, trie, prompt_ids, refs, max_new, branch_length, mode, max_nodes,
           ignore_eos=False):
    """Greedy tokens (up to EOS unless `ignore_eos`) and, per decode position, (draft,
    accepted drafts per bucket)."""
    import lookahead_jax as lj
    from lookahead_jax.core.budget import accepted_lengths
    from lookahead_jax.core.tree import BUCKETS

    out = lj.generate(model, tok, [prompt_ids], max_new_tokens=max_new, ignore_eos=ignore_eos).rows[0].token_ids
    # the drafter through its protocol (drafters/base.py), on a one-row stand-in for the
    # decode state that holds greedy's tokens as they are emitted
    row = SimpleNamespace(prompt_ids=list(prompt_ids), ids=[])
    state = SimpleNamespace(batch=1, rows=[row], active=[True], context=lambda b: row.prompt_ids + row.ids)
    d = drafter_cls(branch_length, mode, max_nodes=max_nodes, trie=trie)
    d.begin(state, [refs])

    def emit(tok_id):
        row.ids.append(tok_id)
        d.update(state, SimpleNamespace(kept=[[tok_id]]))

    emit(out[0])
    steps = []
    for i in range(1, len(out)):  # the root is out[i - 1]; out[i:] is the truth
        draft = d.propose(state, max_nodes).drafts[0]
        steps.append((draft, accepted_lengths(draft.tokens, draft.parents, out[i:], BUCKETS)))
        emit(out[i])
    d.end()
    return out, steps


def replay(steps, out, choose, cost, observe=None, branch_length=12):
    """Walk the positions choosing T per step; returns (time, forward steps)."""
    from lookahead_jax.core.budget import outcome_known
    from lookahead_jax.core.tree import BUCKETS

    n = len(steps)
    i, t, nsteps, pending = 0, 0.0, 0, []
    while i < n:
        if observe is not None:  # score drafts whose outcome is decided by now
            keep = []
            for p, d in pending:
                known = out[1 + p:1 + i]
                if outcome_known(d.tokens, d.parents, known, branch_length):
                    observe(d, known)
                else:
                    keep.append((p, d))
            pending = keep
        draft, acc = steps[i]
        T = choose(draft) if draft.tokens else 0
        T = next(b for b in BUCKETS if b >= min(T, len(draft.tokens)))  # the bucket generate runs
        a = min(acc[BUCKETS.index(T)], n - i - 1)
        t += cost[T]
        nsteps += 1
        if observe is not None and draft.tokens:
            pending.append((i, draft))
        i += a + 1
    return t, nsteps


def ngram_bound(prompts, outs, cap):
    """Tokens per step of the hindsight n-gram drafter (module docstring): prompts[i] =
    [prompt ids, reference ids...] and outs[i] in the order they ran; outputs of earlier
    prompts count."""
    total_tokens = total_steps = 0
    for i, (sources, out) in enumerate(zip(prompts, outs)):
        past = sources[1:] + outs[:i]
        j = 0  # root out[j] (emitted), truth out[j + 1:]
        while j < len(out) - 1:
            here = sources[0] + out[:j + 1]
            best = 0
            for seq in [here] + past:
                for p in range(len(seq) - 1):
                    if seq[p] != out[j]:
                        continue
                    k = 0
                    while k < cap and p + 1 + k < len(seq) and j + 1 + k < len(out) and seq[p + 1 + k] == out[j + 1 + k]:
                        k += 1
                    best = max(best, k)
            a = min(best, len(out) - 2 - j)  # the last token comes from the final step
            total_tokens += a + 1
            total_steps += 1
            j += a + 1
    return total_tokens / total_steps


def oracle(steps, cost):
    from lookahead_jax.core.tree import BUCKETS

    n = len(steps)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        draft, acc = steps[i]
        best[i] = min(cost[T] + best[min(n, i + acc[k] + 1)] for k, T in enumerate(BUCKETS)
                      if T in cost and (T == 0 or draft.tokens))
    return best[0]


def class_oracle(recs, cost, feature):
    """Speedup of the best T per draft class, chosen with hindsight over all the records:
    the ceiling of any policy that decides from the class `feature(steps, i)` alone
    (as `auto` does from `Draft.key`), however well it estimated each class."""
    from lookahead_jax.core.tree import BUCKETS

    sums, counts = {}, {}
    for _, steps in recs:
        for i, (_, acc) in enumerate(steps):
            c = feature(steps, i)
            s = sums.setdefault(c, [0] * len(BUCKETS))
            for k, a in enumerate(acc):
                s[k] += a
            counts[c] = counts.get(c, 0) + 1
    best = {c: max((T for T in cost), key=lambda T: (counts[c] + s[BUCKETS.index(T)]) / cost[T])
            for c, s in sums.items()}
    t = steps_n = 0.0
    for out, steps in recs:
        at = {id(d): i for i, (d, _) in enumerate(steps)}
        dt, _ = replay(steps, out, lambda d: best[feature(steps, at[id(d)])], cost)
        t += dt
        steps_n += len(steps)
    return steps_n * cost[0] / t


def previous_hit(steps, i):
    """How many tokens the draft at the previous position got right (capped at 3): a
    model copying a passage keeps copying."""
    return -1 if i == 0 else min(steps[i - 1][1][-1], 3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datasets", nargs="+", default=["nq", "humaneval", "gsm8k"])
    ap.add_argument("--n", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="at most (stops at EOS unless --ignore-eos)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="record a fixed length past EOS (a separate result, default output replay-fixedlen.json)")
    ap.add_argument("--branch-length", type=int, default=12)
    ap.add_argument("--mode", default="hierarchical")
    ap.add_argument("--costs", type=float, nargs="+",
                    help="verify cost of T = 0, 1, 3, 7, 15, 31, 63 (any unit); default: measured")
    ap.add_argument("--records", help="pickle of the recorded greedy runs: loaded if it exists (same "
                    "model, datasets, n, tokens and drafter), else written, so policies can be replayed "
                    "again without re-running greedy")
    ap.add_argument("--out", help="default bench/results/replay.json (replay-fixedlen.json with --ignore-eos)")
    a = ap.parse_args(argv)
    a.out = a.out or default_out("replay", a.ignore_eos)

    import lookahead_jax as lj
    from lookahead_jax.core.budget import AcceptanceStats, AutoBudget
    from lookahead_jax.drafters.trie import TrieDrafter
    from lookahead_jax.core.acceptance import TokenMatch
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.prompts import encode_prompts
    from lookahead_jax.core.sampling import SamplingParams
    from lookahead_jax.drafters.ngram_trie import NgramTrie

    print(host_line(), f"| {eos_mode(a.ignore_eos)}", flush=True)
    model, tok = lj.load(a.model)
    buckets = (0, 1, 3, 7, 15, 31, 63)
    if a.costs:
        if len(a.costs) != len(buckets):
            ap.error(f"--costs needs {len(buckets)} values, for T = {buckets}")
        cost = dict(zip(buckets, a.costs))
    else:  # a typical step of these runs: S = 512, length 256
        cost = engine_for(model).measure_verify_costs(TokenMatch(SamplingParams(0.0, 0, 1.0)), 1, 512, buckets,
                                                      256, rounds=10)
    cost = {T: c / cost[0] for T, c in cost.items()}
    print("relative verify cost t(T)/t(0):", {T: round(c, 3) for T, c in cost.items()})

    result = dict(model=a.model, prompts_per_dataset=a.n, max_new_tokens=a.max_new_tokens, stop_at_eos=not a.ignore_eos,
                  branch_length=a.branch_length, mode=a.mode,
                  relative_verify_cost={str(T): round(c, 4) for T, c in cost.items()}, datasets={})
    import pickle
    from pathlib import Path

    key = (a.model, a.n, a.max_new_tokens, a.branch_length, a.mode, "fixed length" if a.ignore_eos else "stop at EOS")
    saved = {}
    if a.records and Path(a.records).exists():
        saved = pickle.loads(Path(a.records).read_bytes())
        if saved.get("key") != key:
            ap.error(f"{a.records} holds records of {saved.get('key')}, not {key}")
    for ds in a.datasets:
        if ds in saved.get("datasets", {}):
            recs = saved["datasets"][ds]
            print(f"[{ds}] {len(recs)} records from {a.records}")
        else:
            prompts, refs = dataset_prompts(ds, a.n)
            ids = encode_prompts(tok, prompts, chat=False)
            trie = NgramTrie(branch_length=a.branch_length)  # warm across the dataset, as in bench/lookahead.py
            recs = []
            for i, x in enumerate(ids):
                ref_ids = [tok.encode(t, add_special_tokens=False) for t in refs[i]]
                recs.append(record(model, tok, TrieDrafter, trie, x, ref_ids, a.max_new_tokens,
                                   a.branch_length, a.mode, 64, ignore_eos=a.ignore_eos))
                print(f"[{ds}] recorded {i + 1}/{len(ids)}", flush=True)
            if a.records:
                saved = dict(saved, key=key, datasets={**saved.get("datasets", {}), ds: recs})
                Path(a.records).write_bytes(pickle.dumps(saved))

        def evaluate(per_prompt):
            """(speedup over greedy, tokens per step, per-prompt speedups); per_prompt() gives
            each prompt's (choose, cost[, observe])"""
            per, total_t, total_g, total_steps = [], 0.0, 0.0, 0
            for out, steps in recs:
                if not steps:  # ended at its first token (EOS): no decode step to schedule
                    continue
                t, n = replay(steps, out, *per_prompt(), branch_length=a.branch_length)
                g = len(steps) * cost[0]
                per.append(g / t)
                total_t, total_g, total_steps = total_t + t, total_g + g, total_steps + n
            return total_g / total_t, sum(len(s) for _, s in recs) / total_steps, per

        policies = {}
        for T in buckets:
            policies[f"fixed {T}"] = evaluate(lambda T=T: (lambda d: T, cost))
        shared = AcceptanceStats()  # across the dataset's prompts, like TrieDrafter.shared

        def auto():  # one AutoBudget per request, as generate() makes
            b = AutoBudget(buckets, cost, shared)
            return (lambda d: b.choose([d.key], rows=1), cost,
                    lambda d, known: b.observe(d.tokens, d.parents, known, d.key))
        policies["auto"] = evaluate(auto)
        prompts, refs = dataset_prompts(ds, a.n)
        sources = [[x] + [tok.encode(r, add_special_tokens=False) for r in rs]
                   for x, rs in zip(encode_prompts(tok, prompts, chat=False), refs)]
        bound = {str(c): round(ngram_bound(sources, [out for out, _ in recs], c), 3)
                 for c in (a.branch_length, 10 ** 6)}
        result.setdefault("ngram_bound_tokens_per_step", {})[ds] = bound
        result.setdefault("new_tokens_per_prompt", {})[ds] = [len(out) for out, _ in recs]
        o = [len(s) * cost[0] / oracle(s, cost) for _, s in recs if s]
        og = sum(len(s) for _, s in recs) * cost[0] / sum(oracle(s, cost) for _, s in recs)
        policies["oracle"] = (og, None, o)
        for name, feature in (("class hindsight (Draft.key)", lambda st, i: st[i][0].key),
                              ("class hindsight (Draft.key, previous hit)",
                               lambda st, i: (st[i][0].key, previous_hit(st, i)))):
            policies[name] = (class_oracle(recs, cost, feature), None, None)
        rows = {}
        for name, (sp, acc, per) in policies.items():
            rows[name] = dict(speedup=round(sp, 3))
            if per is not None:
                per = np.array(per)
                rows[name].update(prompts_below_0_95=int((per < 0.95).sum()), worst_prompt=round(float(per.min()), 3))
            if acc is not None:
                rows[name]["tokens_per_step"] = round(acc, 3)
        result["datasets"][ds] = rows
        print(f"== {ds}: n-gram bound {bound[str(a.branch_length)]} tokens/step (branch {a.branch_length}), "
              f"{bound[str(10 ** 6)]} (unbounded branch)")
        print(f"== {ds}: " + "; ".join(f"{n} {r['speedup']:.2f}x" + (f" ({r['tokens_per_step']:.2f}/step)" if "tokens_per_step" in r else "")
                                      + (f" [{r['prompts_below_0_95']} < 0.95x]" if "prompts_below_0_95" in r else "")
                                      for n, r in rows.items()), flush=True)
    save(result, a.out)


if __name__ == "__main__":
    main()
