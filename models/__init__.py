"""Flax decoder models (pure functions over a params pytree). Knows nothing of speculation."""

from .cache import KVCache, advance, commit, init_cache
from .config import ModelConfig, RopeScaling
from .transformer import forward, hidden_states, init_params, logits_from_hidden, param_shapes

__all__ = [
    "KVCache", "ModelConfig", "RopeScaling", "advance", "commit", "forward", "hidden_states",
    "init_cache", "init_params", "logits_from_hidden", "param_shapes",
]
