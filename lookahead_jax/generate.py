"""`generate`: the public API over the decode core (and `python -m lookahead_jax.generate`).

`generate` encodes the prompts, sizes the cache, builds the strategy's components
(`strategies.py`: drafter, acceptance rule, budget policy), runs the one decode loop
(`decode.py`) and returns texts, token ids and stats. The CLI lives in `cli.py`; this
module runs it when executed, so `python -m lookahead_jax.generate` keeps working.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Callable, Optional

import numpy as np

from . import tree as tree_lib
from .decode import CACHE_ROUND, PROMPT_BUCKETS, decode, prefill, prompt_bucket  # noqa: F401
from .engine import engine_for
from .models.config import ModelConfig
from .sampling import Penalties, SamplingParams
from .strategies import REGISTRY, Greedy, resolve

log = logging.getLogger("lookahead_jax")

STRATEGIES = tuple(REGISTRY)


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
            prompt_index=self.prompt_index, **({"sample_index": self.sample_index} if self.sample_index else {}),
            text=self.text, token_ids=self.token_ids, **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
            new_tokens=self.new_tokens, finish_reason=self.finish_reason,
            forward_steps=self.forward_steps,
            mean_accepted_tokens=round(self.mean_accepted_tokens, 4),
            wall_s=round(self.wall_s, 4), tokens_per_s=round(self.tokens_per_s, 3),
            **({"retrieval": self.retrieval} if self.retrieval is not None else {}),
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
def verify_block(root, drafts, T: int) -> tree_lib.VerifyBlock:
    """Root + drafts packed into the static [B,1+T] block the verify step takes."""
    return tree_lib.with_root(tree_lib.pack(drafts, T), root)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages, where: str = "messages") -> None:
    """Chat messages must be a non-empty list of {"role": one of CHAT_ROLES, "content":
    str}; anything else is a ValueError naming the message and the expected form (rather
    than a template engine's error, or a plain string taken as a prompt)."""
    form = 'a list of {"role": "user", "content": "..."} objects'
    if isinstance(messages, list) and not messages:
        raise ValueError(f"{where}: chat messages must be {form}, got an empty list")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: chat messages must be {form}, got {type(messages).__name__}"
                         + (" (for plain text use 'prompt')" if isinstance(messages, str) else ""))
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}, message {j}: must be an object like {{\"role\": \"user\", "
                             f"\"content\": \"...\"}}, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}, message {j}: 'role' must be one of {', '.join(CHAT_ROLES)}, "
                             f"got {role!r}" if "role" in m else f"{where}, message {j}: no 'role' field")
        if not isinstance(content, str):
            raise ValueError(f"{where}, message {j} ({role}): 'content' must be a string, got "
                             + (type(content).__name__ if "content" in m else "nothing (no 'content' field)"))


def encode_prompts(tokenizer, prompts, chat: bool, first_index: int = 0, spans: bool = False):
    """Prompts as token-id lists. A prompt is a str, a list of chat messages, or token ids.

    Errors name prompts by `first_index + position`. `spans=True` also returns, per prompt,
    the token span [start, end) of its question: the text of a plain prompt (after a BOS the
    tokenizer added), the last user message of a chat prompt (the template's tokens around it
    excluded; the whole prompt when the template's tokens do not split cleanly there)."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
    ):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    out, where = [], []
    own_bos = spans and _adds_bos(tokenizer)
    for i, p in enumerate(prompts, first_index):
        content = None
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            if chat:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
                content = p
            else:
                ids = tokenizer.encode(p)
        elif isinstance(p, list) and p and isinstance(p[0], dict):
            check_messages(p, f"prompt {i}")
            text = tokenizer.apply_chat_template(p, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            users = [m["content"] for m in p if m["role"] == "user" and m["content"]]
            content = users[-1] if users else None
        elif isinstance(p, (list, tuple, np.ndarray)) and len(p) and all(
            isinstance(t, (int, np.integer)) for t in p
        ):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is empty or not a str / chat messages / token ids")
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens")
        out.append(ids)
        if spans:
            where.append(_question_span(tokenizer, ids, own_bos, text if content is not None else None, content))
    return (out, where) if spans else out


def _adds_bos(tokenizer) -> bool:
    """The tokenizer's `encode` puts a BOS token first (SmolLM2's bos_token_id, <|im_start|>,
    is not one it adds)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer.encode("a")
    return bool(probe) and probe[0] == bos and tokenizer.encode("a", add_special_tokens=False)[:1] != [bos]


def _question_span(tokenizer, ids, own_bos: bool, text=None, content=None) -> tuple:
    """(start, end) of the question in `ids` (encode_prompts); `own_bos`: `_adds_bos`."""
    start = 1 if own_bos and len(ids) > 1 and ids[0] == tokenizer.bos_token_id else 0
    if content is None:
        return start, len(ids)
    off = text.rfind(content)
    if off < 0:
        return start, len(ids)
    pre = tokenizer.encode(text[:off], add_special_tokens=False) if off else []
    post = text[off + len(content):]
    post = tokenizer.encode(post, add_special_tokens=False) if post else []
    a, b = len(pre), len(ids) - len(post)
    if ids[:a] == list(pre) and ids[b:] == list(post) and a < b:
        return a, b
    return start, len(ids)


# ----------------------------------------------------------------------------- generate
def generate(model, tokenizer, prompts, max_new_tokens: int = 128, strategy="greedy",
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop=None, chat: bool = False, references=None, drafter=None,
             on_text: Optional[Callable[[int, str], None]] = None,
             max_cache_len: Optional[int] = None, ignore_eos: bool = False,
             first_index: int = 0, mesh=None, stop_token_ids=None, n: int = 1,
             min_new_tokens: int = 0, logprobs: bool = False, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
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
        decoding (with temperature > 0 it samples); "lookahead" drafts from an n-gram trie
        and verifies token trees, with output identical to "greedy". "ralm" / "ralmspec":
        retrieval-augmented decoding (`ralm.py`; ralmspec gives ralm's tokens, faster).
    temperature/top_k/top_p/seed: sampling; the random key of each token is a function of
        (seed, row index, absolute position), so every strategy samples the same tokens.
    stop: strings that end a row (excluded from `text`; token_ids end with the token that
        completed the stop string).
    references: drafting strategies only; per prompt a list of texts (e.g. retrieved
        passages) whose n-grams seed the trie. A single list of texts applies to every prompt.
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
    first_index: index of the first prompt (for prompt_index, error messages and the
        sampling key's row), so a long list decoded in batches samples as one batch.
    mesh: a `jax.sharding.Mesh` with axes ("data", "model") (`sharding.make_mesh`): params
        split by the rule table, batch rows and the KV cache over "data".
    """
    strat = resolve(strategy, **strategy_options)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    stop = tuple([stop] if isinstance(stop, str) else (stop or ()))
    if any(not s for s in stop):
        raise ValueError("stop strings must be non-empty")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n (samples per prompt) must be a positive integer, got {n!r}")
    if not isinstance(min_new_tokens, int) or isinstance(min_new_tokens, bool) or \
            not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be an integer in [0, max_new_tokens={max_new_tokens}], "
                         f"got {min_new_tokens!r}")
    penalties = _penalties(repetition_penalty, presence_penalty, frequency_penalty)
    if n > 1 and sampling.greedy:
        raise ValueError(f"n={n} samples per prompt need temperature > 0 (greedy gives n identical rows)")
    engine = engine_for(model, mesh)
    cfg: ModelConfig = engine.config
    compiled = engine.compiled
    hooked = hasattr(strat, "start")  # a strategy that drives its own run (retrieval) gets the questions
    ids, spans = encode_prompts(tokenizer, prompts, chat, first_index, spans=True) if hooked else \
        (encode_prompts(tokenizer, prompts, chat, first_index), None)
    if references is not None and n > 1 and not isinstance(references, str) \
            and not all(isinstance(r, str) for r in references):
        references = [r for r in references for _ in range(n)]
    ids = [x for x in ids for _ in range(n)]
    spans = spans and [x for x in spans for _ in range(n)]
    first_row = first_index * n  # sampling rows: prompt i's sample j is row (first_index + i) * n + j
    B = len(ids)
    for i, x in enumerate(ids[::n], first_index):
        if min(x) < 0 or max(x) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size})")
    if isinstance(strat, Greedy):
        drafter = None
    elif drafter is None:
        drafter = strat.drafter(engine)
    max_T = strat.max_nodes(drafter)
    # a strategy that rewrites the prompts and drives the loop itself (retrieval: ralm.py,
    # knnlm/strategy.py)
    if penalties.on and not getattr(strat, "supports_penalties", True):
        raise ValueError(f"strategy {strat.name!r} picks tokens from its own distribution and does not apply "
                         "repetition / presence / frequency penalties: leave them at their defaults")
    run = strat.start(tokenizer, ids, engine=engine, spans=spans) if hooked else None

    # ---- shapes
    lens = [len(x) + (run.extra_tokens if run is not None else 0) for x in ids]
    need = max(lens) + max_new_tokens + max_T + 1
    S = max_cache_len or max(CACHE_ROUND, 1 << (need - 1).bit_length())  # few distinct S
    if max_cache_len is None:
        S = min(S, max(cfg.max_position, need))
    if need > S or max(lens) + max_new_tokens > cfg.max_position:
        longest = int(np.argmax(lens))
        limits = []
        over_context = max(lens) + max_new_tokens > cfg.max_position
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
            f"prompt {first_index + longest // n} has {lens[longest]} tokens "
            + (f"({run.extra_note}) " if run is not None else "") + "and "
            f"max_new_tokens={max_new_tokens}: " + "; ".join(limits) + f". {fix}."
        )
    eos = () if ignore_eos else tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    for t in stop_token_ids or ():
        if not isinstance(t, (int, np.integer)) or not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop_token_ids: {t!r} is not a token id in [0, {cfg.vocab_size})")
    eos = tuple(sorted(set(eos) | {int(t) for t in stop_token_ids or ()}))

    c_before = compiled.compile_s
    t_run = time.perf_counter()
    if run is not None:
        ids = run.prompts()  # e.g. the first retrieval: passages before the prompts
    t_run = time.perf_counter() - t_run
    state = prefill(engine, ids, tokenizer, max_len=S, max_new_tokens=max_new_tokens,
                    sampling=sampling, seed=seed, first_index=first_row, eos_ids=eos,
                    stop=stop, on_text=on_text, min_new_tokens=min_new_tokens, logprobs=logprobs,
                    penalties=penalties, emit=not getattr(run, "picks_first_token", False))
    state.t_start -= t_run  # decode time (and time to the first token)
    state.prefill_s += t_run
    refs = None
    if drafter is not None:
        refs = [[tokenizer.encode(t, add_special_tokens=False) for t in r]
                for r in _norm_references(references, B)]
    # the drafter's setup and auto's calibration are not decode time (nor compile time)
    c_setup, t_setup = compiled.compile_s, time.perf_counter()
    drafter, rule, budget = strat.setup(engine, state, drafter, refs)
    dc = compiled.compile_s - c_setup
    state.compile_s += dc
    state.t_start += time.perf_counter() - t_setup - dc
    calibrate_s = getattr(budget, "calibrate_s", 0.0)
    try:
        (run.decode if run is not None else decode)(engine, state, drafter, rule, budget)
    finally:
        if drafter is not None:
            drafter.end()
    wall = state.elapsed()
    row_stats = getattr(run, "row_stats", None)
    outs = [
        RowOutput(first_index + r.index // n, r.text, r.ids, r.prompt_ids, r.finish or "length", r.steps,
                  state.finish_s.get(r.index, wall), r.index % n, r.logprobs,
                  row_stats(r.index) if row_stats is not None else None)
        for r in state.rows
    ]
    new = sum(o.new_tokens for o in outs)
    # time to the first token (prefill, compilation excluded as from wall_s), and the rate
    # after it: the tokens after each row's first over the time after the first token
    # (tokens_per_s mixes the two: a long prompt or a first run's one-off costs sink it)
    ttft = min(state.prefill_s, wall)
    later = sum(max(o.new_tokens - 1, 0) for o in outs)
    stats = dict(
        strategy=strat.name, batch=B, prompt_bucket=prompt_bucket(max(lens), S), cache_len=S,
        forward_steps=state.steps, new_tokens=new, wall_s=wall,
        tokens_per_s=new / wall if wall > 0 else 0.0, prefill_s=state.prefill_s, ttft_s=ttft,
        decode_tokens_per_s=later / (wall - ttft) if later and wall > ttft else 0.0,
        mean_accepted_tokens=float(np.mean([o.mean_accepted_tokens for o in outs])),
        host_s=state.host_s, compile_s=compiled.compile_s - c_before, calibrate_s=calibrate_s,
        compilations=len(compiled.compilations),
        mean_tree_size=float(np.mean(state.tree_sizes)) if state.tree_sizes else 0.0,
    )
    stats.update(budget.summary())
    if run is not None:
        stats.update(run.summary())
    if drafter is not None and hasattr(drafter, "summary"):
        stats.update(drafter.summary())
        if getattr(drafter, "engine", engine) is not engine:  # a draft model's own compilations
            stats["compile_s"] += stats.get("draft_compile_s", 0.0)
    return GenerateOutput(outs, stats)


def _penalties(repetition, presence, frequency) -> Penalties:
    """`sampling.Penalties` from generate's arguments, or a ValueError naming the bad one."""
    values = {}
    for name, v in (("repetition_penalty", repetition), ("presence_penalty", presence),
                    ("frequency_penalty", frequency)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name} must be a number, got {v!r}")
        values[name] = float(v)
    return Penalties(values["repetition_penalty"], values["presence_penalty"], values["frequency_penalty"])


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


def main(argv=None) -> int:
    """The CLI (`cli.main`)."""
    from .cli import main as cli_main

    return cli_main(argv)


class _CallableModule(type(sys)):
    """`lookahead_jax.generate(...)` calls the generate function even though the name is
    also this module (needed for `python -m lookahead_jax.generate`)."""

    def __call__(self, *args, **kwargs) -> GenerateOutput:
        return generate(*args, **kwargs)


if __name__ != "__main__":
    sys.modules[__name__].__class__ = _CallableModule


if __name__ == "__main__":
    from .cli import enable_compilation_cache

    enable_compilation_cache()  # the CLI's process only; main() called in-process leaves JAX alone
    sys.exit(main())
