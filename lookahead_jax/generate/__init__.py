"""`generate`: the public API over the decode core (and `python -m lookahead_jax.generate`).

`generate` encodes the prompts, sizes the cache, and decodes every row through the slot
API (`core/slots.py`: one insert of all rows, steps until none is busy; the strategy
brings drafter, acceptance rule and budget policy, and, when it drives the loop itself
(retrieval: ralm, knnlm), its `Run`); it returns texts, token ids and stats. The CLI lives in `cli.py`; this package's `__main__` hands over to it, so
`python -m lookahead_jax.generate` keeps working.

With `prefix_cache=` (bytes) the slots prefill in blocks of `PREFIX_CHUNK` tokens and keep
each prompt block's K/V on the engine (`core.prefix_cache`, as the server's slots): rows of
one call that begin alike forward their common blocks once (the later rows wait for them,
`PrefixRows.ready`), and a later call of the process with the same header takes them from
the engine (same batch size and cache length: a block's program depends on them).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Callable, Optional

import numpy as np

from ..core.decode import CACHE_ROUND, prompt_bucket
from ..core.slots import Request, Slots
from ..core.compile import CompiledFunctions
from ..core.engine import engine_for
from ..models.config import ModelConfig
from ..core.params import GenerationParams
from ..core.prefix_cache import budget_bytes
from ..prompts import encode_prompts
from ..strategies import REGISTRY, resolve

log = logging.getLogger("lookahead_jax")

STRATEGIES = tuple(REGISTRY)
# prompt tokens per prefill block with the prefix cache (its unit: 63): the server's default
# (serve.server.DEFAULT_PREFILL_CHUNK), a block the size of a few decode steps
PREFIX_CHUNK = 64


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
    sample_index: int = 0  # which of the n samples of its prompt (generate's n)
    logprobs: Optional[list] = None  # per token id: the model's log-probability (generate's logprobs=True)
    retrieval: Optional[dict] = None  # the row's retrieval counters (knnlm)
    # per prompt id (params.prompt_logprobs): its log-probability given those before it
    # (None for the first), and the k most likely (id, log-probability) pairs there
    prompt_logprobs: Optional[list] = None
    prompt_top_logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None  # per generated id (params.top_logprobs): its most likely (id, logprob) pairs
    prefill_steps: int = 0  # of forward_steps, the prompt's prefill (1)
    prefill_tokens: int = 0  # of token_ids, those the prefill gave (1; knnlm: 0)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per forward step (plain decoding: 1.0)."""
        return self.new_tokens / max(self.forward_steps, 1)

    @property
    def decode_steps(self) -> int:
        """Forward steps after the prompt's prefill."""
        return self.forward_steps - self.prefill_steps

    @property
    def tokens_per_decode_step(self) -> float:
        """Tokens after the prefill's per decode step (plain decoding: 1.0, knnlm's too)."""
        return (self.new_tokens - self.prefill_tokens) / self.decode_steps if self.decode_steps > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return dict(
            prompt_index=self.prompt_index, **({"sample_index": self.sample_index} if self.sample_index else {}),
            text=self.text, token_ids=self.token_ids, **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
            new_tokens=self.new_tokens, finish_reason=self.finish_reason,
            forward_steps=self.forward_steps,
            mean_accepted_tokens=round(self.mean_accepted_tokens, 4),
            wall_s=round(self.wall_s, 4), tokens_per_s=round(self.tokens_per_s, 3),
            **({"retrieval": self.retrieval} if self.retrieval is not None else {}),
            **({"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}),
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


# ----------------------------------------------------------------------------- helpers
# ----------------------------------------------------------------------------- generate
def generate(model, tokenizer, prompts, max_new_tokens: int = 128, strategy="greedy",
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop=None, chat: bool = False, references=None, drafter=None,
             on_text: Optional[Callable[[int, str], None]] = None,
             max_cache_len: Optional[int] = None, ignore_eos: bool = False,
             first_index: int = 0, mesh=None, stop_token_ids=None, n: int = 1,
             min_new_tokens: int = 0, logprobs: bool = False, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, overlap: bool = False,
             fallback: bool = False, on_step: Optional[Callable[[], None]] = None,
             params: Optional[GenerationParams] = None, logit_bias=None, prefix_cache: Optional[int] = None,
             **strategy_options) -> GenerateOutput:
    """Generate continuations of `prompts` (batched).

    model: a `Model` from `load` (its default `Engine`: compiled steps and measured costs
        are kept per model), or an `Engine`.
    prompts: a str, chat messages, token ids, or a list of those (one row each; rows are
        right-padded internally and finish independently). `chat=True` wraps plain strings
        in the model's chat template.
    strategy: a strategy object (`Greedy()`, `Lookahead(decoding_length=7)`, ...) or its
        name, with its options given flat (`strategy="lookahead", decoding_length=7,
        branch_length=12, mode="hierarchical"`; see `strategies.py`). "greedy" is plain
        decoding (with temperature > 0 it samples); "lookahead" drafts by suffix match over
        the request and earlier outputs (`drafts="trie"`: an n-gram trie) and verifies
        token trees, with output identical to "greedy". "ralm" / "ralmspec":
        retrieval-augmented decoding (`ralm.py`; ralmspec gives ralm's tokens, faster).
    temperature/top_k/top_p/seed: sampling; the random key of each token is a function of
        (seed, row index, absolute position), so every strategy samples the same tokens.
    stop: strings that end a row (excluded from `text`; token_ids end with the token that
        completed the stop string).
    references: drafting strategies only; per prompt a list of texts (e.g. retrieved
        passages) the drafter drafts from too. A single list of texts applies to every prompt.
    drafter: a drafter object (`drafters.base.Drafter` protocol) to use instead of the
        strategy's own (e.g. a `TrieDrafter` with its own trie).
    on_text(prompt_index, text_delta): streaming callback, called as tokens are accepted.
    max_cache_len: KV cache slots (default: prompt + max_new_tokens + verify block, rounded).
    ignore_eos: keep generating past EOS (benchmarks of a fixed length, as in vLLM).
    stop_token_ids: more token ids that end a row like EOS (kept in token_ids; finish
        reason "eos"), also with ignore_eos.
    n: samples per prompt (temperature > 0): each prompt becomes n consecutive rows, each
        with its own sampling row (so its own tokens); `rows[i * n + j]` is sample j of
        prompt i (its `prompt_index` is the prompt's, `sample_index` is j).
    min_new_tokens: EOS and stop_token_ids cannot end a row before it has this many tokens
        (their probability is 0 there, in plain decoding and inside every verify step, so
        each strategy stays exact); stop strings still apply.
    logprobs: each row's `logprobs` holds the model's log-probability of each generated
        token (log_softmax of the raw logits: before penalties, temperature, top-k/p and
        the min_new_tokens ban), the same values under every strategy.
    repetition_penalty: > 0, 1 = off (HF's `repetition_penalty`): every id that occurs in
        the row's context (prompt + generated so far) has its logit divided by it where the
        logit is > 0 and multiplied by it otherwise (> 1 discourages repeats).
    presence_penalty, frequency_penalty: in [-2, 2], 0 = off (vLLM / OpenAI): over the
        row's generated ids only, logit -= presence_penalty * (count > 0) +
        frequency_penalty * count. The penalties apply to the raw logits in that order,
        before temperature, top-k/p and the min_new_tokens ban, at every position; inside a
        verify step each tree node is penalized by its own path (the context plain
        decoding would have there), so every strategy stays exact. For ralm / ralmspec the
        context includes the retrieved passage (it is part of the row's prompt).
    logit_bias: {token id: bias in [-100, 100]} (at most 300 ids; OpenAI's logit_bias):
        added to the raw logits at every position before the penalties and the rest, so
        greedy rows take the biased argmax and sampled rows sample the biased distribution;
        every verify step checks drafts against the same biased logits, so every strategy
        stays exact (`logprobs` stay those of the raw logits).
    first_index: index of the first prompt (for prompt_index, error messages and the
        sampling key's row), so a long list decoded in batches samples as one batch.
    mesh: a `jax.sharding.Mesh` with axes ("data", "model") (`sharding.make_mesh`): params
        split by the rule table, batch rows and the KV cache over "data".
    overlap: a drafting step's budget bookkeeping (and the suffix / trie drafter's store
        update) runs while the next step's forward computes (`core.decode.step`); the same
        tokens, tree sizes may differ.
    fallback: never wait for a tree size that is not compiled yet: such a step verifies the
        largest compiled one (plain decoding at first) while it compiles in the background
        (`DecodeState.fallback`; the CLI's setting); the same tokens, tree sizes and step
        counts may differ. Off: every tree size compiles at its first use.
    on_step(): called between two steps (after each), in the calling thread; what it raises
        ends the call there (the CLI's Ctrl-C: a KeyboardInterrupt at a step boundary).
    params: the per-request options as one `GenerationParams` (max_new_tokens, sampling,
        seed, stop, stop_token_ids, ignore_eos, n, min_new_tokens, logprobs, penalties,
        logit_bias), instead of the keyword arguments of the same names (give one or the
        other). Every option is checked there: a ValueError (`ParamError`) names the bad one.
    prefix_cache: bytes of prompt-block K/V kept on the engine (`core.prefix_cache`; None or
        0, the default: off). On, the prompts are prefilled in blocks of `PREFIX_CHUNK` tokens
        (each non-last block commits 63): the K/V of every block but a prompt's last is kept,
        rows of the call that begin alike (a few-shot header, a system prompt, n samples)
        forward their common blocks once, and a later call with the same header takes them
        from the engine (hits need the same batch size and cache length, e.g. the CLI's
        shared max_cache_len). The tokens are those of the same call without it (a cached
        block is bit for bit the K/V its own block computes); stats gain the call's
        prefix_cache_* counters (hits: prompt tokens served from the cache). Off by default:
        one call of distinct prompts gains nothing and pays a block program per 63 prompt
        tokens. The retrieval strategies (ralm, ralmspec, knnlm) use it too: their prompts
        (the passage inside) and a passage change's re-prefill take cached blocks
        (`decode.replace_prompt`). SpecInfer's draft model prefills whole prompts.
    """
    cache_bytes = budget_bytes(prefix_cache)
    strat = resolve(strategy, **strategy_options)
    loose = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                 stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, n=n,
                 min_new_tokens=min_new_tokens, logprobs=logprobs, repetition_penalty=repetition_penalty,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias)
    call = _Call(_params(params, loose), first_index, on_text, bool(overlap), bool(fallback), on_step, cache_bytes)
    p = call.params
    engine = engine_for(model, mesh)
    ids, spans = _encode(engine, tokenizer, prompts, chat, call, strat.uses_question_spans)
    B = len(ids)
    if drafter is None:
        drafter = strat.drafter(engine)
    if p.adjusts_logits and not strat.supports_penalties:
        raise ValueError(f"strategy {strat.name!r} picks tokens from its own distribution and does not apply "
                         "repetition / presence / frequency penalties or logit_bias: leave them at their defaults")
    # a strategy that rewrites the prompts and drives the loop itself (retrieval: ralm, knnlm)
    run = strat.start(tokenizer, B, engine=engine)
    lens = [len(x) + (run.extra_tokens if run is not None else 0) for x in ids]
    S = _cache_len(engine.config, lens, p.max_new_tokens, strat.max_nodes(drafter), max_cache_len, call,
                   run.extra_note if run is not None else "")
    p.check_vocab(engine.config.vocab_size)
    eos = p.eos_ids(getattr(tokenizer, "eos_token_ids", ()) or ())
    refs = None if drafter is None else [[tokenizer.encode(t, add_special_tokens=False) for t in r]
                                         for r in _norm_references(references, B, p.n)]
    c_before = CompiledFunctions.total_compile_s  # the target's and any draft model's
    state, drafter, budget, cached = _decode_slots(engine, tokenizer, strat, drafter, run, ids, spans, refs, S, eos,
                                                   call)
    stats = dict(strategy=strat.name, batch=B, prompt_bucket=prompt_bucket(max(lens), S), cache_len=S,
                 compile_s=CompiledFunctions.total_compile_s - c_before, calibrate_s=budget.calibrate_s,
                 compilations=len(engine.compiled.compilations), prompt_tokens=sum(lens), **cached)
    return _outputs(state, call, stats, [budget, run, drafter])


@dataclasses.dataclass(frozen=True)
class _Call:
    """generate's options for this call: the request's (`params`) and how to run it."""

    params: GenerationParams
    first_index: int
    on_text: Optional[Callable]
    overlap: bool = False
    fallback: bool = False
    on_step: Optional[Callable] = None
    prefix_cache: int = 0  # bytes (0: off; prompts are then forwarded whole)

    @property
    def n(self) -> int:
        return self.params.n


def _params(params: Optional[GenerationParams], loose: dict) -> GenerationParams:
    """The call's `GenerationParams`: `params`, or one made of generate's keyword
    arguments of the same names (checked there), not both."""
    if params is None:
        return GenerationParams(**loose)
    if not isinstance(params, GenerationParams):
        raise ValueError(f"params must be a GenerationParams, got {params!r}")
    defaults = {k: v.default for k, v in inspect.signature(generate).parameters.items() if k in loose}
    given = sorted(k for k, v in loose.items() if v != defaults[k])
    if given:
        raise ValueError(f"give the request's options as params= or as keyword arguments, not both: "
                         f"{', '.join(given)} given beside params")
    return params


def _encode(engine, tokenizer, prompts, chat: bool, call: _Call, spans: bool):
    """Rows' token ids (each prompt n times) and, when `spans`, their question spans."""
    n, first = call.n, call.first_index
    ids, where = encode_prompts(tokenizer, prompts, chat, first, spans=True) if spans else \
        (encode_prompts(tokenizer, prompts, chat, first), None)
    V = engine.config.vocab_size
    for i, x in enumerate(ids, first):
        if min(x) < 0 or max(x) >= V:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V})")
    return [x for x in ids for _ in range(n)], where and [x for x in where for _ in range(n)]


def _cache_len(cfg: ModelConfig, lens: list, max_new_tokens: int, max_T: int, max_cache_len, call: _Call,
               extra_note: str = "") -> int:
    """KV cache slots S for rows of `lens` prompt tokens: prompt + max_new_tokens + the
    verify block, rounded to a power of two (few distinct S compile), or a clear error."""
    need = max(lens) + max_new_tokens + max_T + 1
    S = max_cache_len or max(CACHE_ROUND, 1 << (need - 1).bit_length())
    if max_cache_len is None:
        S = min(S, max(cfg.max_position, need))
    over_context = max(lens) + max_new_tokens > cfg.max_position
    if need <= S and not over_context:
        return S
    longest = int(np.argmax(lens))
    limits = []
    if need > S:
        held = (f"max_cache_len={max_cache_len}" if max_cache_len else
                f"the default, capped at the model's {cfg.max_position} positions")
        limits.append(f"it needs {need} cache slots (+{max_T + 1} for verification) but "
                      f"the cache holds {S} ({held})")
    if over_context:
        limits.append(f"the model's context is {cfg.max_position} positions")
    fix = ("Shorten the prompt or lower max_new_tokens (--max-new-tokens)" if over_context or not max_cache_len
           else "Shorten the prompt, lower max_new_tokens (--max-new-tokens), or raise max_cache_len "
                "(--max-cache-len)")
    raise ValueError(
        f"prompt {call.first_index + longest // call.n} has {lens[longest]} tokens "
        + (f"({extra_note}) " if extra_note else "") + "and "
        f"max_new_tokens={max_new_tokens}: " + "; ".join(limits) + f". {fix}.")


def _decode_slots(engine, tokenizer, strat, drafter, run, ids, spans, refs, S: int, eos: tuple, call: _Call):
    """Every row through the slot API (`core.slots.Slots`): one insert of all rows, steps
    until none is busy (a retrieval strategy's `run` drives each step); with a prefix cache,
    prompts in blocks of PREFIX_CHUNK through it. Returns (state, drafter, budget, the call's
    prefix_cache_* counters: {} without one)."""
    first_row = call.first_index * call.n  # prompt i's sample j is sampling row (first_index + i) * n + j
    p = call.params
    slots = Slots(engine, tokenizer, len(ids), S, strat, drafter=drafter, run=run, sampling=p.sampling,
                  penalties=p.penalties, logprobs=p.logprobs, eos_ids=eos,
                  overlap=call.overlap, fallback=call.fallback,
                  prefill_chunk=PREFIX_CHUNK if call.prefix_cache else None, prefix_cache=call.prefix_cache)
    before = slots.prefix.cache.summary() if slots.prefix is not None else None
    state = slots.state
    state.t_start, state.compile_s = time.perf_counter(), 0.0  # setup and calibration are not decode time
    requests = [Request(x, p, sampling_row=first_row + b, on_text=call.on_text,
                        references=refs[b] if refs else (), question_span=spans[b] if spans else None)
                for b, x in enumerate(ids)]
    try:
        slots.insert(list(range(len(ids))), requests)
        state.t_start += slots.begin_s  # the strategy's setup and the drafter's start: not decode time
        state.prefill_s = state.elapsed()  # time to the first token (a run's first retrieval included)
        state.prefill_steps = state.steps
        state.prefill_rows = {r.index: (r.steps, len(r.ids)) for r in state.rows}
        while slots.busy:
            slots.step()
            if call.on_step is not None:
                call.on_step()
        if log.isEnabledFor(logging.INFO):  # the CLI's -v: what this configuration compiles
            log.info("step programs of this call (%d):\n  %s", len(progs := slots.programs()),
                     "\n  ".join(map(str, progs)))
    finally:
        slots.close()
    cached = {}
    if before is not None:  # this call's counts; what the cache holds now
        now = slots.prefix.cache.summary()
        held = ("prefix_cache_bytes", "prefix_cache_blocks", "prefix_cache_capacity")
        cached = {k: v if k in held else v - before[k] for k, v in now.items()}
    return state, slots.drafter, slots.budget, cached


def _outputs(state, call: _Call, stats: dict, parts: list) -> GenerateOutput:
    """Rows and the call's stats (`parts`: budget, run, drafter: their summaries)."""
    wall = state.elapsed()
    run = parts[1]
    n = call.n
    outs = [
        RowOutput(call.first_index + r.index // n, r.text, r.ids, r.prompt_ids, r.finish or "length", r.steps,
                  state.finish_s.get(r.index, wall), r.index % n, r.logprobs,
                  run.row_stats(r.index) if run is not None else None, r.prompt_logprobs,
                  r.prompt_top if r.prompt_k else None, r.tops, *state.prefill_rows.get(r.index, (0, 0)))
        for r in state.rows
    ]
    new = sum(o.new_tokens for o in outs)
    # time to the first token (prefill, compilation excluded as from wall_s), and the rate
    # after it: the tokens after each row's first over the time after the first token
    # (tokens_per_s mixes the two: a long prompt or a first run's one-off costs sink it)
    ttft = min(state.prefill_s, wall)
    later = sum(max(o.new_tokens - 1, 0) for o in outs)
    stats.update(
        forward_steps=state.steps, prefill_steps=state.prefill_steps, new_tokens=new, wall_s=wall,
        tokens_per_s=new / wall if wall > 0 else 0.0, prefill_s=state.prefill_s, ttft_s=ttft,
        decode_tokens_per_s=later / (wall - ttft) if later and wall > ttft else 0.0,
        mean_accepted_tokens=float(np.mean([o.mean_accepted_tokens for o in outs])),
        host_s=state.host_s, mean_tree_size=float(np.mean(state.tree_sizes)) if state.tree_sizes else 0.0,
    )
    for part in parts:
        if part is not None:
            stats.update(part.summary())
    return GenerateOutput(outs, stats)


def _norm_references(references, B: int, n: int = 1):
    """Per row a list of texts: `references` is one text or list for every prompt, or one
    per prompt (repeated for its n samples)."""
    if references is not None and n > 1 and not isinstance(references, str) \
            and not all(isinstance(r, str) for r in references):
        references = [r for r in references for _ in range(n)]
    if references is None:
        return [[] for _ in range(B)]
    if isinstance(references, str):
        references = [references]
    if all(isinstance(r, str) for r in references):
        return [list(references) for _ in range(B)]
    if len(references) != B:
        raise ValueError(f"references: got {len(references)} lists for {B} prompts")
    return [[r] if isinstance(r, str) else list(r) for r in references]
