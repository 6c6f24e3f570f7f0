"""Decoding strategies and their registry: what a `generate` call plugs into the one loop.

A strategy is a frozen dataclass of its own options implementing `base.Strategy`; one
module each (greedy, lookahead, specinfer, ralm, ralmspec, knnlm). This file only lists them and
resolves a name + flat options to an object; it is imported by nothing below it.

    generate(model, tok, prompts, strategy=Lookahead(decoding_length=7))
    generate(model, tok, prompts, strategy="lookahead", decoding_length=7)   # same

Adding a strategy = one module with a dataclass (`base.StrategyBase`) + one entry in
`REGISTRY`. The CLI builds its flags from the dataclass fields (`--decoding-length`,
`--branch-length`, ...; `cli_names` renames one, e.g. mode -> `--lookahead-mode`).
"""

from __future__ import annotations

import dataclasses
import logging

from .base import Run, Strategy, StrategyBase
from .greedy import Greedy
from .knnlm import KNNLM
from .lookahead import Lookahead
from .ralm import RaLM
from .ralmspec import RaLMSpec
from .specinfer import SpecInfer

log = logging.getLogger("lookahead_jax")

REGISTRY: dict = {cls.name: cls for cls in (Greedy, Lookahead, SpecInfer, RaLM, RaLMSpec, KNNLM)}


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


__all__ = ["Greedy", "KNNLM", "Lookahead", "REGISTRY", "RaLM", "RaLMSpec", "Run", "SpecInfer", "Strategy",
           "StrategyBase", "resolve", "strategy_options"]
