"""Static model configuration: one frozen, hashable dataclass for every family.

It is passed to jitted functions as a static argument, so it must stay hashable
(tuples, not lists or dicts).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

FAMILIES = ("llama", "qwen2", "gemma3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`: kind is "linear" or "llama3" (others are rejected)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling type {self.kind!r} is not supported; supported: 'linear', 'llama3'"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" (Llama 2/3, SmolLM2, Mistral), "qwen2", "gemma3"
    vocab_size: int
    d_model: int  # D
    n_layers: int  # L
    n_heads: int  # N
    n_kv_heads: int  # K
    head_dim: int  # H
    d_ff: int  # F
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_position: int = 8192
    # --- Gemma-3 only -----------------------------------------------------
    # Per layer: None = full attention, else the sliding window (in positions).
    sliding_window: Optional[int] = None
    layer_types: tuple = ()  # "full" | "sliding" per layer; () = all full
    rope_local_theta: float = 10000.0  # theta of sliding layers
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this**-0.5
    embed_scale: bool = False  # multiply embeddings by sqrt(D)
    qk_norm: bool = False
    sandwich_norm: bool = False  # post-attention and post-MLP norms
    act: str = "silu"  # "silu" | "gelu_tanh"
    final_logit_softcap: Optional[float] = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {FAMILIES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError("layer_types must have one entry per layer")
        if self.act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown activation {self.act!r}")

    def layer_window(self, i: int) -> Optional[int]:
        """Sliding window of layer i, or None for full attention."""
        if self.layer_types and self.layer_types[i] == "sliding":
            return self.sliding_window
        return None

    def layer_rope_theta(self, i: int) -> float:
        return self.rope_local_theta if self.layer_window(i) is not None else self.rope_theta

    def layer_rope_scaling(self, i: int) -> Optional[RopeScaling]:
        # Gemma-3 scales only the global (full-attention) layers.
        return None if self.layer_window(i) is not None else self.rope_scaling

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["layer_types"] = tuple(d.get("layer_types") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from an HF `config.json` dict (llama, mistral, qwen2, gemma3_text)."""
        mt = hf.get("model_type")
        if mt == "gemma3":  # multimodal wrapper: the text part is nested
            hf = {**hf.get("text_config", {}), "model_type": "gemma3_text"}
            mt = "gemma3_text"
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rs = hf.get("rope_scaling") or None
        # transformers 5 folds rope_theta into rope_parameters.
        rp = hf.get("rope_parameters") or {}
        if isinstance(rp, dict) and "full_attention" in rp:  # gemma3 in transformers 5
            full, local = rp.get("full_attention", {}), rp.get("sliding_attention", {})
        else:
            full, local = rp, {}
        theta = hf.get("rope_theta", full.get("rope_theta", 10000.0))
        if rs is None and full.get("rope_type", "default") != "default":
            rs = full
        scaling = None
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in (None, "default"):
                scaling = RopeScaling(
                    kind=kind,
                    factor=float(rs.get("factor", 1.0)),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position=int(rs.get("original_max_position_embeddings", 8192)),
                )
        common = dict(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            d_ff=hf["intermediate_size"],
            rms_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=hf.get("max_position_embeddings", 8192),
        )
        if mt in ("llama", "mistral"):
            if mt == "mistral" and hf.get("sliding_window"):
                # Mistral's window only matters past it; we attend fully and say so.
                common["max_position"] = min(common["max_position"], hf["sliding_window"])
            return cls(
                family="llama",
                tie_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=bool(hf.get("attention_bias", False)),
                **common,
            )
        if mt == "qwen2":
            return cls(
                family="qwen2",
                tie_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=True,
                **common,
            )
        if mt == "gemma3_text":
            n = hf["num_hidden_layers"]
            types = hf.get("layer_types")
            if not types:
                pattern = hf.get("sliding_window_pattern", 6)
                types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(n)
                ]
            lt = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
            local_theta = hf.get("rope_local_base_freq", local.get("rope_theta", 10000.0))
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
            if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ValueError(f"unsupported gemma3 activation {act!r}")
            return cls(
                family="gemma3",
                tie_embeddings=hf.get("tie_word_embeddings", True),
                sliding_window=hf.get("sliding_window", 512),
                layer_types=lt,
                rope_local_theta=float(local_theta),
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar", head_dim),
                embed_scale=True,
                qk_norm=True,
                sandwich_norm=True,
                act="gelu_tanh",
                final_logit_softcap=hf.get("final_logit_softcapping"),
                **common,
            )
        raise ValueError(
            f"unsupported model_type {mt!r}; supported: llama, mistral, qwen2, gemma3_text"
        )
