"""The draft and its training: initialization from the target, the loss, the optimizer and
the jitted step, the held-out evaluation, and the saved state (orbax) and export."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models import ModelConfig, hidden_states, init_cache, logits_from_hidden
from .config import DistillConfig
from .data import loss_slots, make_batch, pack_rows


def draft_config(target: ModelConfig, layers: int, init: str = "first") -> ModelConfig:
    """The target's config with `layers` layers (Gemma-3: each copied layer keeps its
    attention kind)."""
    if not 1 <= layers <= target.n_layers:
        raise ValueError(f"--layers must be in 1..{target.n_layers} (the target's layers), got {layers}")
    kw: dict = dict(n_layers=layers)
    if target.layer_types:
        kw["layer_types"] = tuple(target.layer_types[i] for i in init_layers(target.n_layers, layers, init))
    return target.replace(**kw)


def init_layers(n_target: int, layers: int, init: str) -> list:
    """Which target layers seed the draft's: "first" 0..L-1, "spaced" evenly spaced with
    the first and the last included."""
    if init == "first":
        return list(range(layers))
    if init == "spaced":
        return [int(round(x)) for x in np.linspace(0, n_target - 1, layers)] if layers > 1 else [0]
    raise ValueError(f"unknown --init {init!r}; use first or spaced")


def init_draft(target_params, target_cfg: ModelConfig, layers: int, init: str):
    """(draft config, params): the target's embedding / head / final norm, and copies of
    the chosen target layers."""
    which = init_layers(target_cfg.n_layers, layers, init)
    cfg = draft_config(target_cfg, layers, init)
    params = {k: v for k, v in target_params.items() if k != "layers"}
    params["layers"] = [dict(target_params["layers"][i]) for i in which]
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    return cfg, params


FROZEN = ("embed", "lm_head")


def split_trainable(params, train_embed: bool):
    """(trainable, frozen) dicts; their union is params."""
    frozen = {} if train_embed else {k: params[k] for k in FROZEN if k in params}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


def _draft_logits(params, batch, config: ModelConfig):
    """Packed rows -> draft logits [R,P,V] at the loss positions."""
    tokens, seg = batch["tokens"], batch["segment"]
    R, T = tokens.shape
    t = jnp.arange(T)
    mask = (seg[:, :, None] == seg[:, None, :]) & (t[None, None, :] <= t[None, :, None])
    mask = mask | jnp.eye(T, dtype=bool)[None]  # padding sees itself: no empty rows
    h, _ = hidden_states(params, tokens, batch["positions"], init_cache(config, R, T, h_dtype(params)),
                         mask, config)
    h = jnp.take_along_axis(h, batch["idx"][:, :, None], axis=1)  # [R,P,D]
    return logits_from_hidden(params, h, config)


def h_dtype(params):
    return params["embed"].dtype


def distill_loss(params, batch, config: ModelConfig, ce_weight: float):
    """(loss, metrics): weighted mean over loss positions of KL(target || draft) on the
    top-k + tail buckets, plus ce_weight x CE on the target's greedy token."""
    logits = _draft_logits(params, batch, config)
    lq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [R,P,V]
    tv, ti = batch["tv"], batch["ti"]  # [R,P,k]
    lq_k = jnp.take_along_axis(lq, ti, axis=-1)
    p_k = jnp.exp(tv)
    p_tail = jnp.clip(1.0 - p_k.sum(-1), 0.0, 1.0)
    R, P, _ = tv.shape
    masked = lq.at[jnp.arange(R)[:, None, None], jnp.arange(P)[None, :, None], ti].set(-jnp.inf)
    lq_tail = jax.nn.logsumexp(masked, axis=-1)
    kl = (p_k * (tv - lq_k)).sum(-1) + jax.scipy.special.xlogy(p_tail, p_tail) - p_tail * lq_tail
    greedy = ti[..., 0]
    ce = -jnp.take_along_axis(lq, greedy[..., None], axis=-1)[..., 0]
    w = batch["weight"]
    wsum = jnp.maximum(w.sum(), 1e-6)
    kl_m, ce_m = (w * kl).sum() / wsum, (w * ce).sum() / wsum
    agree = ((jnp.argmax(logits, -1) == greedy) * w).sum() / wsum
    return kl_m + ce_weight * ce_m, dict(kl=kl_m, ce=ce_m, agree=agree)


def make_optimizer(cfg: DistillConfig):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, min(cfg.warmup, cfg.steps - 1)),
                                               max(cfg.steps, 2), end_value=cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay)), sched


@functools.lru_cache(maxsize=8)
def train_step_fn(config: ModelConfig, ce_weight: float, opt_key: tuple):
    """The jitted step for (config, loss, optimizer settings); cached per process."""
    import optax

    opt = make_optimizer(DistillConfig(**dict(opt_key)))[0]

    def step(trainable, opt_state, frozen, batch):
        def f(tr):
            return distill_loss({**tr, **frozen}, batch, config, ce_weight)

        (loss, m), g = jax.value_and_grad(f, has_aux=True)(trainable)
        upd, opt_state = opt.update(g, opt_state, trainable)
        return optax.apply_updates(trainable, upd), opt_state, dict(m, loss=loss,
                                                                    gnorm=optax.tree.norm(g))

    return jax.jit(step, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("config",))
def _eval_counts(params, batch, config):
    """(top-1 hits, top-5 hits, positions) of the draft against the greedy labels."""
    logits = _draft_logits(params, batch, config)
    w = batch["weight"] > 0
    top1 = (jnp.argmax(logits, -1) == batch["label"]) & w
    _, top5 = jax.lax.top_k(logits, 5)
    in5 = (top5 == batch["label"][..., None]).any(-1) & w
    return top1.sum(), in5.sum(), w.sum()


def evaluate(params, config: ModelConfig, examples: dict, cfg: DistillConfig) -> dict:
    """Top-1 / top-5 agreement of the draft with the target's greedy continuation tokens
    (teacher-forced on the target's own output), overall and per source."""
    out: dict = {}
    hits = [0, 0, 0]
    P = loss_slots(cfg.seq_len, 0.0)
    for s, exs in examples.items():
        if not exs:
            continue
        rows = pack_rows(exs, range(len(exs)), cfg.seq_len, P, 0.0)
        h = [0, 0, 0]
        for i in range(0, len(rows), cfg.batch_size):
            b = make_batch(exs, rows[i:i + cfg.batch_size], cfg.batch_size, cfg.seq_len, P, 1, 0.0,
                           teacher=False)
            c = _eval_counts(params, {k: jnp.asarray(v) for k, v in b.items()}, config)
            h = [x + int(y) for x, y in zip(h, c)]
        out[s] = dict(top1=h[0] / max(h[2], 1), top5=h[1] / max(h[2], 1), positions=h[2])
        hits = [x + y for x, y in zip(hits, h)]
    out["all"] = dict(top1=hits[0] / max(hits[2], 1), top5=hits[1] / max(hits[2], 1), positions=hits[2])
    return out


# ----------------------------------------------------------------------------- saving
def state_meta(out: Path) -> Optional[dict]:
    f = out / "distill.json"
    return json.loads(f.read_text()) if f.is_file() else None


def latest_state(out: Path) -> Optional[Path]:
    d = out / "train_state"
    steps = sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []
    return d / f"{steps[-1]:08d}" if steps else None


def export_model(out: Path, config: ModelConfig, params, tokenizer, name: str) -> None:
    """Write the draft where `lookahead_jax.load(out)` finds it (`save_pretrained`),
    replacing a previous export (built beside it, then moved in)."""
    from ..loading import Model, save_pretrained

    tmp = out / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(Model(config, jax.device_get(params), name), tokenizer, tmp)
    for item in ("params", "tokenizer"):
        shutil.rmtree(out / item, ignore_errors=True)
        os.replace(tmp / item, out / item)
    os.replace(tmp / "LOOKAHEAD_JAX", out / "LOOKAHEAD_JAX")
    shutil.rmtree(tmp, ignore_errors=True)


def save_state(out: Path, step: int, trainable, opt_state, meta: dict) -> None:
    """train_state/<step>/ (orbax, atomic), then distill.json, then older steps removed."""
    import orbax.checkpoint as ocp

    d = out / "train_state"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{step:08d}"
    if not path.exists():
        with ocp.StandardCheckpointer() as ck:
            ck.save(path.absolute(), dict(trainable=trainable, opt_state=opt_state))
            ck.wait_until_finished()
    tmp = out / f"distill.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(dict(meta, step=step), indent=1) + "\n")
    os.replace(tmp, out / "distill.json")
    for p in d.iterdir():
        if p != path and p.is_dir() and p.name.isdigit():
            shutil.rmtree(p, ignore_errors=True)


def restore_state(path: Path, trainable, opt_state):
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          dict(trainable=trainable, opt_state=opt_state))
    with ocp.StandardCheckpointer() as ck:
        got = ck.restore(path.absolute(), target)
    return got["trainable"], got["opt_state"]


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
