"""Decoding strategies: what a `generate` call plugs into the decode loop.

A strategy is a frozen dataclass of its own options. `setup(engine, state, ...)` returns
the components of the loop for one call: (drafter, acceptance rule, budget policy). The
loop, the verify step and the output handling are the same for every strategy.

    generate(model, tok, prompts, strategy=Lookahead(decoding_length=7))
    generate(model, tok, prompts, strategy="lookahead", decoding_length=7)   # same

Adding a strategy = one dataclass with `setup` + one `register` line. The CLI builds
its flags from the dataclass fields (`--decoding-length`, `--branch-length`, ...;
`cli_names` renames one, e.g. mode -> `--lookahead-mode`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from . import tree as tree_lib
from .acceptance import TokenMatch
from .budget import AutoBudget, FixedBudget, StepTimes

log = logging.getLogger("lookahead_jax")
REGISTRY: dict = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


@register
@dataclasses.dataclass(frozen=True)
class Greedy:
    """Plain decoding, one token per forward (greedy, or sampling with temperature > 0)."""

    name = "greedy"
    help = "plain decoding"
    cli_names = {}

    def validate(self) -> None:
        pass

    def max_nodes(self, drafter=None) -> int:
        return 0

    def setup(self, engine, state, drafter=None, references=None):
        return None, TokenMatch(state.sampling), FixedBudget(0)


@register
@dataclasses.dataclass(frozen=True)
class Lookahead:
    """n-gram trie drafts (prompt, references, past outputs) verified as one token tree
    per step; output identical to Greedy.

    decoding_length: draft nodes per step (0..128), or "auto": the budget that maximises
        expected tokens/s from measured verify costs among tree sizes T = 0, 1, 3, 7, 15,
        31, 63 (verify blocks of 1+T = 2^k tokens). Tuned on CPU; on a GPU a fixed 15 is
        faster for now.
    branch_length: maximum draft depth.  mode: hierarchical | parallel | single."""

    decoding_length: object = "auto"
    branch_length: int = 12
    mode: str = "hierarchical"

    name = "lookahead"
    help = "n-gram trie drafts verified as a token tree (same tokens as greedy)"
    cli_names = {"mode": "lookahead-mode"}
    choices = {"mode": ("hierarchical", "parallel", "single")}

    @property
    def auto(self) -> bool:
        return self.decoding_length == "auto"

    def validate(self) -> None:
        dl = self.decoding_length
        if not self.auto and (not isinstance(dl, int) or isinstance(dl, bool)
                              or not 0 <= dl <= tree_lib.MAX_NODES):
            raise ValueError(f"decoding_length must be 'auto' or an integer in [0, {tree_lib.MAX_NODES}], got {dl!r}")

    def drafter(self, engine):
        from .drafters.trie import TrieDrafter  # greedy needs no trie

        return TrieDrafter.shared(engine, branch_length=self.branch_length, mode=self.mode)

    def max_nodes(self, drafter) -> int:
        return drafter.max_nodes if self.auto else self.decoding_length

    def setup(self, engine, state, drafter, references=None):
        rule = TokenMatch(state.sampling)
        drafter.begin(state, references)
        if not self.auto:
            return drafter, rule, FixedBudget(self.decoding_length)
        # auto: calibrate every bucket once per shape, at a typical length of this run
        buckets = tuple(b for b in tree_lib.BUCKETS if b <= drafter.max_nodes)
        B, S = state.batch, state.max_len
        mid = int(state.lengths.max()) + state.rows[0].max_new // 2
        t0 = time.perf_counter()
        costs = engine.measure_verify_costs(rule, B, S, buckets, mid)
        times = engine.step_times.setdefault((rule, B, S), StepTimes())
        policy = AutoBudget(buckets, costs, getattr(drafter, "acceptance", None), times=times)
        policy.calibrate_s = time.perf_counter() - t0
        return drafter, rule, policy


def resolve(strategy, **options):
    """A strategy object from a name or an object; `options` are the strategy's fields
    given flat (`decoding_length=7`). Options of another strategy are ignored (with a
    warning unless left at their defaults); unknown options are an error."""
    if isinstance(strategy, str):
        if strategy not in REGISTRY:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {tuple(REGISTRY)}")
        cls = REGISTRY[strategy]
        fields = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in options.items() if k in fields}
        obj = cls(**mine)
    else:
        if type(strategy) not in REGISTRY.values():
            raise ValueError(f"strategy must be a name in {tuple(REGISTRY)} or one of their "
                             f"objects, got {strategy!r}")
        obj, fields = strategy, set()
    known = {f.name: f.default for c in REGISTRY.values() for f in dataclasses.fields(c)}
    for k, v in options.items():
        if k not in known:
            raise TypeError(f"generate() got an unexpected keyword argument {k!r}")
        if k not in fields and v != known[k]:
            log.warning("%s=%r is not an option of strategy %r: ignored", k, v, obj.name)
    obj.validate()
    return obj


def strategy_options() -> dict:
    """{field name: default} over every registered strategy (the flat keyword forms)."""
    return {f.name: f.default for c in REGISTRY.values() for f in dataclasses.fields(c)}


__all__ = ["Greedy", "Lookahead", "REGISTRY", "register", "resolve", "strategy_options"]

