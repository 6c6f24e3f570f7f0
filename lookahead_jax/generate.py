"""The decode loop (`generate`) and the CLI (`python -m lookahead_jax.generate`).

One loop serves every strategy. Each step packs, per row, the root (last emitted token)
and an optional draft tree (empty for greedy, from the n-gram trie for lookahead) into a
static block of 1+T tokens, and calls the one jitted verify step (`verify.py`), which
commits the accepted tokens to the KV cache. With T = 0 that step *is* plain decoding.

Batching: prompts are right-padded to a bucketed length; every row keeps its own cache
length, so rows finish and accept independently. Shapes are bucketed (prompt length,
cache length, tree size), and every compilation is logged and counted (`compile.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .compile import CompiledFunctions
from .loading import runtime_params
from .models import KVCache, hidden_states, init_cache, logits_from_hidden
from .models.config import ModelConfig
from .sampling import SamplingParams, select_tokens
from . import tree as tree_lib
from .budget import AutoBudget, StepTimes, outcome_known
from .trie import Draft
from .verify import jitted_verify_step, window_for

log = logging.getLogger("lookahead_jax")

STRATEGIES = ("greedy", "lookahead")
# prompt lengths are padded to these (one prefill compilation each); steps of 1.5x above
# 128 tokens, where prefill is compute-bound and padding 278 tokens to 512 cost ~40%
PROMPT_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                  6144, 8192, 12288, 16384, 24576, 32768)
CACHE_ROUND = 256  # smallest cache; caches are powers of two so few shapes compile


# ----------------------------------------------------------------------------- outputs
@dataclasses.dataclass
class RowOutput:
    prompt_index: int
    text: str
    token_ids: list  # generated tokens only (EOS included when it ended the row)
    prompt_token_ids: list
    finish_reason: str  # "eos" | "stop" | "length"
    forward_steps: int  # model forwards that produced this row's tokens (prefill included)
    wall_s: float

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per forward step (plain decoding: 1.0)."""
        return self.new_tokens / max(self.forward_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return dict(
            prompt_index=self.prompt_index, text=self.text, token_ids=self.token_ids,
            new_tokens=self.new_tokens, finish_reason=self.finish_reason,
            forward_steps=self.forward_steps,
            mean_accepted_tokens=round(self.mean_accepted_tokens, 4),
            wall_s=round(self.wall_s, 4), tokens_per_s=round(self.tokens_per_s, 3),
        )


@dataclasses.dataclass
class GenerateOutput:
    rows: list
    stats: dict

    @property
    def texts(self) -> list:
        return [r.text for r in self.rows]

    @property
    def token_ids(self) -> list:
        return [r.token_ids for r in self.rows]


# ----------------------------------------------------------------------------- jitted prefill
def prefill_step(params, cache: KVCache, tokens, lengths, seed, row, *, config: ModelConfig,
                 sampling: SamplingParams):
    """Prompt forward (right-padded [B,P]); returns (first generated token [B], cache)."""
    B, P = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # causal over the prompt's own P slots: attention reads a window of P slots, not S
    mask = jnp.broadcast_to(jnp.arange(P)[None, None, :] <= jnp.arange(P)[None, :, None], (B, P, P))
    h, cache = hidden_states(params, tokens, positions, cache, mask, config)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)  # [B,1,D]
    logits = logits_from_hidden(params, last, config)  # [B,1,V]
    first = select_tokens(logits, sampling, seed, row, lengths[:, None])[:, 0]
    return first, cache.replace(length=lengths.astype(jnp.int32))


@functools.lru_cache(maxsize=None)
def jitted_prefill(config: ModelConfig, sampling: SamplingParams):
    return jax.jit(functools.partial(prefill_step, config=config, sampling=sampling), donate_argnums=(1,))


# ----------------------------------------------------------------------------- helpers
_EMPTY = Draft([], [])


def verify_block(root, drafts, T: int) -> tree_lib.VerifyBlock:
    """Root + drafts packed into the static [B,1+T] block the verify step takes."""
    return tree_lib.with_root(tree_lib.pack(drafts, T), root)


def _compiled_for(model) -> CompiledFunctions:
    c = getattr(model, "_compiled", None)
    if c is None:
        c = CompiledFunctions()
        model._compiled = c
    return c


def encode_prompts(tokenizer, prompts, chat: bool, first_index: int = 0) -> list:
    """Prompts as token-id lists. A prompt is a str, a list of chat messages, or token ids.

    Errors name prompts by `first_index + position`."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
    ):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts, first_index):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = tokenizer.encode(p)
        elif isinstance(p, list) and p and isinstance(p[0], dict):
            text = tokenizer.apply_chat_template(p, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(p, (list, tuple, np.ndarray)) and len(p) and all(
            isinstance(t, (int, np.integer)) for t in p
        ):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is empty or not a str / chat messages / token ids")
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens")
        out.append(ids)
    return out


class _Row:
    """Host-side state of one batch row: generated ids, finish detection, streaming."""

    def __init__(self, index, prompt_ids, tokenizer, eos_ids, stop, max_new, on_text):
        self.index, self.prompt_ids, self.tok = index, prompt_ids, tokenizer
        self.eos_ids, self.stop, self.max_new, self.on_text = eos_ids, stop, max_new, on_text
        self.ids: list = []
        self.finish: Optional[str] = None
        self.steps = 0
        self.text = ""
        self._sent = 0

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def extend(self, new: Sequence[int]) -> list:
        """Append emitted tokens up to EOS / stop / max length; returns those kept."""
        kept = []
        for t in new:
            if self.finish:
                break
            kept.append(int(t))
            self.ids.append(int(t))
            if t in self.eos_ids:
                self.finish = "eos"
            elif len(self.ids) >= self.max_new:
                self.finish = "length"
        if self.stop and kept:
            text = self._decode(self.ids)
            hits = [(text.find(s), s) for s in self.stop if s in text]
            if hits:
                # shortest token prefix whose text contains a stop string
                start = len(self.ids) - len(kept)
                for n in range(start + 1, len(self.ids) + 1):
                    t = self._decode(self.ids[:n])
                    if any(s in t for s in self.stop):
                        del kept[n - start:]
                        del self.ids[n:]
                        break
                self.finish = "stop"
                text = self._decode(self.ids)
                self.text = text[: min(text.find(s) for s in self.stop if s in text)]
                self._stream()
                return kept
        self.text = self._decode(self.ids)
        self._stream()
        return kept

    def _stream(self):
        if self.on_text is None:
            return
        end = len(self.text)
        if not self.finish:
            while end > self._sent and self.text[end - 1] == "\ufffd":  # half a UTF-8 char
                end -= 1
            # hold back a tail that could still become a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self._sent), 0, -1):
                    if self.text[end - k:end] == s[:k]:
                        end -= k
                        break
        if end > self._sent:
            self.on_text(self.index, self.text[self._sent:end])
            self._sent = end


# ----------------------------------------------------------------------------- generate
def generate(model, tokenizer, prompts, max_new_tokens: int = 128, strategy: str = "greedy",
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop=None, chat: bool = False, references=None, decoding_length="auto",
             branch_length: int = 12, mode: str = "hierarchical", drafter=None,
             on_text: Optional[Callable[[int, str], None]] = None,
             max_cache_len: Optional[int] = None, ignore_eos: bool = False,
             first_index: int = 0) -> GenerateOutput:
    """Generate continuations of `prompts` (batched).

    prompts: a str, chat messages, token ids, or a list of those (one row each; rows are
        right-padded internally and finish independently). `chat=True` wraps plain strings
        in the model's chat template.
    strategy: "greedy" (plain decoding; with temperature > 0 it samples) or "lookahead"
        (n-gram trie drafts verified as a token tree; output identical to "greedy").
    temperature/top_k/top_p/seed: sampling; the random key of each token is a function of
        (seed, row index, absolute position), so every strategy samples the same tokens.
    stop: strings that end a row (excluded from `text`; token_ids end with the token that
        completed the stop string).
    references: lookahead only; per prompt a list of texts (e.g. retrieved passages) whose
        n-grams seed the trie. A single list of texts applies to every prompt.
    decoding_length: lookahead draft budget per step (nodes, 0..128), "auto" picks the
        budget that maximises expected tokens/s from measured verify costs among tree sizes
        T = 0, 1, 3, 7, 15, 31, 63 (verify blocks of 1+T = 2^k tokens, the cheap ones).
        Tuned on CPU; on a GPU a fixed 15 is faster for now (bench/results/README.md).
    branch_length: lookahead maximum draft depth.  mode: "hierarchical"|"parallel"|"single".
    on_text(prompt_index, text_delta): streaming callback, called as tokens are accepted.
    max_cache_len: KV cache slots (default: prompt + max_new_tokens + verify block, rounded).
    ignore_eos: keep generating past EOS (benchmarks of a fixed length, as in vLLM).
    first_index: index of the first prompt (for prompt_index, error messages and the
        sampling key's row), so a long list decoded in batches samples as one batch.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    stop = tuple([stop] if isinstance(stop, str) else (stop or ()))
    if any(not s for s in stop):
        raise ValueError("stop strings must be non-empty")
    cfg: ModelConfig = model.config
    compiled = _compiled_for(model)
    ids = encode_prompts(tokenizer, prompts, chat, first_index)
    B = len(ids)
    for i, x in enumerate(ids, first_index):
        if min(x) < 0 or max(x) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size})")

    auto = decoding_length == "auto"
    if strategy == "greedy":
        drafter = None
    elif drafter is None:
        from .drafters.trie import TrieDrafter  # local import: greedy needs no trie

        drafter = TrieDrafter.shared(model, branch_length=branch_length, mode=mode)
    if drafter is not None:
        if not auto and (not isinstance(decoding_length, int) or isinstance(decoding_length, bool)
                         or not 0 <= decoding_length <= tree_lib.MAX_NODES):
            raise ValueError(
                f"decoding_length must be 'auto' or an integer in [0, {tree_lib.MAX_NODES}], got {decoding_length!r}"
            )
        max_T = drafter.max_nodes if auto else decoding_length
        # tree sizes of a step: auto calibrates and picks among the power-of-two blocks
        step_buckets = (tuple(b for b in tree_lib.BUCKETS if b <= max_T) if auto
                        else tree_lib.buckets_up_to(decoding_length))
    else:
        max_T, step_buckets = 0, (0,)

    # ---- shapes
    lens = [len(x) for x in ids]
    need = max(lens) + max_new_tokens + max_T + 1
    S = max_cache_len or max(CACHE_ROUND, 1 << (need - 1).bit_length())  # few distinct S
    if max_cache_len is None:
        S = min(S, max(cfg.max_position, need))
    if need > S or max(lens) + max_new_tokens > cfg.max_position:
        longest = int(np.argmax(lens))
        limits = []
        if need > S:
            limits.append(f"it needs {need} cache slots (+{max_T + 1} for verification) but "
                          f"the cache holds {S} (max_cache_len={max_cache_len})")
        if max(lens) + max_new_tokens > cfg.max_position:
            limits.append(f"the model's context is {cfg.max_position} positions")
        raise ValueError(
            f"prompt {first_index + longest} has {lens[longest]} tokens and "
            f"max_new_tokens={max_new_tokens}: " + "; ".join(limits) + ". Shorten the prompt, "
            "lower max_new_tokens, or raise max_cache_len."
        )
    P = next((b for b in PROMPT_BUCKETS if b >= max(lens)), -(-max(lens) // CACHE_ROUND) * CACHE_ROUND)
    P = min(P, S)

    tokens = np.zeros((B, P), np.int32)
    for b, x in enumerate(ids):
        tokens[b, : len(x)] = x
    seeds = jnp.full((B,), seed, jnp.uint32)
    rowids = jnp.arange(first_index, first_index + B, dtype=jnp.int32)
    eos = set() if ignore_eos else set(getattr(tokenizer, "eos_token_ids", ()) or ())
    rows = [_Row(i, x, tokenizer, eos, stop, max_new_tokens, on_text) for i, x in enumerate(ids)]
    verify = jitted_verify_step(cfg, sampling)

    policy = None
    calibrate_s = 0.0
    c_before = compiled.compile_s
    if drafter is not None:
        refs = _norm_references(references, B)
        drafter.begin(ids, [[tokenizer.encode(t, add_special_tokens=False) for t in r] for r in refs])
        if auto:
            t0 = time.perf_counter()
            mid = max(lens) + max_new_tokens // 2  # calibrate at a typical length of this run
            costs = measure_verify_costs(model, verify, B, S, step_buckets, mid)
            times = model.__dict__.setdefault("_step_times", {}).setdefault((id(verify), B, S), StepTimes())
            policy = AutoBudget(step_buckets, costs, getattr(drafter, "acceptance", None), times=times)
            calibrate_s = time.perf_counter() - t0

    # ---- prefill
    cache = init_cache(cfg, B, S, model.dtype)
    params = runtime_params(model)
    args = (params, cache, jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), seeds, rowids)
    t_start = time.perf_counter()
    c0 = compiled.compile_s
    first, cache = compiled("prefill", jitted_prefill(cfg, sampling), *args)
    first = np.asarray(first)
    prefill_s = time.perf_counter() - t_start - (compiled.compile_s - c0)  # time to first token
    host_s = 0.0
    steps = 1
    for r in rows:
        r.steps = 1
        kept = r.extend([first[r.index]])
        if drafter is not None:
            drafter.accept(r.index, kept)
    root = first.astype(np.int32)
    lengths = np.asarray(lens, np.int64)  # committed cache slots per row (host mirror)
    finish_s = {}
    tree_sizes, pending = [], []

    # ---- decode
    while True:
        active = np.array([r.finish is None for r in rows])
        for r in rows:
            if r.finish and r.index not in finish_s:  # wall time excludes compilation
                finish_s[r.index] = time.perf_counter() - t_start - (compiled.compile_s - c0)
        if not active.any():
            break
        h0 = time.perf_counter()
        drafts = [_EMPTY] * B
        if drafter is not None:
            full = {r.index: drafter.propose(r.index, r.prompt_ids + r.ids, max_T)
                    for r in rows if r.finish is None}
            limit = decoding_length
            if policy:  # one T for the step, from the classes of the rows' drafts
                limit = policy.choose([d.key for d in full.values() if d.tokens], rows=len(full))
                pending += [(rows[i], len(rows[i].ids), d) for i, d in full.items() if d.tokens]
            for i, d in full.items():
                drafts[i] = d if len(d.tokens) <= limit else Draft(d.tokens[:limit], d.parents[:limit])
        T = tree_lib.bucket_for(max(len(d.tokens) for d in drafts), step_buckets)
        blk = verify_block(root, drafts, T)
        window = window_for(int(lengths[active].max()) + 1 + T, S)
        host_s += time.perf_counter() - h0
        tree_sizes.append(T)
        c1, t1 = compiled.compile_s, time.perf_counter()
        emitted, n_emit, cache = compiled(
            "verify", verify, params, cache, blk.tokens, blk.parents, blk.depth, blk.mask,
            active, seeds, rowids, window=window,
        )
        emitted, n_emit = np.asarray(emitted), np.asarray(n_emit)
        h0 = time.perf_counter()
        if policy and compiled.compile_s == c1:  # real step times correct the calibration
            policy.record(T, window, h0 - t1)
        lengths += n_emit
        steps += 1
        for r in rows:
            if not active[r.index]:
                continue
            n = int(n_emit[r.index])
            r.steps += 1
            kept = r.extend(emitted[r.index, :n])
            if drafter is not None:
                drafter.accept(r.index, kept)
            root[r.index] = emitted[r.index, n - 1]
        if policy:  # score past drafts whose true continuation is now known
            keep = []
            for r, g0, d in pending:
                if r.finish or outcome_known(d.tokens, d.parents, r.ids[g0:], drafter.branch_length):
                    policy.observe(d.tokens, d.parents, r.ids[g0:], d.key)
                else:
                    keep.append((r, g0, d))
            pending = keep
        host_s += time.perf_counter() - h0

    wall = time.perf_counter() - t_start - (compiled.compile_s - c0)
    if drafter is not None:
        drafter.end()
    compile_s = compiled.compile_s - c_before
    outs = [
        RowOutput(first_index + r.index, r.text, r.ids, r.prompt_ids, r.finish or "length", r.steps,
                  finish_s.get(r.index, wall))
        for r in rows
    ]
    new = sum(o.new_tokens for o in outs)
    stats = dict(
        strategy=strategy, batch=B, prompt_bucket=P, cache_len=S, forward_steps=steps,
        new_tokens=new, wall_s=wall, tokens_per_s=new / wall if wall > 0 else 0.0, prefill_s=prefill_s,
        mean_accepted_tokens=float(np.mean([o.mean_accepted_tokens for o in outs])),
        host_s=host_s, compile_s=compile_s, calibrate_s=calibrate_s,
        compilations=len(compiled.compilations),
        mean_tree_size=float(np.mean(tree_sizes)) if tree_sizes else 0.0,
    )
    if policy:
        stats["verify_cost_ms"] = {b: round(c * 1e3, 2) for b, c in policy.cost.items()}
        stats["verify_cost_ratio"] = {b: round(r, 3) for b, r in policy.cost_ratios().items()}
        stats["observed_cost_ratio"] = {  # median t(T)/t(0) of real steps, samples
            b: [round(r, 3), n] for b in policy.buckets for r, n in [policy.times.ratio(b)] if n}
        stats["expected_accepted"] = {  # per draft class (match length, dominance)
            str(k): {b: round(a, 3) for b, a in policy.expected_accepted(k).items()}
            for k in sorted(policy.stats.samples)}
    return GenerateOutput(outs, stats)


def measure_verify_costs(model, verify, B: int, S: int, buckets, length: Optional[int] = None,
                         rounds: int = 7) -> dict:
    """Seconds per verify step for each tree bucket T, cached on the model.

    Measured at cache length `length` (default S // 2) with the attention window a step at
    that length uses, on one scratch cache of the real shape. Each bucket is compiled and
    run once, then timed in `rounds` round-robin passes over the buckets (median per
    bucket), so a slow spell of the machine hits every bucket alike rather than one. A
    bigger tree never costs less than a smaller one (running max over T): a noisy low
    reading for T = 1 would otherwise make trees look cheaper than plain decoding."""
    costs = model.__dict__.setdefault("_verify_costs", {})
    compiled = _compiled_for(model)
    cfg = model.config
    todo, keys = {}, {}
    for T in buckets:
        L = min(S // 2 if length is None else length, S - 1 - T)
        window = window_for(L + 1 + T, S)
        key = keys[T] = (id(verify), B, S, T, window)
        if key not in costs:
            blk = verify_block(np.zeros(B, np.int32), [Draft([0] * T, list(range(-1, T - 1)))] * B, T)
            args = (blk.tokens, blk.parents, blk.depth, blk.mask, np.ones(B, bool),
                    jnp.zeros((B,), jnp.uint32), jnp.arange(B, dtype=jnp.int32))
            todo[key] = (T, L, window, args)
    if todo:
        params = runtime_params(model)
        cache = init_cache(cfg, B, S, model.dtype)
        times = {key: [] for key in todo}
        for r in range(rounds + 1):  # round 0 compiles and warms up
            for key, (T, L, window, args) in todo.items():
                cache = cache.replace(length=jnp.full((B,), L, jnp.int32))
                t0 = time.perf_counter()
                res = compiled("verify", verify, params, cache, *args, window=window)
                jax.block_until_ready(res)
                if r:
                    times[key].append(time.perf_counter() - t0)
                cache = res[2]
        for key, (T, L, window, args) in todo.items():
            costs[key] = float(np.median(times[key]))
            log.info("verify cost T=%d (window %d): %.2f ms", T, window, costs[key] * 1e3)
    out, floor = {}, 0.0
    for T in sorted(buckets):
        floor = max(floor, costs[keys[T]])
        out[T] = floor
    return out


def _norm_references(references, B):
    if references is None:
        return [[] for _ in range(B)]
    if isinstance(references, str):
        references = [references]
    if all(isinstance(r, str) for r in references):
        return [list(references) for _ in range(B)]
    if len(references) != B:
        raise ValueError(f"references: got {len(references)} lists for {B} prompts")
    return [[r] if isinstance(r, str) else list(r) for r in references]


# ----------------------------------------------------------------------------- CLI
@dataclasses.dataclass(frozen=True)
class CliConfig:
    model: str
    prompts: tuple  # str or chat-message lists
    references: tuple  # per prompt: tuple of texts
    chat: bool
    strategy: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    dtype: str
    json: bool
    stop: tuple
    batch_size: int
    decoding_length: object
    branch_length: int
    mode: str
    verbose: bool = False


def _fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _read_prompts_file(path: str, references_field: Optional[str]):
    prompts, refs = [], []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        _fail(f"cannot read --prompts-file {path}: {e.strerror}")
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                _fail(f"{path}:{n}: not valid JSON ({e.msg})")
            if not isinstance(obj, dict):
                _fail(f"{path}:{n}: each line must be a JSON object with 'prompt' or 'messages'")
            if "messages" in obj:
                prompts.append(obj["messages"])
            elif "prompt" in obj:
                prompts.append(obj["prompt"])
            else:
                _fail(f"{path}:{n}: each line needs a 'prompt' or 'messages' field")
            if references_field:
                if references_field not in obj:
                    _fail(f"{path}:{n}: no field {references_field!r} (--references-field)")
                r = obj[references_field]
                refs.append(tuple([r] if isinstance(r, str) else r))
            else:
                refs.append(())
    if not prompts:
        _fail(f"--prompts-file {path} holds no prompts")
    return prompts, refs


def parse_args(argv=None) -> CliConfig:
    from .presets import DEFAULT_MODEL

    ap = argparse.ArgumentParser(
        prog="python -m lookahead_jax.generate",
        description="Generate text with a JAX decoder; --strategy lookahead gives the same "
        "tokens as greedy, faster.",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="preset name, local path (.gguf, HF dir, saved checkpoint) or HF hub id")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a single prompt")
    src.add_argument("--prompts-file", help="JSONL file: objects with 'prompt' (text) or 'messages' (chat)")
    ap.add_argument("--chat", action="store_true", help="apply the model's chat template to plain prompts")
    ap.add_argument("--strategy", default="greedy", choices=STRATEGIES)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt, then a summary line")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--decoding-length", default="auto", help="lookahead: draft nodes per step, or 'auto'")
    ap.add_argument("--branch-length", type=int, default=12, help="lookahead: max draft depth")
    ap.add_argument("--lookahead-mode", default="hierarchical", choices=("hierarchical", "parallel", "single"))
    ap.add_argument("--references-field", help="lookahead: JSONL field whose text(s) seed the trie")
    ap.add_argument("-v", "--verbose", action="store_true", help="log compilations and loading")
    a = ap.parse_args(argv)

    if a.dtype not in ("float32", "bfloat16"):
        ap.error(f"--dtype must be float32 or bfloat16, got {a.dtype!r}")
    if a.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if a.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    dl = a.decoding_length
    if dl != "auto":
        try:
            dl = int(dl)
        except ValueError:
            ap.error(f"--decoding-length must be an integer or 'auto', got {dl!r}")
    if a.prompt is not None:
        if not a.prompt.strip():
            ap.error("--prompt is empty")
        prompts, refs = [a.prompt], [()]
        if a.references_field:
            ap.error("--references-field needs --prompts-file")
    else:
        prompts, refs = _read_prompts_file(a.prompts_file, a.references_field)
    return CliConfig(
        model=a.model, prompts=tuple(prompts), references=tuple(refs), chat=a.chat,
        strategy=a.strategy, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
        top_k=a.top_k, top_p=a.top_p, seed=a.seed, dtype=a.dtype, json=a.json,
        stop=tuple(a.stop), batch_size=a.batch_size, decoding_length=dl,
        branch_length=a.branch_length, mode=a.lookahead_mode, verbose=a.verbose,
    )


def enable_compilation_cache() -> Optional[str]:
    """Persist compiled steps across CLI runs (decode steps compile per tree bucket and
    attention window, and `auto` calibrates every bucket: ~20-30 s on a 2-core CPU).

    The CLI owns its process, so it turns on JAX's persistent compilation cache under
    `<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/xla/<host>-<arch>-<cpu hash>`, one
    folder per machine and CPU (entries are native code for this CPU), unless the user configured a cache already
    (JAX_COMPILATION_CACHE_DIR) or set LOOKAHEAD_JAX_XLA_CACHE=0. The library itself never
    changes JAX's global configuration. Returns the directory used, or None."""
    import os
    import platform

    from .presets import cache_root

    if os.environ.get("LOOKAHEAD_JAX_XLA_CACHE", "1") == "0":
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir or os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = cache_root() / "xla" / f"{platform.node() or 'host'}-{platform.machine()}-{_cpu_id()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("no compilation cache (%s): compiling from scratch", e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return str(path)


def _cpu_id() -> str:
    """Short hash of the CPU model and features (cached native code is only valid there)."""
    import hashlib

    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        import platform

        text = platform.processor() or platform.platform()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def main(argv=None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO if cfg.verbose else logging.WARNING, format="%(message)s")
    from .loading import load

    try:
        model, tok = load(cfg.model, dtype=cfg.dtype)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def stream(i, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    kw = dict(
        max_new_tokens=cfg.max_new_tokens, strategy=cfg.strategy, temperature=cfg.temperature,
        top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed, stop=list(cfg.stop), chat=cfg.chat,
        decoding_length=cfg.decoding_length, branch_length=cfg.branch_length, mode=cfg.mode,
    )
    totals = dict(new_tokens=0, wall_s=0.0, forward_steps=0, compile_s=0.0, host_s=0.0, prefill_s=0.0)
    for start in range(0, len(cfg.prompts), cfg.batch_size):
        batch = list(cfg.prompts[start:start + cfg.batch_size])
        refs = [list(r) for r in cfg.references[start:start + cfg.batch_size]]
        streaming = not cfg.json and cfg.batch_size == 1
        try:
            out = generate(model, tok, batch, references=refs, on_text=stream if streaming else None,
                           first_index=start, **kw)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for r in out.rows:
            if cfg.json:
                print(json.dumps(r.to_json(), ensure_ascii=False), flush=True)
            elif streaming:
                print(flush=True)
            else:
                print(f"--- prompt {r.prompt_index}\n{r.text}", flush=True)
        for k in totals:
            totals[k] += out.stats[k]
    summary = dict(
        model=cfg.model, strategy=cfg.strategy, dtype=cfg.dtype, prompts=len(cfg.prompts),
        new_tokens=totals["new_tokens"], wall_s=round(totals["wall_s"], 4),
        tokens_per_s=round(totals["new_tokens"] / totals["wall_s"], 3) if totals["wall_s"] else 0.0,
        prefill_s=round(totals["prefill_s"], 4),
        compile_s=round(totals["compile_s"], 3), host_s=round(totals["host_s"], 4),
        compilations=len(model._compiled.compilations),
    )
    if cfg.json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        print(
            f"[{summary['new_tokens']} tokens in {summary['wall_s']:.2f} s = "
            f"{summary['tokens_per_s']:.1f} tok/s; compile {summary['compile_s']:.1f} s]",
            file=sys.stderr,
        )
    return 0


class _CallableModule(type(sys)):
    """`lookahead_jax.generate(...)` calls the generate function even though the name is
    also this module (needed for `python -m lookahead_jax.generate`)."""

    def __call__(self, *args, **kwargs) -> GenerateOutput:
        return generate(*args, **kwargs)


if __name__ != "__main__":
    sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":
    enable_compilation_cache()  # the CLI's process only; main() called in-process leaves JAX alone
    sys.exit(main())
