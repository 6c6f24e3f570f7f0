"""One request's parameters, checked in one place.

`GenerationParams` is every per-request option of a generation (vLLM's `SamplingParams`
is the model): its length, stop conditions, sampling, penalties, log-probabilities and
samples per prompt, logit bias. `generate`, the CLI, the server's protocol and the scheduler each
build one from their own spelling of the options and pass it on; `core.slots.Request`
carries it whole. Every field is checked here, once, when the object is made: a bad
value raises `ParamError` (a ValueError) that names the field, so each front end can
say it in its own words (`--max-new-tokens`, `max_tokens`, ...). A new option is a
field, its check in `_CHECKS`, and its use.

`SamplingParams` and `Penalties` are the sampling and penalty parts as the decode core
uses them (hashable values: static where a step compiles one set in); their checks are
the same functions as the request's. Host only (no jax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Callable, Optional

import numpy as np

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit); every step's bias arrays hold this many
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100] (OpenAI's range)


class ParamError(ValueError):
    """A request parameter out of its range: `field` (the `GenerationParams` name) and
    `detail` (the rest of the message, e.g. "must be >= 0 (0 = greedy), got -1")."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _integer(lo: int, hi: Optional[int] = None, what: str = "") -> Callable:
    """A check: an integer in [lo, hi] (hi None: no upper bound)."""
    def check(v, _p):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        if not _is_int(v):
            return f"must be an integer {bound}{what}, got {v!r}"
        if v < lo or (hi is not None and v > hi):
            return f"must be {bound}{what}, got {v!r}"
    return check


def _number(ok: Callable[[float], bool], bound: str) -> Callable:
    """A check: a finite number for which ok(v) holds (`bound` says which)."""
    def check(v, _p):
        if not _is_number(v) or not math.isfinite(v) or not ok(float(v)):
            return f"must be {bound}, got {v!r}"
    return check


def _max_new_tokens(v, p):
    if _is_int(v) and v == 0 and p.prompt_logprobs is not None:
        return None  # a request that only scores its prompt
    if not _is_int(v) or v < 1:
        return f"must be a positive integer (0 only with prompt_logprobs), got {v!r}"


def _prompt_logprobs(v, _p):
    if v is not None and (not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
        return f"must be None (off) or an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per prompt id), got {v!r}"


def _min_new_tokens(v, p):
    if not _is_int(v) or not 0 <= v <= p.max_new_tokens:
        return f"must be an integer in [0, max_new_tokens={p.max_new_tokens}], got {v!r}"


def _stop(v, _p):
    if any(not isinstance(s, str) or not s for s in v):
        return f"strings must be non-empty, got {list(v)!r}"


def _stop_token_ids(v, _p):
    if any(not _is_int(t) or t < 0 for t in v):
        return f"must be token ids (integers >= 0), got {list(v)!r}"


def _n(v, p):
    if not _is_int(v):
        return f"(samples per prompt) must be a positive integer, got {v!r}"
    if v < 1:
        return f"must be >= 1 (samples per prompt), got {v!r}"
    if v > 1 and p.temperature == 0:
        return f"{v} samples per prompt need temperature > 0 (greedy gives {v} identical answers)"


def _flag(v, _p):
    if not isinstance(v, (bool, np.bool_)):
        return f"must be true or false, got {v!r}"


def _top_logprobs(v, p):
    if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
        return f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}"
    if v and not p.logprobs:
        return "needs logprobs (the chosen tokens' log-probabilities) on"


def _bias_pairs(v):
    """logit_bias as given -> its (id, bias) pairs as given (a mapping's items, or pairs);
    None: it is neither (the check says so)."""
    if v is None:
        return ()
    if isinstance(v, Mapping):
        return tuple(v.items())
    if isinstance(v, (str, bytes)):
        return None
    try:
        pairs = tuple(tuple(x) for x in v)
    except TypeError:
        return None
    return pairs if all(len(x) == 2 for x in pairs) else None


def _bias_id(k):
    """A logit_bias key as a token id: an integer >= 0, or its decimal string (OpenAI's
    JSON keys, e.g. "50256"); None otherwise."""
    if _is_int(k):
        return int(k) if k >= 0 else None
    if isinstance(k, str) and k.strip().isdigit() and k.strip().isascii():
        return int(k)
    return None


def _logit_bias(v, _p):
    pairs = _bias_pairs(v)
    if pairs is None:
        return f"must map token ids to biases ({{id: bias}}, or (id, bias) pairs), got {v!r}"
    if len(pairs) > MAX_LOGIT_BIAS:
        return f"may bias at most {MAX_LOGIT_BIAS} token ids (OpenAI's limit), got {len(pairs)}"
    bad = [k for k, _ in pairs if _bias_id(k) is None]
    if bad:
        return f"keys must be token ids (integers >= 0, or their decimal strings), got {bad[:5]!r}"
    ids = [_bias_id(k) for k, _ in pairs]
    if len(set(ids)) < len(ids):
        return f"biases a token id twice: {sorted({t for t in ids if ids.count(t) > 1})[:5]}"
    r = LOGIT_BIAS_RANGE
    out = {k: b for k, b in pairs if not _is_number(b) or not math.isfinite(b) or not -r <= b <= r}
    if out:
        return f"values must be numbers in [-{r:g}, {r:g}], got {dict(list(out.items())[:5])!r}"


# field -> check(value, params) -> None or what is wrong; in the order they are checked
_CHECKS = {
    "max_new_tokens": _max_new_tokens,
    "min_new_tokens": _min_new_tokens,
    "temperature": _number(lambda t: t >= 0, ">= 0 (0 = greedy)"),
    "top_k": _integer(0, what=" (0 = off)"),
    "top_p": _number(lambda p: 0 < p <= 1, "in (0, 1] (1 = off)"),
    "seed": _integer(0, 2 ** 32 - 1),
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": _flag,
    "n": _n,
    "logprobs": _flag,
    "top_logprobs": _top_logprobs,
    "prompt_logprobs": _prompt_logprobs,
    "repetition_penalty": _number(lambda r: r > 0, "a number > 0 (1 = off)"),
    "presence_penalty": _number(lambda x: -2 <= x <= 2, "a number in [-2, 2] (0 = off)"),
    "frequency_penalty": _number(lambda x: -2 <= x <= 2, "a number in [-2, 2] (0 = off)"),
    "logit_bias": _logit_bias,
}


def check_field(name: str, value, params=None) -> None:
    """Raise `ParamError` if `value` is not a valid `name` (the checks of `_CHECKS`)."""
    wrong = _CHECKS[name](value, params)
    if wrong:
        raise ParamError(name, wrong)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling configuration (hashable: a static jit argument).

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p"):
            check_field(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Penalties:
    """Static repetition / presence / frequency penalties (hashable: a static jit argument).

    repetition (HF `repetition_penalty`, > 0; 1 = off): every id that occurs in the context
    (prompt + generated) has its logit divided by it where positive, multiplied where not.
    presence / frequency (vLLM / OpenAI, in [-2, 2]; 0 = off): over the *generated* ids
    only, logit -= presence * (count > 0) + frequency * count. Applied in that order, to
    the raw logits (before temperature, top-k/p and the min_new_tokens ban)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self):
        for name in ("repetition", "presence", "frequency"):
            check_field(f"{name}_penalty", getattr(self, name))

    @property
    def on(self) -> bool:
        return self.uses_context or self.uses_counts

    @property
    def uses_context(self) -> bool:
        """Needs `seen` (the ids of the context)."""
        return self.repetition != 1.0

    @property
    def uses_counts(self) -> bool:
        """Needs `counts` (how often each id was generated)."""
        return self.presence != 0.0 or self.frequency != 0.0


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """Every per-request option of a generation, checked when made (module docstring).

    max_new_tokens: tokens to generate at most (>= 1). min_new_tokens: EOS and
        stop_token_ids cannot end a row before it has this many tokens (their probability
        is 0 there, in plain decoding and in every verify step); stop strings still apply.
    temperature / top_k / top_p: sampling (temperature 0: greedy; top_k 0 and top_p 1:
        off). seed: the sampling key's seed; a token's key is (seed, row, position), so
        every strategy samples the same tokens.
    stop: strings that end a row (one string or several). stop_token_ids: ids that end a
        row as EOS does (kept in its tokens). ignore_eos: the model's EOS ids do not end it.
    n: samples per prompt (temperature > 0): each prompt becomes n rows.
    logprobs: each generated token's log-probability (log_softmax of the raw logits).
        top_logprobs: that many most likely alternatives per token too (needs logprobs).
    prompt_logprobs: None (off) or k: each prompt id's log-probability given the ids
        before it, from the prefill (as a plain forward's log_softmax), and the k most
        likely ids at each prompt position; with it max_new_tokens may be 0 (score only).
    repetition_penalty (> 0, 1 = off), presence_penalty / frequency_penalty ([-2, 2],
        0 = off): as `Penalties`.
    logit_bias: {token id: bias} (or (id, bias) pairs; ids may be decimal strings, as
        OpenAI's JSON keys), at most MAX_LOGIT_BIAS ids, biases in [-100, 100]: added to
        the raw logits at every position, before the penalties, temperature, top-k/p and
        the min_new_tokens ban (OpenAI / vLLM), so greedy picks and sampling follow the
        biased distribution (logprobs stay the raw logits'). Kept as (id, bias) pairs
        sorted by id, both numbers; () = none.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()

    def __post_init__(self):
        # sequences as tuples (hashable, and one string is one stop string)
        set_ = object.__setattr__
        set_(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        set_(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        pairs = _bias_pairs(self.logit_bias)
        if pairs is not None:
            set_(self, "logit_bias", pairs)
        for name in _CHECKS:
            check_field(name, getattr(self, name), self)
        set_(self, "logit_bias", tuple(sorted((_bias_id(k), float(b)) for k, b in self.logit_bias)))
        set_(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "seed", "n", "top_logprobs"):
            set_(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            set_(self, name, float(getattr(self, name)))
        if self.prompt_logprobs is not None:
            set_(self, "prompt_logprobs", int(self.prompt_logprobs))
        set_(self, "ignore_eos", bool(self.ignore_eos))
        set_(self, "logprobs", bool(self.logprobs))

    @classmethod
    def of(cls, sampling: Optional[SamplingParams] = None, penalties: Optional[Penalties] = None,
           **fields) -> "GenerationParams":
        """One made of a `SamplingParams` and a `Penalties` (None: their defaults) and
        the other fields."""
        sampling, penalties = sampling or SamplingParams(), penalties or Penalties()
        return cls(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                   repetition_penalty=penalties.repetition, presence_penalty=penalties.presence,
                   frequency_penalty=penalties.frequency, **fields)

    def replace(self, **changes) -> "GenerationParams":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias: what a strategy that picks tokens from its own
        distribution (`supports_penalties` False) does not apply."""
        return self.penalties.on or bool(self.logit_bias)

    def eos_ids(self, model_eos) -> tuple:
        """The ids that end a row: the model's EOS ids (none with ignore_eos) and
        stop_token_ids."""
        return tuple(sorted(set(() if self.ignore_eos else (int(t) for t in model_eos)) | set(self.stop_token_ids)))

    def check_vocab(self, vocab: int) -> None:
        """stop_token_ids and logit_bias's keys must be ids of a vocabulary of `vocab` tokens."""
        bad = [t for t in self.stop_token_ids if t >= vocab]
        if bad:
            raise ParamError("stop_token_ids", f"must be token ids in [0, {vocab}), got {bad}")
        bad = [t for t, _ in self.logit_bias if t >= vocab]
        if bad:
            raise ParamError("logit_bias", f"keys must be token ids in [0, {vocab}), got {bad[:5]}")


def parse_logit_bias(items) -> tuple:
    """The CLI's `ID=BIAS` strings -> (id, bias) pairs for `GenerationParams.logit_bias`
    (which checks them); a string that is not ID=BIAS is a `ParamError`."""
    pairs = []
    for s in items:
        k, eq, b = str(s).partition("=")
        try:
            pairs.append((k.strip(), float(b if eq else "")))
        except ValueError:
            raise ParamError("logit_bias", f"takes ID=BIAS (a token id, a number in [-100, 100]), got {s!r}") from None
    return tuple(pairs)
