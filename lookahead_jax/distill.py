"""Distil a small draft model from a target: `python -m lookahead_jax.distill`.

    python -m lookahead_jax.distill                        # SmolLM2-135M -> 2-layer draft
    python -m lookahead_jax.distill --layers 4 --minutes 60 --out ~/drafts/smol-l4
    model, tok = lookahead_jax.load(out_dir)               # the draft, the target's tokenizer

A draft only has to propose the tokens the target would pick (the target verifies them),
so it is trained for top-1 agreement with the target, on the target's own outputs:

* Architecture: the target's `ModelConfig` with `--layers` layers (default 2). The
  embedding (and the tied output layer it doubles as, or an untied `lm_head`) is the
  target's, frozen unless `--train-embed`; the layers and the final norm start from the
  target's (`--init spaced`, the default: evenly spaced, first and last included;
  `first`: layers 0..L-1. Neither agrees with the target untrained (SmolLM2, 2 layers:
  6% / 0% top-1); after 30 steps on 32 prompts both reach 14%, spaced with the lower
  KL, 5.0 against 5.9). Same
  tokenizer and vocabulary, so draft tokens are target tokens.
* Data: prompts from several datasets (`--data`, default ../shared/data: NQ passage +
  question and GSM8K as chat, HumanEval as plain text, Wikipedia summaries as chat). The
  target continues each one greedily (`--gen-tokens`, to EOS) in a batched KV-cache loop
  that also keeps its top-`--topk` log-probabilities at every position: the greedy
  outputs and the teacher-forced logits over prompt + continuation come from one pass.
  Each prompt's result is cached on disk (`--data-dir`), so reruns and resumes skip it;
  with `--minutes`, new teacher work stops at DATA_SHARE of the budget.
  Evaluation prompts come from the first `EVAL_POOL` records of each file (where the
  benchmarks take theirs), training prompts from the rest: the two never overlap.
* Loss: KL(target || draft) at temperature 1 over the target's top-k tokens plus one
  bucket for the rest of the vocabulary (exact on the top-k, a lower bound of the full
  KL), plus `--ce-weight` x cross-entropy on the target's greedy token. Positions are the
  continuation (where a draft proposes), plus the prompt at `--prompt-weight`.
  Sequences are packed into rows of `--seq-len` tokens (block-diagonal causal masks,
  positions restart per sequence). optax AdamW, linear warmup + cosine decay, grad-norm
  clipping at 1.
* Metric: top-1 agreement (draft argmax == the target's greedy next token) on the
  continuations of the held-out prompts, every `--eval-every` steps and at the end (top-5
  too: the target's token is among the draft's 5 best, what a token tree can use).
* Output: `--out` (default `<cache root>/drafts/<target>-L<layers>`) is a directory that
  `lookahead_jax.load` reads (`save_pretrained` format: orbax params + model config +
  the target's tokenizer), plus `train_state/<step>/` (orbax: trainable params and
  optimizer state), `distill.json` (the run's settings, step, loss and agreement
  history). Rerunning with the same `--out` resumes at the saved step; Ctrl-C saves
  first. `--minutes` bounds the wall time of one invocation (data included): training
  stops early when the next steps and the final evaluation would not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import presets
from .models import ModelConfig, forward, hidden_states, init_cache, logits_from_hidden

log = logging.getLogger("lookahead_jax")

DATA_FORMAT = "lookahead-jax-distill-data/1"
STATE_FORMAT = "lookahead-jax-distill/1"
DATA_SHARE = 0.45  # of --minutes: teacher data stops there (the rest is training)
EVAL_POOL = 40  # the first records of each data file: evaluation prompts only
SOURCES = ("nq", "gsm8k", "humaneval", "wiki")


# ----------------------------------------------------------------------------- settings
@dataclasses.dataclass
class DistillConfig:
    """Everything that shapes a run. Fields marked (resume) must match a saved run."""

    layers: int = 2  # (resume)
    init: str = "spaced"  # (resume) "first" | "spaced"
    train_embed: bool = False  # (resume)
    steps: int = 100  # cosine horizon; a rerun with more steps extends the run
    batch_size: int = 8  # (resume) packed rows per step
    seq_len: int = 288  # (resume) tokens per packed row (and the longest prompt + continuation)
    lr: float = 1.5e-3
    warmup: int = 10
    weight_decay: float = 0.01
    ce_weight: float = 0.25  # cross-entropy on the target's greedy token, beside the KL
    prompt_weight: float = 0.0  # loss weight of prompt positions (continuation: 1)
    topk: int = 32  # (resume) teacher log-probs kept per position
    gen_tokens: int = 128  # (resume) greedy continuation length (stops at EOS)
    gen_batch: int = 16  # prompts per teacher chunk
    seed: int = 0  # (resume)
    minutes: Optional[float] = None  # wall-clock budget of one invocation
    eval_every: int = 25
    save_every: int = 25

    RESUME_KEYS = ("layers", "init", "train_embed", "batch_size", "seq_len", "topk", "gen_tokens",
                   "seed")


# ----------------------------------------------------------------------------- prompts
def default_data_dir() -> Path:
    """$LOOKAHEAD_JAX_DATA, else ../shared/data beside the repository (as the benchmarks)."""
    env = os.environ.get("LOOKAHEAD_JAX_DATA")
    return Path(env) if env else Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def _read_jsonl(path: Path) -> list:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass --data DIR (or set LOOKAHEAD_JAX_DATA) "
                                "to the folder holding nq_rag.jsonl, gsm8k_test.jsonl, ...")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def source_prompts(data_dir, source: str) -> list:
    """All prompts of one source, in file order (the benchmarks' formats for nq, gsm8k,
    humaneval: bench/common.py). A prompt is a str or a list of chat messages."""
    data_dir = Path(data_dir)
    if source == "nq":
        rows = [r for r in _read_jsonl(data_dir / "nq_rag.jsonl") if len(r["context"]) <= 2400]
        return [[{"role": "user", "content": "Answer the question using the passage.\n\n"
                  f"Passage: {r['context']}\n\nQuestion: {r['question']}?"}] for r in rows]
    if source == "gsm8k":
        rows = _read_jsonl(data_dir / "gsm8k_test.jsonl")
        return [[{"role": "user", "content": r["question"] + "\nLet's think step by step."}]
                for r in rows]
    if source == "humaneval":
        return [r["prompt"] for r in _read_jsonl(data_dir / "humaneval.jsonl")]
    if source == "wiki":  # the Vital Articles summaries (the nq* passages are NQ's contexts)
        rows = [r for r in _read_jsonl(data_dir / "wiki_passages.jsonl")
                if not str(r.get("id", "")).startswith("nq") and 200 <= len(r["text"]) <= 1600]
        return [[{"role": "user", "content": f"Summarize this text in a few sentences.\n\n{r['text']}"}]
                for r in rows]
    raise ValueError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")


def split_prompts(data_dir, n_train: int, n_eval: int, seed: int = 0,
                  sources: Sequence[str] = SOURCES, fits: Optional[Callable] = None) -> tuple[dict, dict]:
    """({source: train prompts}, {source: eval prompts}): eval prompts are the first
    `n_eval` of each source's first `EVAL_POOL` records, train prompts `n_train` drawn
    (seeded) from the records after them; only prompts with `fits(prompt)` true."""
    fits = fits or (lambda p: True)
    train, evals = {}, {}
    for s in sources:
        rows = source_prompts(data_dir, s)
        pool = rows[EVAL_POOL:]
        order = np.random.default_rng(seed).permutation(len(pool))
        train[s] = _first(fits, (pool[i] for i in order), n_train)
        evals[s] = _first(fits, rows[:EVAL_POOL], n_eval)
    return train, evals


def _first(pred, items, n: int) -> list:
    out = []
    for x in items:
        if len(out) >= n:
            break
        if pred(x):
            out.append(x)
    return out


# ----------------------------------------------------------------------------- teacher data
@functools.partial(jax.jit, static_argnames=("config", "k"), donate_argnames=("cache",))
def _teacher_prefill(params, tokens, lengths, cache, config, k):
    """Prompts tokens [B,T] (right-padded to T, real lengths [B]) from an empty cache ->
    (top-k log-probs [B,T,k] f16, their ids [B,T,k], greedy next token [B], cache)."""
    B, T = tokens.shape
    W = cache.max_len
    t = jnp.arange(T)[None, :, None]
    s = jnp.arange(W)[None, None, :]
    mask = (s <= t) & (s < lengths[:, None, None])  # [B,T,W]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, cache = forward(params, tokens, pos, cache, mask, config)
    v, i = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    return v.astype(jnp.float16), i, jnp.argmax(last, -1).astype(jnp.int32), cache.replace(length=lengths)


@functools.partial(jax.jit, static_argnames=("config", "k"), donate_argnames=("cache",))
def _teacher_step(params, tokens, cache, config, k):
    """One greedy step: tokens [B] at each row's position `length` -> (top-k [B,k] f16,
    ids, next token [B], cache advanced by one)."""
    L = cache.length
    mask = jnp.arange(cache.max_len)[None, None, :] <= L[:, None, None]  # [B,1,W]
    logits, cache = forward(params, tokens[:, None], L[:, None], cache, mask, config)
    v, i = jax.lax.top_k(jax.nn.log_softmax(logits[:, 0], axis=-1), k)
    return v.astype(jnp.float16), i, jnp.argmax(logits[:, 0], -1).astype(jnp.int32), \
        cache.replace(length=L + 1)


def _runtime_params(model):
    """The target's params for the teacher loop: packed for the CPU kernels on one CPU
    device in f32 (~2x faster weight reads; the same values), else as they are."""
    params = model.params
    leaf = params["embed"]
    if (jax.default_backend() == "cpu" and leaf.dtype == jnp.float32
            and len(getattr(leaf, "devices", lambda: [None])()) == 1):
        from .models.transformer import pack_params

        return pack_params(params)
    return params


def teacher_chunk(model, params, prompt_ids: Sequence[Sequence[int]], gen_tokens: int, seq_len: int,
                  k: int, eos_ids=(), batch: Optional[int] = None) -> list:
    """The target continues each prompt greedily (at most `gen_tokens`, to EOS) and keeps
    its top-k log-probs at every position. -> per prompt a dict with `tokens` (prompt +
    continuation, EOS included), `n_prompt`, `topk_v` [n-1,k] f16 and `topk_i` [n-1,k]
    int32: the target's distribution over token t+1 at position t.

    Rows are padded to `batch` (default: the prompt count) with one-token dummies so the
    jitted steps see one shape; the cache holds `seq_len` slots."""
    cfg = model.config
    B = batch or len(prompt_ids)
    n = len(prompt_ids)
    lens = [len(p) for p in prompt_ids]
    if max(lens) + gen_tokens > seq_len:
        raise ValueError(f"a prompt of {max(lens)} tokens + {gen_tokens} new does not fit {seq_len}")
    T = min(seq_len, -(-max(lens) // 32) * 32)  # prompt length bucket: few compilations
    toks = np.zeros((B, T), np.int32)
    for r, p in enumerate(prompt_ids):
        toks[r, :len(p)] = p
    lengths = np.array(lens + [1] * (B - n), np.int32)
    cache = init_cache(cfg, B, seq_len, dtype=model.params["embed"].dtype)
    v, i, nxt, cache = _teacher_prefill(params, jnp.asarray(toks), jnp.asarray(lengths), cache,
                                        config=cfg, k=k)
    v, i = np.asarray(v), np.asarray(i)
    vs = [[v[r, :lens[r]]] for r in range(n)]  # positions 0..len-1 of the prompt
    is_ = [[i[r, :lens[r]]] for r in range(n)]
    gen: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    eos = set(int(e) for e in eos_ids)
    for step in range(gen_tokens):
        nxt_h = np.asarray(nxt)
        for r in range(n):
            if not done[r]:
                gen[r].append(int(nxt_h[r]))
                done[r] = int(nxt_h[r]) in eos or len(gen[r]) >= gen_tokens
        if all(done):
            break
        v, i, nxt, cache = _teacher_step(params, nxt, cache, config=cfg, k=k)
        v, i = np.asarray(v), np.asarray(i)
        for r in range(n):
            if not done[r]:
                vs[r].append(v[r][None])
                is_[r].append(i[r][None])
    out = []
    for r in range(n):
        tokens = list(prompt_ids[r]) + gen[r]
        tv = np.concatenate(vs[r])[:len(tokens) - 1]
        ti = np.concatenate(is_[r])[:len(tokens) - 1].astype(np.int32)
        out.append(dict(tokens=np.asarray(tokens, np.int32), n_prompt=lens[r], topk_v=tv, topk_i=ti))
    return out


def model_fingerprint(model) -> str:
    """Short hash of a model's config, name, dtype and a few weights (cache keys)."""
    e = np.asarray(model.params["embed"][:4, :8], np.float32)
    blob = json.dumps([model.config.to_dict(), getattr(model, "name", ""),
                       str(jnp.dtype(model.params["embed"].dtype)), e.tolist()], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _save_examples(path: Path, examples: list) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, format=np.array(DATA_FORMAT),
             lengths=np.array([len(e["tokens"]) for e in examples], np.int64),
             n_prompt=np.array([e["n_prompt"] for e in examples], np.int64),
             tokens=np.concatenate([e["tokens"] for e in examples]),
             topk_v=np.concatenate([e["topk_v"] for e in examples]),
             topk_i=np.concatenate([e["topk_i"] for e in examples]))
    os.replace(tmp, path)


def _load_examples(path: Path) -> list:
    with np.load(path) as z:
        if str(z["format"]) != DATA_FORMAT:
            raise ValueError(f"{path}: format {z['format']}, expected {DATA_FORMAT}")
        lengths, n_prompt = z["lengths"], z["n_prompt"]
        tokens, tv, ti = z["tokens"], z["topk_v"], z["topk_i"]
    out, a, b = [], 0, 0
    for n, p in zip(lengths, n_prompt):
        out.append(dict(tokens=tokens[a:a + n], n_prompt=int(p), topk_v=tv[b:b + n - 1],
                        topk_i=ti[b:b + n - 1]))
        a, b = a + n, b + n - 1
    return out


def build_examples(model, tokenizer, prompts: dict, cfg: DistillConfig, data_dir: Path,
                   what: str = "data", progress: bool = True, deadline: float = math.inf) -> dict:
    """{source: examples} for {source: prompts} (see `teacher_chunk`), cached per prompt
    under `data_dir` (key: the target, the prompt's token ids and the settings); the
    missing ones are run in chunks of `cfg.gen_batch` prompts of one source and similar
    length, the sources taking turns. Prompts longer than `seq_len - gen_tokens` tokens
    are dropped (logged); past `deadline` (`time.perf_counter()`) no new chunk starts
    and the prompts left out are dropped (logged; a rerun computes them)."""
    from tqdm.auto import tqdm

    from .generate import encode_prompts

    fp = model_fingerprint(model)
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    limit = cfg.seq_len - cfg.gen_tokens
    data_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    todo = []  # (source, slot, ids, path)
    for s, ps in prompts.items():
        ids = [x for x in encode_prompts(tokenizer, ps, chat=False) if len(x) <= limit] if ps else []
        if len(ids) < len(ps):
            log.info("%s %s: %d of %d prompts are longer than %d tokens; dropped", what, s,
                     len(ps) - len(ids), len(ps), limit)
        out[s] = [None] * len(ids)
        for j, x in enumerate(ids):
            key = hashlib.sha1(json.dumps([DATA_FORMAT, fp, x, cfg.gen_tokens, cfg.topk,
                                           eos]).encode()).hexdigest()[:20]
            path = data_dir / f"{key}.npz"
            try:
                out[s][j] = _load_examples(path)[0] if path.is_file() else None
            except Exception as e:  # unreadable cache entry: rebuild it
                log.warning("ignoring unreadable data file %s (%s)", path, e)
            if out[s][j] is None:
                todo.append((s, j, x, path))
    # a chunk runs to its longest continuation and pads to its longest prompt: chunk
    # prompts of one source (similar answer lengths) and similar lengths; sources take
    # turns, so a deadline leaves every source some data
    per: dict = {}
    for t in sorted(todo, key=lambda t: len(t[2])):
        per.setdefault(t[0], []).append(t)
    runs = [[v[i:i + cfg.gen_batch] for i in range(0, len(v), cfg.gen_batch)] for v in per.values()]
    chunks = [c for group in itertools.zip_longest(*runs) for c in group if c]
    if chunks:
        params = _runtime_params(model)
        bar = tqdm(chunks, desc=f"teacher {what}", unit="chunk", disable=not progress, dynamic_ncols=True)
        for chunk in bar:
            if time.perf_counter() > deadline:
                left = sum(map(len, chunks[chunks.index(chunk):]))
                log.info("%s: time budget reached; %d prompts left for a rerun", what, left)
                break
            rows = min(cfg.gen_batch, 1 << (len(chunk) - 1).bit_length())  # few shapes, little padding
            exs = teacher_chunk(model, params, [t[2] for t in chunk], cfg.gen_tokens, cfg.seq_len,
                                cfg.topk, eos, batch=rows)
            for (s, j, _, path), e in zip(chunk, exs):
                _save_examples(path, [e])
                out[s][j] = e
            bar.set_postfix(new_tokens=sum(len(e["tokens"]) - e["n_prompt"] for e in exs))
    for s in out:
        out[s] = [e for e in out[s] if e is not None]
        for e in out[s]:
            e["source"] = s
    return out


# ----------------------------------------------------------------------------- packing
def loss_positions(ex: dict, prompt_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """(positions, weights) of an example's loss: the continuation's positions
    n_prompt-1 .. n-2 (weight 1) and, at prompt_weight > 0, the prompt's 0 .. n_prompt-2."""
    n, p = len(ex["tokens"]), ex["n_prompt"]
    cont = np.arange(p - 1, n - 1)
    if prompt_weight <= 0:
        return cont, np.ones(len(cont), np.float32)
    pre = np.arange(0, p - 1)
    return (np.concatenate([pre, cont]),
            np.concatenate([np.full(len(pre), prompt_weight, np.float32), np.ones(len(cont), np.float32)]))


def loss_slots(seq_len: int, prompt_weight: float) -> int:
    """Loss positions per packed row: the output layer (the costly part of a draft step)
    runs on these only. Continuation only: half the row."""
    return seq_len if prompt_weight > 0 else seq_len // 2


def pack_rows(examples: list, order: Sequence[int], seq_len: int, slots: int,
              prompt_weight: float) -> list:
    """First-fit packing of examples (in `order`) into rows of <= seq_len tokens and
    <= slots loss positions -> list of rows (lists of example indices)."""
    rows, used = [], []  # used: (tokens, loss positions) per row
    for j in order:
        n = len(examples[j]["tokens"])
        m = min(len(loss_positions(examples[j], prompt_weight)[0]), slots)
        for r, (a, b) in enumerate(used):
            if a + n <= seq_len and b + m <= slots:
                rows[r].append(j)
                used[r] = (a + n, b + m)
                break
        else:
            rows.append([j])
            used.append((n, m))
    return rows


def make_batch(examples: list, rows: Sequence[Sequence[int]], n_rows: int, seq_len: int, slots: int,
               k: int, prompt_weight: float, teacher: bool = True) -> dict:
    """Numpy arrays of `n_rows` packed rows (missing rows are padding):
    tokens/positions/segment [R,T] (segment 0 = padding), loss idx/weight/label [R,P]
    (label: the target's greedy next token), and teacher top-k tv/ti [R,P,k]."""
    R, T, P = n_rows, seq_len, slots
    b = dict(tokens=np.zeros((R, T), np.int32), positions=np.zeros((R, T), np.int32),
             segment=np.zeros((R, T), np.int32), idx=np.zeros((R, P), np.int32),
             weight=np.zeros((R, P), np.float32), label=np.zeros((R, P), np.int32))
    if teacher:
        b.update(tv=np.full((R, P, k), -1e4, np.float32), ti=np.zeros((R, P, k), np.int32))
    for r, row in enumerate(rows):
        a = c = 0
        for seg, j in enumerate(row, 1):
            ex = examples[j]
            n = len(ex["tokens"])
            b["tokens"][r, a:a + n] = ex["tokens"]
            b["positions"][r, a:a + n] = np.arange(n)
            b["segment"][r, a:a + n] = seg
            pos, w = loss_positions(ex, prompt_weight)
            if len(pos) > P - c:  # longer than a row's loss budget alone: keep its first slots
                pos, w = pos[:P - c], w[:P - c]
            m = len(pos)
            b["idx"][r, c:c + m] = a + pos
            b["weight"][r, c:c + m] = w
            b["label"][r, c:c + m] = ex["tokens"][pos + 1]
            if teacher:
                b["tv"][r, c:c + m] = ex["topk_v"][pos].astype(np.float32)
                b["ti"][r, c:c + m] = ex["topk_i"][pos]
            a, c = a + n, c + m
    return b


def epoch_batches(examples: list, cfg: DistillConfig, epoch: int) -> list:
    """The batches (lists of packed rows) of one epoch: a seeded shuffle per epoch, packed;
    a last partial batch is kept only when it is the only one."""
    order = np.random.default_rng([cfg.seed, epoch]).permutation(len(examples))
    rows = pack_rows(examples, order, cfg.seq_len, loss_slots(cfg.seq_len, cfg.prompt_weight),
                     cfg.prompt_weight)
    full = [rows[i:i + cfg.batch_size] for i in range(0, len(rows), cfg.batch_size)]
    if len(full) > 1 and len(full[-1]) < cfg.batch_size:
        full = full[:-1]
    return full


def batch_stream(examples: list, cfg: DistillConfig, start_step: int):
    """Yields (step, rows) from `start_step` on, deterministic in (data, seed): a resumed
    run sees the batches an uninterrupted one would."""
    step, epoch = 0, 0
    while True:
        for rows in epoch_batches(examples, cfg, epoch):
            if step >= start_step:
                yield step, rows
            step += 1
        epoch += 1


# ----------------------------------------------------------------------------- the draft
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
def _train_step_fn(config: ModelConfig, ce_weight: float, opt_key: tuple):
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
def _state_meta(out: Path) -> Optional[dict]:
    f = out / "distill.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _latest_state(out: Path) -> Optional[Path]:
    d = out / "train_state"
    steps = sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []
    return d / f"{steps[-1]:08d}" if steps else None


def export_model(out: Path, config: ModelConfig, params, tokenizer, name: str) -> None:
    """Write the draft where `lookahead_jax.load(out)` finds it (`save_pretrained`),
    replacing a previous export (built beside it, then moved in)."""
    from .loading import Model, save_pretrained

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


# ----------------------------------------------------------------------------- the run
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
    meta = _state_meta(out)
    settings = dataclasses.asdict(cfg)
    if meta is not None:
        bad = [k for k in DistillConfig.RESUME_KEYS if meta["settings"].get(k) != settings[k]]
        if bad:
            saved = ", ".join(f"{k}={meta['settings'].get(k)!r}" for k in bad)
            now = ", ".join(f"{k}={settings[k]!r}" for k in bad)
            raise ValueError(f"{out} holds a run with other settings ({saved}; this run: {now}): "
                             "pass the saved ones, or another --out")

    evals = build_examples(target, tokenizer, eval_prompts, cfg, data_dir, "eval", progress)
    train = build_examples(target, tokenizer, train_prompts, cfg, data_dir, "train", progress,
                           deadline=t0 + DATA_SHARE * budget)
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
    latest = _latest_state(out)
    if meta is not None and latest is not None:
        trainable, opt_state = restore_state(latest, trainable, opt_state)
        start = int(latest.name)
        history = [h for h in history if h["step"] <= start]
        evals_hist = [e for e in evals_hist if e["step"] <= start]
        report(f"resuming {out} at step {start}")
    name = name or f"{getattr(target, 'name', '') or 'target'}-draft-L{cfg.layers}"
    opt_key = tuple(sorted((k, settings[k]) for k in ("lr", "warmup", "steps", "weight_decay")))
    step_fn = _train_step_fn(config, float(cfg.ce_weight), opt_key)
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


# ----------------------------------------------------------------------------- CLI
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
        from .cli import enable_compilation_cache

        enable_compilation_cache()
    except Exception:  # the cache only saves compile time
        pass
    from .loading import load

    cfg = DistillConfig(layers=a.layers, init=a.init, train_embed=a.train_embed, steps=a.steps,
                        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                        ce_weight=a.ce_weight, prompt_weight=a.prompt_weight, topk=a.topk,
                        gen_tokens=a.gen_tokens, seed=a.seed, minutes=a.minutes or None,
                        eval_every=a.eval_every, save_every=a.save_every)
    out = Path(a.out).expanduser() if a.out else default_out(a.target, a.layers)
    sources = [s.strip() for s in a.sources.split(",") if s.strip()]
    t = time.perf_counter()
    target, tok = load(a.target, dtype="float32", keep_unpacked=True)  # init_draft copies its layers
    from .generate import encode_prompts

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


if __name__ == "__main__":
    sys.exit(main())
