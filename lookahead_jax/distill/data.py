"""Distillation data: prompts from the datasets, the teacher's examples (cached on disk per
prompt), and their packing into fixed-shape training rows."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ..core.engine import Engine
from .config import DATA_FORMAT, DistillConfig
from .teacher import teacher_chunk

log = logging.getLogger("lookahead_jax")

EVAL_POOL = 40  # the first records of each data file: evaluation prompts only
SOURCES = ("nq", "gsm8k", "humaneval", "wiki")


def default_data_dir() -> Path:
    """$LOOKAHEAD_JAX_DATA, else ../shared/data beside the repository (as the benchmarks)."""
    env = os.environ.get("LOOKAHEAD_JAX_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


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
    `n_eval` of each source's first `EVAL_POOL` records (the first half of a file with
    fewer than 2 x EVAL_POOL records, such as the repository's data/ samples), train
    prompts `n_train` drawn (seeded) from the records after them; only prompts with
    `fits(prompt)` true."""
    fits = fits or (lambda p: True)
    train, evals = {}, {}
    for s in sources:
        rows = source_prompts(data_dir, s)
        cut = min(EVAL_POOL, len(rows) // 2)
        pool = rows[cut:]
        order = np.random.default_rng(seed).permutation(len(pool))
        train[s] = _first(fits, (pool[i] for i in order), n_train)
        evals[s] = _first(fits, rows[:cut], n_eval)
        if n_train and not train[s]:
            raise ValueError(f"source {s!r}: no training prompt among its {len(rows)} records "
                             f"(the first {cut} are held out for evaluation); pass --data a folder "
                             "with more records, or leave the source out of --sources")
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
    """{source: examples} for {source: prompts} from the target `model` (or its `Engine`;
    see `teacher_chunk`), cached per prompt
    under `data_dir` (key: the target, the prompt's token ids and the settings); the
    missing ones are run in chunks of `cfg.gen_batch` prompts of one source and similar
    length, the sources taking turns. Prompts longer than `seq_len - gen_tokens` tokens
    are dropped (logged); past `deadline` (`time.perf_counter()`) no new chunk starts
    and the prompts left out are dropped (logged; a rerun computes them)."""
    from tqdm.auto import tqdm

    from ..prompts import encode_prompts

    # the target's engine (a new one: its packed copy of the weights goes when this returns)
    engine = model if isinstance(model, Engine) else Engine(model)
    model = engine.model
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
        bar = tqdm(chunks, desc=f"teacher {what}", unit="chunk", disable=not progress, dynamic_ncols=True)
        for chunk in bar:
            if time.perf_counter() > deadline:
                left = sum(map(len, chunks[chunks.index(chunk):]))
                log.info("%s: time budget reached; %d prompts left for a rerun", what, left)
                break
            rows = min(cfg.gen_batch, 1 << (len(chunk) - 1).bit_length())  # few shapes, little padding
            exs = teacher_chunk(engine, [t[2] for t in chunk], cfg.gen_tokens, cfg.seq_len,
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
