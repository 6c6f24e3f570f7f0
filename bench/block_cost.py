"""What one prefill block costs in the server's cache (issue 57, "an open stream keeps
flowing"): `Engine.extend` of one row's 64-token block (emit=False, a chunk before the
prompt's last) in the cache `Slots` builds for `--max-batch` slots of `--max-len`, the row
`sel` out of them ("sel": the server's program), at windows:row lengths given by
`--windows` (128:0 / 512:300 / 2048:800, the ladder a prompt's blocks climb), beside the
same block with attention in XLA's batched dots as before issue 57's fix ("xla": the CPU
attention kernel only for blocks of up to 16 tokens) and in a cache of that one row ("row":
no `sel` copy of the window, the floor). The variants alternate, round after round; wall
and process CPU time (all threads) of each block, min and median, the load average, each
variant's pick and how far its keys are from the first variant's.

    python bench/block_cost.py --out bench/results/block-cost.json
    python bench/block_cost.py --hlo /tmp/hlo   # also each program's optimized HLO text
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = ["128:0", "512:300", "2048:800"]  # window:the row's cached length before the block


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variants", nargs="+", default=["sel", "xla", "row"])
    ap.add_argument("--windows", nargs="+", default=WINDOWS, help="WINDOW:LENGTH cases")
    ap.add_argument("--hlo", default=None, help="a folder for each program's optimized HLO text")
    ap.add_argument("--out", default=str(ROOT / "bench/results/block-cost.json"))
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.inputs import StepInputs, StepMode
    from lookahead_jax.core.verify import extend_step, jitted_extend
    from lookahead_jax.models import cpu_kernels
    from first_run import cpu_name

    enable_compilation_cache()
    model = lj.load(a.model)[0]
    eng = lj.engine_for(model)
    B, S, P, row = a.max_batch, a.max_len, a.block, 1
    cases = [tuple(int(x) for x in c.split(":")) for c in a.windows]

    def xla_extend(params, cache, x, *, mode):  # attention in XLA's batched dots, as before the fix
        keep, cpu_kernels.MIN_PREFILL_ATTN_WINDOW = cpu_kernels.MIN_PREFILL_ATTN_WINDOW, 1 << 30
        try:  # (read when the step is traced)
            return extend_step(params, cache, x, config=eng.config, mode=mode)
        finally:
            cpu_kernels.MIN_PREFILL_ATTN_WINDOW = keep

    xla_jit = jax.jit(xla_extend, donate_argnums=(1,), static_argnames=("mode",))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, eng.config.vocab_size, (1, P)).astype(np.int32)
    base = StepInputs(tokens, np.zeros(1, np.uint32), np.zeros(1, np.int32), n_new=np.full(1, P, np.int32))
    caches = {v: eng.init_cache(1 if v == "row" else B, S) for v in a.variants}

    def run(v, window, L):
        mode = StepMode(window=window, emit=False)
        lengths = np.full(1 if v == "row" else B, 37, np.int32)
        lengths[0 if v == "row" else row] = L
        c = caches[v].replace(length=eng.put(lengths))
        x = base if v == "row" else base._replace(sel=np.array([row], np.int32))
        t, p = time.perf_counter(), time.process_time()
        if v == "xla":
            out, c = xla_jit(eng.params, c, x, mode=mode)
        else:
            out, c = eng.extend(c, x, mode)
        jax.block_until_ready((out.tokens, c))
        caches[v] = c
        return time.perf_counter() - t, time.process_time() - p, int(out.tokens[0])

    if a.hlo:
        Path(a.hlo).mkdir(parents=True, exist_ok=True)
        for window, L in cases:
            mode = StepMode(window=window, emit=False)
            x = base._replace(sel=np.array([row], np.int32))
            for v, fn in (("sel", jitted_extend(eng.config)), ("xla", xla_jit)):
                comp = fn.lower(eng.params, eng.init_cache(B, S), x, mode=mode).compile()
                text = comp.as_text()
                Path(a.hlo, f"{v}-w{window}.txt").write_text(text)
                mem = comp.memory_analysis()
                print(f"{v} w{window}: HLO {len(text)} chars, copy ops {text.count(' copy(')}, "
                      f"temp {getattr(mem, 'temp_size_in_bytes', 0) / 2**20:.1f} MiB, "
                      f"alias {getattr(mem, 'alias_size_in_bytes', 0) / 2**20:.1f} MiB", flush=True)

    picks = {}
    for window, L in cases:  # compile and warm each program
        for v in a.variants:
            picks[(v, window, L)] = run(v, window, L)[2]
    times = {(v, w, n): [] for v in a.variants for w, n in cases}
    load = [os.getloadavg()[0]]
    for r in range(a.rounds):
        for window, L in cases:
            for v in (a.variants if r % 2 == 0 else a.variants[::-1]):
                wall, cpu, tok = run(v, window, L)
                assert tok == picks[(v, window, L)], (v, window, L)
                times[(v, window, L)].append((wall, cpu))
        load.append(os.getloadavg()[0])
    for window, L in cases:  # the token each variant picks after the block
        print(f"window {window}, row at {L}: picks {[picks[(v, window, L)] for v in a.variants]}")
    k0 = np.asarray(caches[a.variants[0]].k[-1])[row if a.variants[0] != "row" else 0]
    for v in a.variants[1:]:  # the row's keys of the last layer after the last block, against the first variant's
        kv = np.asarray(caches[v].k[-1])[row if v != "row" else 0]
        print(f"{v}: last layer's keys differ from {a.variants[0]}'s by {float(np.abs(k0 - kv).max()):.3g} at most")
    rows = []
    for (v, window, L), ts in times.items():
        wall, cpu = [t[0] for t in ts], [t[1] for t in ts]
        res = dict(variant=v, window=window, length=L, wall_min_s=round(min(wall), 4), wall_med_s=round(statistics.median(wall), 4),
                   cpu_min_s=round(min(cpu), 4), cpu_med_s=round(statistics.median(cpu), 4))
        rows.append(res)
        print(f"{v:4s} window {window:5d} row at {L:4d}: wall min {res['wall_min_s']:.3f} med {res['wall_med_s']:.3f} s, "
              f"cpu min {res['cpu_min_s']:.3f} med {res['cpu_med_s']:.3f} s", flush=True)
    print(f"load average during the rounds: {[round(x, 2) for x in load]}")
    out = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), model=a.model, max_batch=B, max_len=S,
               block=P, rounds=a.rounds, load_average=[round(x, 2) for x in load], results=rows,
               picks={f"{v} {w}:{n}": t for (v, w, n), t in picks.items()})
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("saved", a.out)


if __name__ == "__main__":
    main()
