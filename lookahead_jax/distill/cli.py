"""`python -m lookahead_jax.distill`: the command line of a distillation run."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from .. import presets
from .config import DistillConfig
from .data import SOURCES, default_data_dir, split_prompts
from .run import default_out, distill


def parse_args(argv=None):
    d = DistillConfig()
    p = argparse.ArgumentParser(prog="python -m lookahead_jax.distill",
                                description="Distil a small draft model (for SpecInfer) from a target model.")
    p.add_argument("--target", default=presets.DEFAULT_MODEL, help="preset, local path, .gguf or HF id")
    p.add_argument("--out", default=None, help="output directory (default: <cache root>/drafts/<target>-L<layers>)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--init", choices=("first", "spaced"), default=d.init,
                   help="target layers the draft's start from: first L, or evenly spaced")
    p.add_argument("--train-embed", action="store_true", help="train the embedding / output layer too")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="packed rows per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--ce-weight", type=float, default=d.ce_weight)
    p.add_argument("--prompt-weight", type=float, default=d.prompt_weight)
    p.add_argument("--topk", type=int, default=d.topk)
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens)
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of this run (0: none)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--train-prompts", type=int, default=32, help="training prompts per source")
    p.add_argument("--eval-prompts", type=int, default=6, help="held-out prompts per source")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--data", default=None, help="folder of the JSONL datasets (default ../shared/data)")
    p.add_argument("--data-dir", default=None, help="teacher data cache (default <cache root>/distill-data)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from ..core.compile import enable_compilation_cache

        enable_compilation_cache()
    except Exception:  # the cache only saves compile time
        pass
    from ..loading import load

    cfg = DistillConfig(layers=a.layers, init=a.init, train_embed=a.train_embed, steps=a.steps,
                        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                        ce_weight=a.ce_weight, prompt_weight=a.prompt_weight, topk=a.topk,
                        gen_tokens=a.gen_tokens, seed=a.seed, minutes=a.minutes or None,
                        eval_every=a.eval_every, save_every=a.save_every)
    out = Path(a.out).expanduser() if a.out else default_out(a.target, a.layers)
    sources = [s.strip() for s in a.sources.split(",") if s.strip()]
    t = time.perf_counter()
    target, tok = load(a.target, dtype="float32", keep_unpacked=True)  # init_draft copies its layers
    from ..prompts import encode_prompts

    limit = cfg.seq_len - cfg.gen_tokens  # prompts that leave room for the continuation
    train_p, eval_p = split_prompts(a.data or default_data_dir(), a.train_prompts, a.eval_prompts,
                                    a.seed, sources,
                                    fits=lambda p: len(encode_prompts(tok, [p], chat=False)[0]) <= limit)
    print(f"target {a.target}: {target.config.n_layers} layers, loaded in {time.perf_counter() - t:.1f} s; "
          f"draft: {cfg.layers} layers ({cfg.init}), out {out}", flush=True)
    try:
        res = distill(target, tok, train_p, eval_p, out, cfg, data_dir=a.data_dir,
                      progress=not a.no_progress, report=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print(f"interrupted; rerun the same command to resume from {out}", file=sys.stderr)
        return 130
    h = res["history"]
    if h:
        k = max(1, min(10, len(h) // 5))
        first, last = np.mean([x["loss"] for x in h[:k]]), np.mean([x["loss"] for x in h[-k:]])
        print(f"loss {first:.3f} (first {k} steps) -> {last:.3f} (last {k})")
    ev = res["eval"]["all"]
    print(f"done: step {res['step']} ({res['steps_run']} this run) in {res['wall_s'] / 60:.1f} min "
          f"(data {res['data_s'] / 60:.1f} min); held-out top-1 agreement {ev['top1']:.4f}, top-5 "
          f"{ev['top5']:.4f} over {ev['positions']} positions; model {res['model_bytes'] / 2**20:.0f} MiB "
          f"in {out} (load with lookahead_jax.load({str(out)!r}))")
    return 0

