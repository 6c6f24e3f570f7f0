"""Record greedy outputs (f32, stop at EOS) for the suffix-drafter replay (bench/suffix_replay.py).

Two prompt sets, NQ RAG as bench/lookahead.py builds it (the passage in the prompt and as
the request's reference):
* nq: the first `--n` prompts (first exposure: every passage is new);
* nq-shared: a repeated-traffic stream, `--per-passage` questions for each of
  n / per-passage passages, in that order (questions on one passage one after another).
Writes a pickle {set: [(prompt_ids, [ref_ids...], out_ids)]} in the order they ran.

    python bench/suffix_record.py --n 15 --out /tmp/suffix-records.pkl
"""

from __future__ import annotations

import argparse
import pickle
import sys
from common import dataset_prompts, host_line, shared_prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--per-passage", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sets", nargs="+", default=["nq", "nq-shared"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import lookahead_jax as lj
    from lookahead_jax.prompts import encode_prompts

    model, tok = lj.load(a.model)
    result = dict(model=a.model, max_new_tokens=a.max_new_tokens, stop_at_eos=True, sets={},
                  command=" ".join(["python"] + sys.argv), host=host_line())
    for s in a.sets:
        prompts, refs = dataset_prompts("nq", a.n) if s == "nq" else shared_prompts(a.n, a.per_passage)
        ids = encode_prompts(tok, prompts, chat=False)
        recs = []
        for i, x in enumerate(ids):
            out = lj.generate(model, tok, [x], max_new_tokens=a.max_new_tokens).rows[0].token_ids
            recs.append((list(x), [tok.encode(t, add_special_tokens=False) for t in refs[i]], list(out)))
            print(f"[{s}] {i + 1}/{len(ids)}: {len(out)} tokens", flush=True)
        result["sets"][s] = recs
        with open(a.out, "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main()
