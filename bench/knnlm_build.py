"""The KNN-LM datastore build's speed against its bound, the model's forward over unpadded
blocks (the prefill's compute rate).

A sample of `--passages` passages spread over the corpus is built into a temporary
datastore (`build_datastore`, force, no progress bar) once to compile, then `--repeats`
times, timed; with `--compare-buckets` each repeat also builds with the decode loop's
prompt buckets as the padded lengths (the build plan before `_padded_len`), the two
alternated (ABBA). Between repeats, the forward's rate on blocks of real tokens only
(rows x P = 32 x 128 and 16 x 256, the passages' typical lengths) is timed: a build at
that rate would be at the compute bound; what it loses is the padding of its blocks.

    python bench/knnlm_build.py --passages 500 --compare-buckets   # wiki_passages.jsonl of $LOOKAHEAD_JAX_DATA
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from common import DATA, ROOT, host_line, save


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--corpus", default=str(DATA / "wiki_passages.jsonl"), help="a JSONL corpus (one passage per line)")
    ap.add_argument("--passages", type=int, default=500, help="passages in the sample, spread evenly over the corpus")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compare-buckets", action="store_true",
                    help="also build with the prompt buckets as padded lengths (the previous plan), alternated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "knnlm-build.json"))
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    import lookahead_jax as lj
    from lookahead_jax.core.buckets import prompt_bucket
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.knnlm import build as DS

    print(host_line(), flush=True)
    lines = Path(a.corpus).read_text().splitlines()
    lines = lines[::max(1, len(lines) // a.passages)][:a.passages]
    tmp = Path(tempfile.mkdtemp())
    corpus = tmp / "sample.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    model, tok = lj.load(a.model)
    engine = engine_for(model)
    fine = DS._padded_len
    ladders = {"fine": fine}
    if a.compare_buckets:
        ladders["prompt buckets"] = lambda n: prompt_bucket(n, 1 << 30)  # no cache bound: the bucket itself

    def build(name):
        DS._padded_len = ladders[name]
        try:
            t0 = time.perf_counter()
            DS.build_datastore(model, tok, corpus, path=tmp / name.replace(" ", "-"), force=True, progress=False)
            return time.perf_counter() - t0
        finally:
            DS._padded_len = fine

    toks = DS.passage_tokens(tok, DS.load_corpus(corpus))
    kept = [t for t in toks if len(t) > 1]
    entries, real = sum(len(t) - 1 for t in kept), sum(len(t) for t in kept)
    padded = {}
    for name, f in ladders.items():  # tokens the build's forwards hold, padding included
        DS._padded_len = f
        padded[name] = sum(P * (1 << (len(rows) - 1).bit_length()) for P, rows in DS._plan(toks, np.array(
            [max(len(t) - 1, 0) for t in toks])) if P)
        DS._padded_len = fine
    fn = DS._hidden_fn(model.config, jnp.dtype(engine.dtype).name)
    flat = np.array([t for tt in toks for t in tt], np.int32)
    blocks = {}
    for R, P in ((32, 128), (16, 256)):
        blocks[f"{R}x{P}"] = np.resize(flat, R * P).reshape(R, P)
        np.asarray(fn(engine.params, blocks[f"{R}x{P}"]))  # compile
    for name in ladders:  # compile every shape once
        build(name)
    runs = {name: [] for name in ladders}
    runs.update({f"unpadded {k}": [] for k in blocks})
    order = list(ladders)
    for rep in range(a.repeats):
        for name in (order if rep % 2 == 0 else order[::-1]):
            s = build(name)
            runs[name].append(entries / s)
            print(f"[{rep}] build ({name} lengths): {s:.1f} s, {entries / s:.0f} entries/s", flush=True)
        for k, blk in blocks.items():
            t0 = time.perf_counter()
            np.asarray(fn(engine.params, blk))
            s = time.perf_counter() - t0
            runs[f"unpadded {k}"].append(blk.size / s)
            print(f"[{rep}] forward of an unpadded {k} block: {blk.size / s:.0f} tokens/s", flush=True)
    bound = float(np.mean([np.mean(v) for k, v in runs.items() if k.startswith("unpadded")]))
    result = dict(model=a.model, corpus=str(a.corpus), passages=len(toks), entries=entries, real_tokens=real,
                  real_token_share={k: round(real / v, 3) for k, v in padded.items()},
                  entries_per_s={k: [round(x, 1) for x in v] for k, v in runs.items() if not k.startswith("unpadded")},
                  unpadded_forward_tokens_per_s={k[9:]: [round(x, 1) for x in v] for k, v in runs.items()
                                                 if k.startswith("unpadded")},
                  bound_tokens_per_s=round(bound, 1),
                  build_share_of_bound={k: round(float(np.mean(v)) / bound, 3) for k, v in runs.items()
                                        if not k.startswith("unpadded")})
    print(json.dumps({k: result[k] for k in ("real_token_share", "bound_tokens_per_s", "build_share_of_bound")}))
    save(result, a.out)


if __name__ == "__main__":
    main()
