"""What one prefill block costs, by its size, attention window and cache (issue 57's profile):
`Engine.extend` of one row's block of P tokens (emit=False, as a chunk before the prompt's
last), medians of `--reps` after one warm run, beside a bare forward of P tokens with plain
and with packed weights.

    python bench/prefill_blocks.py --out bench/results/prefill-blocks.json

Cases (B: rows of the cache; sel: the block is for row 1 of B, as `Slots` forwards a chunk;
window: attention slots; L: the row's cached length before the block):
64 tokens at windows 128 / 512 / 2048 (L 0 / 300 / 800), one row and in an 8-row cache;
16 tokens (the CPU attention kernel applies) at the whole cache and at 1,024.
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
CASES = [(1, None, 128, 0, 64), (1, None, 512, 300, 64), (8, [1], 512, 300, 64), (1, None, 2048, 800, 64),
         (8, [1], 2048, 800, 64), (8, [1], 2048, 800, 16), (1, None, 2048, 800, 16), (8, [1], 1024, 800, 16)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefill-blocks.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.inputs import StepInputs, StepMode
    from lookahead_jax.models import forward, init_cache
    from lookahead_jax.models.transformer import unpack_params
    from first_run import cpu_name

    enable_compilation_cache()
    model = lj.load(a.model)[0]
    eng = lj.engine_for(model)
    cfg, S = model.config, a.max_len

    def med(f):
        f()
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return round(statistics.median(ts) * 1e3, 1)

    def bare(P, packed):
        params = eng.params if packed else unpack_params(eng.params)
        f = jax.jit(lambda p, t, pos, c, m: forward(p, t, pos, c, m, cfg)[0][:, -1])
        toks, pos = jnp.ones((1, P), jnp.int32), jnp.arange(P)[None]
        mask, cache = jnp.tril(jnp.ones((1, P, P), bool)), init_cache(cfg, 1, P)
        return med(lambda: jax.block_until_ready(f(params, toks, pos, cache, mask)))

    def block(B, sel, window, L, P):
        st = {"c": eng.init_cache(B, S)}
        x = StepInputs(np.ones((1, P), np.int32), np.zeros(1, np.uint32), np.zeros(1, np.int32),
                       n_new=np.full(1, P, np.int32), sel=None if sel is None else np.array(sel, np.int32))

        def run():
            c = st["c"].replace(length=eng.put(np.full(B, L, np.int32)))
            out, st["c"] = eng.extend(c, x, StepMode(window=window, emit=False))
            jax.block_until_ready(out.tokens)
        return med(run)

    rows = []
    for P in (64, 16):
        for packed in (False, True):
            ms = bare(P, packed)
            rows.append(dict(case="forward", tokens=P, packed=packed, ms=ms))
            print(f"forward {P} tokens, {'packed' if packed else 'plain'} weights: {ms} ms", flush=True)
    for B, sel, window, L, P in CASES:
        ms = block(B, sel, window, L, P)
        rows.append(dict(case="extend", rows=B, sel=sel, window=window, length=L, tokens=P, ms=ms))
        print(f"extend {P} tokens, cache of {B} rows{' (sel)' if sel else ''}, window {window}, row at {L}: "
              f"{ms} ms", flush=True)
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model, max_len=S, reps=a.reps,
               results=rows)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
