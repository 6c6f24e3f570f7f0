"""A distillation run: data, training, evaluation and checkpoints in one resumable call."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np

from .. import presets
from ..core.engine import Engine
from .config import DATA_SHARE, STATE_FORMAT, DistillConfig
from .data import batch_stream, build_examples, loss_positions, loss_slots, make_batch
from .train import (dir_size, evaluate, export_model, init_draft, latest_state, make_optimizer,
                    restore_state, save_state, split_trainable, state_meta, train_step_fn)


def distill(target, tokenizer, train_prompts: dict, eval_prompts: dict, out, cfg: DistillConfig, *,
            data_dir=None, progress: bool = True, name: Optional[str] = None,
            on_step: Optional[Callable[[int, dict], None]] = None, report=print) -> dict:
    """Train (or resume) a draft of `target` into `out`. Prompts: {source: [prompt, ...]}.

    on_step(step, metrics) is called after every step (tests interrupt through it: a
    KeyboardInterrupt there saves the checkpoint and propagates). Returns a summary dict:
    step, steps_run, wall_s, data_s, history, evals, eval (the final agreement), out,
    config and params (the draft's), model_bytes, state_bytes."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    out = Path(out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(data_dir) if data_dir else presets.cache_root() / "distill-data"
    budget = cfg.minutes * 60 if cfg.minutes is not None else math.inf
    meta = state_meta(out)
    settings = dataclasses.asdict(cfg)
    if meta is not None:
        bad = [k for k in DistillConfig.RESUME_KEYS if meta["settings"].get(k) != settings[k]]
        if bad:
            saved = ", ".join(f"{k}={meta['settings'].get(k)!r}" for k in bad)
            now = ", ".join(f"{k}={settings[k]!r}" for k in bad)
            raise ValueError(f"{out} holds a run with other settings ({saved}; this run: {now}): "
                             "pass the saved ones, or another --out")

    teacher = Engine(target)  # one for both calls: compiled once; its packed weights go after
    evals = build_examples(teacher, tokenizer, eval_prompts, cfg, data_dir, "eval", progress)
    train = build_examples(teacher, tokenizer, train_prompts, cfg, data_dir, "train", progress,
                           deadline=t0 + DATA_SHARE * budget)
    del teacher
    examples = [e for v in train.values() for e in v]
    if not examples:
        raise ValueError("no training examples (all prompts too long for --seq-len?)")
    data_s = time.perf_counter() - t0
    n_loss = sum(len(loss_positions(e, cfg.prompt_weight)[0]) for e in examples)
    report(f"data: {len(examples)} train sequences ({sum(len(e['tokens']) for e in examples)} tokens, "
           f"{n_loss} loss positions), {sum(len(v) for v in evals.values())} eval sequences "
           f"({sum(len(e['tokens']) - e['n_prompt'] for v in evals.values() for e in v)} continuation "
           f"tokens) in {data_s:.0f} s")

    config, params = init_draft(target.params, target.config, cfg.layers, cfg.init)
    trainable, frozen = split_trainable(params, cfg.train_embed)
    opt, sched = make_optimizer(cfg)
    opt_state = opt.init(trainable)
    history = list(meta.get("history", [])) if meta else []
    evals_hist = list(meta.get("evals", [])) if meta else []
    start = 0
    latest = latest_state(out)
    if meta is not None and latest is not None:
        trainable, opt_state = restore_state(latest, trainable, opt_state)
        start = int(latest.name)
        history = [h for h in history if h["step"] <= start]
        evals_hist = [e for e in evals_hist if e["step"] <= start]
        report(f"resuming {out} at step {start}")
    name = name or f"{getattr(target, 'name', '') or 'target'}-draft-L{cfg.layers}"
    opt_key = tuple(sorted((k, settings[k]) for k in ("lr", "warmup", "steps", "weight_decay")))
    step_fn = train_step_fn(config, float(cfg.ce_weight), opt_key)
    P = loss_slots(cfg.seq_len, cfg.prompt_weight)

    def meta_now():
        return dict(format=STATE_FORMAT, settings=settings, config=config.to_dict(), name=name,
                    target=getattr(target, "name", ""), history=history, evals=evals_hist,
                    data=dict(train_sequences=len(examples), eval_sequences=sum(len(v) for v in evals.values())))

    def do_eval(step):
        t = time.perf_counter()
        ev = evaluate({**trainable, **frozen}, config, evals, cfg)
        evals_hist.append(dict(step=step, **{k: v for k, v in ev.items()}))
        per = " ".join(f"{s} {v['top1']:.3f}" for s, v in ev.items() if s != "all")
        report(f"step {step}: eval top-1 agreement {ev['all']['top1']:.4f} (top-5 {ev['all']['top5']:.4f};"
               f" {per}) [{time.perf_counter() - t:.1f} s]")
        return ev, time.perf_counter() - t

    def save(step):
        save_state(out, step, trainable, opt_state, meta_now())
        export_model(out, config, {**trainable, **frozen}, tokenizer, name)

    ev, eval_s = (evals_hist[-1], 0.0) if evals_hist and evals_hist[-1]["step"] == start else do_eval(start)
    step_times: list = []
    step = start
    steps_run = 0
    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc="distill", unit="step",
               disable=not progress or start >= cfg.steps, dynamic_ncols=True)
    try:
        for step_i, rows in batch_stream(examples, cfg, start):
            if step_i >= cfg.steps:
                break
            elapsed = time.perf_counter() - t0
            per_step = float(np.median(step_times[-10:])) if step_times else 0.0
            if elapsed + per_step + eval_s * 1.2 + 15 > budget:
                report(f"--minutes {cfg.minutes}: stopping at step {step_i} of {cfg.steps}")
                break
            t = time.perf_counter()
            b = make_batch(examples, rows, cfg.batch_size, cfg.seq_len, P, cfg.topk, cfg.prompt_weight)
            trainable, opt_state, m = step_fn(trainable, opt_state, frozen,
                                              {k: jnp.asarray(v) for k, v in b.items()})
            m = {k: float(v) for k, v in m.items()}
            step = step_i + 1
            steps_run += 1
            step_times.append(time.perf_counter() - t)
            history.append(dict(step=step, lr=float(sched(step_i)), **{k: round(v, 5) for k, v in m.items()}))
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", kl=f"{m['kl']:.3f}", agree=f"{m['agree']:.3f}")
            if on_step is not None:
                on_step(step, m)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                ev, eval_s = do_eval(step)
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                save(step)
    except KeyboardInterrupt:
        bar.close()
        report(f"interrupted: saving step {step} to {out}")
        save(step)
        raise
    bar.close()
    if not evals_hist or evals_hist[-1]["step"] != step:
        ev, _ = do_eval(step)
    save(step)
    ev = {k: v for k, v in evals_hist[-1].items() if k != "step"}
    wall = time.perf_counter() - t0
    return dict(step=step, steps_run=steps_run, wall_s=wall, data_s=data_s, history=history,
                evals=evals_hist, eval=ev, out=str(out), config=config, params={**trainable, **frozen},
                model_bytes=dir_size(out / "params"), state_bytes=dir_size(out / "train_state"))


def default_out(target: str, layers: int) -> Path:
    return presets.cache_root() / "drafts" / f"{Path(target).name}-L{layers}"
