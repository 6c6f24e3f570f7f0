"""Flax decoder models (pure functions over a params pytree). Knows nothing of speculation."""

from .cache import KVCache, advance, commit, init_cache
from .config import ModelConfig, RopeScaling
from .transformer import (
    forward, fuse_layer, hidden_states, init_params, logits_from_hidden, param_shapes,
    split_layer, split_param_shapes,
)

__all__ = [
    "KVCache", "ModelConfig", "RopeScaling", "advance", "commit", "forward", "hidden_states",
    "fuse_layer", "init_cache", "init_params", "logits_from_hidden", "param_shapes",
    "split_layer", "split_param_shapes",
]
