"""Key maps: checkpoint tensor name -> our params path, per family and source format.

Each family has one explicit table per source (HF safetensors names, GGUF names). A table
entry is a `Rule`: the destination leaf and the transformations applied, in this order:

    unpermute  llama-arch GGUF only: undo llama.cpp's RoPE row permutation of q/k
    add_one    HF Gemma only: RMSNorm weights are stored as w, our params hold 1 + w
    transpose  Linear weights: HF/GGUF rows are outputs [out,in], ours are [in,out]

Rules fill the "split" layout (models.split_param_shapes), one leaf per checkpoint tensor:

    embed [V,D]; final_norm [D]; lm_head [D,V] (untied only)
    layers[i]: attn_norm [D], q [D,N*H], k [D,K*H], v [D,K*H], o [N*H,D],
               (q_bias [N*H], k_bias [K*H], v_bias [K*H]), (q_norm [H], k_norm [H],
               post_attn_norm [D], post_mlp_norm [D]), mlp_norm [D], gate/up [D,F], down [F,D]

and `build_params` fuses each finished layer into the model's layout (models.fuse_layer:
qkv [D,K,G+2,H], qkv_bias, gate_up [D,2,F]).

`plan()` matches a checkpoint's names and shapes against a config before any data is
read, and fails loudly (ValueError naming the tensor and the fix) on a tensor that no rule
maps, a tensor the config has no place for, a missing tensor, or a mis-shaped one.
`build_params()` then loads, transforms and casts one tensor at a time (numpy until its
layer is fused and cast with `jnp.asarray(..., dtype)`), so peak host memory is the output
plus one layer and one tensor's dequantization scratch.

Axis legend: V vocab, D model dim, N query heads, K kv heads, H head dim, F mlp dim.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Callable, Mapping, Optional

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lookahead_jax.models import ModelConfig, fuse_layer, param_shapes, split_param_shapes


@dataclasses.dataclass(frozen=True)
class Rule:
    dest: str  # leaf name: top-level key, or key inside layers[i]
    transpose: bool = False  # [out,in] -> [in,out]
    add_one: bool = False  # Gemma HF norm: w -> 1 + w
    unpermute: Optional[str] = None  # "n_heads" | "n_kv_heads": llama.cpp q/k rows


@dataclasses.dataclass(frozen=True)
class KeyMap:
    source: str  # "HF" | "GGUF", for messages
    family: str
    layer_re: str  # regex with groups (layer index, suffix)
    layer_fmt: str  # "model.layers.{i}.{suffix}"
    top: Mapping[str, Rule]
    layer: Mapping[str, Rule]

    def __post_init__(self):
        dests = [r.dest for r in self.top.values()] + [r.dest for r in self.layer.values()]
        assert len(dests) == len(set(dests)), f"duplicate destinations in {self.source} map"


LINEAR = dict(transpose=True)
_HF_LAYER = r"^model\.layers\.(\d+)\.(.+)$"
_HF_FMT = "model.layers.{i}.{suffix}"
_GGUF_LAYER = r"^blk\.(\d+)\.(.+)$"
_GGUF_FMT = "blk.{i}.{suffix}"


# ----------------------------------------------------------------------------- HF
def _hf_llama_like(family: str) -> KeyMap:
    """Llama / Mistral / SmolLM2 and Qwen2 (same names; Qwen2 always has q/k/v biases)."""
    return KeyMap(
        source="HF",
        family=family,
        layer_re=_HF_LAYER,
        layer_fmt=_HF_FMT,
        top={
            "model.embed_tokens.weight": Rule("embed"),  # [V,D] as is
            "model.norm.weight": Rule("final_norm"),
            "lm_head.weight": Rule("lm_head", **LINEAR),  # [V,D] -> [D,V]
        },
        layer={
            "input_layernorm.weight": Rule("attn_norm"),
            "self_attn.q_proj.weight": Rule("q", **LINEAR),  # [N*H,D] -> [D,N*H]
            "self_attn.k_proj.weight": Rule("k", **LINEAR),  # [K*H,D] -> [D,K*H]
            "self_attn.v_proj.weight": Rule("v", **LINEAR),
            "self_attn.o_proj.weight": Rule("o", **LINEAR),  # [D,N*H] -> [N*H,D]
            "self_attn.q_proj.bias": Rule("q_bias"),
            "self_attn.k_proj.bias": Rule("k_bias"),
            "self_attn.v_proj.bias": Rule("v_bias"),
            "post_attention_layernorm.weight": Rule("mlp_norm"),  # llama: the pre-MLP norm
            "mlp.gate_proj.weight": Rule("gate", **LINEAR),  # [F,D] -> [D,F]
            "mlp.up_proj.weight": Rule("up", **LINEAR),
            "mlp.down_proj.weight": Rule("down", **LINEAR),  # [D,F] -> [F,D]
        },
    )


GEMMA_NORM = dict(add_one=True)

HF_KEYMAPS = {
    "llama": _hf_llama_like("llama"),
    "qwen2": _hf_llama_like("qwen2"),
    "gemma3": KeyMap(
        source="HF",
        family="gemma3",
        layer_re=_HF_LAYER,
        layer_fmt=_HF_FMT,
        top={
            "model.embed_tokens.weight": Rule("embed"),  # unscaled; sqrt(D) applied in forward
            "model.norm.weight": Rule("final_norm", **GEMMA_NORM),
            "lm_head.weight": Rule("lm_head", **LINEAR),
        },
        layer={
            "input_layernorm.weight": Rule("attn_norm", **GEMMA_NORM),
            "self_attn.q_proj.weight": Rule("q", **LINEAR),
            "self_attn.k_proj.weight": Rule("k", **LINEAR),
            "self_attn.v_proj.weight": Rule("v", **LINEAR),
            "self_attn.o_proj.weight": Rule("o", **LINEAR),
            "self_attn.q_norm.weight": Rule("q_norm", **GEMMA_NORM),  # [H]
            "self_attn.k_norm.weight": Rule("k_norm", **GEMMA_NORM),  # [H]
            # gemma: post_attention_layernorm is the sandwich norm after attention
            "post_attention_layernorm.weight": Rule("post_attn_norm", **GEMMA_NORM),
            "pre_feedforward_layernorm.weight": Rule("mlp_norm", **GEMMA_NORM),
            "post_feedforward_layernorm.weight": Rule("post_mlp_norm", **GEMMA_NORM),
            "mlp.gate_proj.weight": Rule("gate", **LINEAR),
            "mlp.up_proj.weight": Rule("up", **LINEAR),
            "mlp.down_proj.weight": Rule("down", **LINEAR),
        },
    ),
}


# ----------------------------------------------------------------------------- GGUF
# After `gguf.quants.dequantize` a GGUF tensor is a numpy array in HF order: the GGUF
# `shape` (ggml ne order, fastest axis first) reversed, e.g. attn_q ne=[D, N*H] -> [N*H,D].
def _gguf_llama_like(family: str, permuted: bool) -> KeyMap:
    q_perm = dict(unpermute="n_heads") if permuted else {}
    k_perm = dict(unpermute="n_kv_heads") if permuted else {}
    return KeyMap(
        source="GGUF",
        family=family,
        layer_re=_GGUF_LAYER,
        layer_fmt=_GGUF_FMT,
        top={
            "token_embd.weight": Rule("embed"),  # [V,D]
            "output_norm.weight": Rule("final_norm"),
            "output.weight": Rule("lm_head", **LINEAR),  # [V,D] -> [D,V]
        },
        layer={
            "attn_norm.weight": Rule("attn_norm"),
            "attn_q.weight": Rule("q", **LINEAR, **q_perm),
            "attn_k.weight": Rule("k", **LINEAR, **k_perm),
            "attn_v.weight": Rule("v", **LINEAR),
            "attn_output.weight": Rule("o", **LINEAR),
            "attn_q.bias": Rule("q_bias", **q_perm),  # llama.cpp permutes biases too
            "attn_k.bias": Rule("k_bias", **k_perm),
            "attn_v.bias": Rule("v_bias"),
            "ffn_norm.weight": Rule("mlp_norm"),
            "ffn_gate.weight": Rule("gate", **LINEAR),
            "ffn_up.weight": Rule("up", **LINEAR),
            "ffn_down.weight": Rule("down", **LINEAR),
        },
    )


GGUF_KEYMAPS = {
    # llama.cpp permutes q/k rows of llama-arch models for its RoPE kernel.
    "llama": _gguf_llama_like("llama", permuted=True),
    # ... but not Qwen2's (its converter does not inherit the permutation).
    "qwen2": _gguf_llama_like("qwen2", permuted=False),
    # Gemma: no permutation; llama.cpp already stored every RMSNorm weight as 1 + w.
    "gemma3": KeyMap(
        source="GGUF",
        family="gemma3",
        layer_re=_GGUF_LAYER,
        layer_fmt=_GGUF_FMT,
        top={
            "token_embd.weight": Rule("embed"),
            "output_norm.weight": Rule("final_norm"),
            "output.weight": Rule("lm_head", **LINEAR),
        },
        layer={
            "attn_norm.weight": Rule("attn_norm"),
            "attn_q.weight": Rule("q", **LINEAR),
            "attn_k.weight": Rule("k", **LINEAR),
            "attn_v.weight": Rule("v", **LINEAR),
            "attn_output.weight": Rule("o", **LINEAR),
            "attn_q_norm.weight": Rule("q_norm"),
            "attn_k_norm.weight": Rule("k_norm"),
            "post_attention_norm.weight": Rule("post_attn_norm"),
            "ffn_norm.weight": Rule("mlp_norm"),
            "post_ffw_norm.weight": Rule("post_mlp_norm"),
            "ffn_gate.weight": Rule("gate", **LINEAR),
            "ffn_up.weight": Rule("up", **LINEAR),
            "ffn_down.weight": Rule("down", **LINEAR),
        },
    ),
}


# ----------------------------------------------------------------------------- transforms
def permute_rope_rows(w: np.ndarray, n: int) -> np.ndarray:
    """HF -> llama.cpp row order of a q/k weight [n*H, ...] or bias [n*H] (as its converter).

    Within each head, rows [x0..x_{H/2-1} | y0..y_{H/2-1}] become interleaved [x0,y0,x1,y1,..].
    # n=1, H=4: rows [0,1,2,3] -> [0,2,1,3]
    """
    rows = w.shape[0]
    return w.reshape(n, 2, rows // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n: int) -> np.ndarray:
    """Inverse of `permute_rope_rows`: llama.cpp interleaved rows -> HF rotate-half rows.

    # n=1, H=4: rows [0,2,1,3] -> [0,1,2,3]
    """
    rows = w.shape[0]
    return w.reshape(n, rows // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_shape(rule: Rule, dest_shape: tuple) -> tuple:
    """The shape (numpy order) a checkpoint tensor must have to fill `dest_shape`."""
    return tuple(reversed(dest_shape)) if rule.transpose else tuple(dest_shape)


def apply_rule(rule: Rule, x: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Checkpoint tensor (numpy, any float dtype) -> our layout, float32 numpy."""
    x = np.asarray(x).astype(np.float32, copy=False)
    if rule.unpermute:
        x = unpermute_rope_rows(x, getattr(config, rule.unpermute))
    if rule.add_one:
        x = x + np.float32(1.0)
    if rule.transpose:
        x = x.T
    return x


# ----------------------------------------------------------------------------- plan / build
def expected_leaves(config: ModelConfig, split: bool = True) -> dict:
    """Flat {path: shape} of every params leaf the config needs ("layers.3.q" style), in the
    split layout the rules fill (split=True) or the model's fused one (split=False)."""
    shapes = split_param_shapes(config) if split else param_shapes(config)
    flat = {k: tuple(v) for k, v in shapes.items() if k != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        for name, s in layer.items():
            flat[f"layers.{i}.{name}"] = tuple(s)
    return flat


def _config_summary(c: ModelConfig) -> str:
    return (
        f"family={c.family} vocab_size={c.vocab_size} d_model={c.d_model} "
        f"n_layers={c.n_layers} n_heads={c.n_heads} n_kv_heads={c.n_kv_heads} "
        f"head_dim={c.head_dim} d_ff={c.d_ff} tie_embeddings={c.tie_embeddings} "
        f"qkv_bias={c.qkv_bias}"
    )


def _listing(names, limit=8, quote=True) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) if quote else n for n in names[:limit]) + more


def plan(
    shapes: Mapping[str, tuple], keymap: KeyMap, config: ModelConfig
) -> dict[str, tuple[str, Rule]]:
    """Match checkpoint names/shapes (numpy order) to the config's params, reading no data.

    Returns {our path: (checkpoint name, rule)} covering every leaf exactly once.
    Raises ValueError naming the offending tensors and the likely fix otherwise.
    """
    src, fam = keymap.source, keymap.family
    where = f"convert/keymaps.py {src}_KEYMAPS[{fam!r}]"
    expected = expected_leaves(config)
    layer_re = re.compile(keymap.layer_re)
    routes: dict[str, tuple[str, Rule]] = {}
    unmapped, unused = [], []
    for name in shapes:
        m = layer_re.match(name)
        if m:
            rule = keymap.layer.get(m.group(2))
            path = f"layers.{int(m.group(1))}.{rule.dest}" if rule else None
        else:
            rule = keymap.top.get(name)
            path = rule.dest if rule else None
        if rule is None:
            unmapped.append(name)
        elif path not in expected:
            unused.append(f"{name!r} -> params[{path!r}]")
        elif path in routes:
            raise ValueError(
                f"{src} tensors {routes[path][0]!r} and {name!r} both map to params[{path!r}]; "
                "the checkpoint holds the same weight twice under different names."
            )
        else:
            routes[path] = (name, rule)
    if unmapped:
        raise ValueError(
            f"{src} tensor(s) with no mapping for family {fam!r}: {_listing(unmapped)}. "
            f"These are not part of a plain {fam} decoder; if they belong to the model, "
            f"add a Rule for them in {where} (and support them in models/transformer.py)."
        )
    if unused:
        raise ValueError(
            f"{src} tensor(s) that the config has no place for: {_listing(unused, quote=False)}. "
            f"The config ({_config_summary(config)}) disagrees with the weights: check "
            "n_layers / qkv_bias / tie_embeddings in the config (or drop the extra tensors)."
        )
    missing = [p for p in expected if p not in routes]
    if missing:
        def source_name(path):
            parts = path.split(".")
            if parts[0] == "layers":
                suffix = next((k for k, r in keymap.layer.items() if r.dest == parts[2]), "?")
                return keymap.layer_fmt.format(i=parts[1], suffix=suffix)
            return next((k for k, r in keymap.top.items() if r.dest == path), "?")

        listed = [f"{source_name(p)!r} (for params[{p!r}])" for p in missing]
        raise ValueError(
            f"{src} checkpoint is missing tensor(s): {_listing(listed, quote=False)}. The file is "
            f"incomplete, or the config ({_config_summary(config)}) expects more than it "
            "holds (e.g. an untied head or q/k/v biases it does not have)."
        )
    for path, (name, rule) in routes.items():
        want = source_shape(rule, expected[path])
        got = tuple(int(d) for d in shapes[name])
        if got != want:
            how = " after transpose [out,in] -> [in,out]" if rule.transpose else ""
            raise ValueError(
                f"{src} tensor {name!r} has shape {got} (numpy order), but params[{path!r}] "
                f"needs {expected[path]}{how}, i.e. a source shape of {want}. "
                f"The config ({_config_summary(config)}) does not match the weights."
            )
    return routes


def build_params(
    routes: Mapping[str, tuple[str, Rule]],
    load: Callable[[str], np.ndarray],
    config: ModelConfig,
    dtype=jnp.float32,
    *,
    progress: bool = False,
    desc: str = "converting",
):
    """Load, transform and cast every routed tensor into our params pytree.

    Order: the tensors outside the layers first (the embedding and an untied lm_head: the
    largest, whose dequantization scratch is the largest, while little else is held), then
    layer by layer, each layer fused and cast (`jnp.asarray`) as soon as its last tensor is
    in, so at most one layer is held split (numpy) beside the finished params."""
    params: dict = {"layers": [dict() for _ in range(config.n_layers)]}
    expected = expected_leaves(config)
    left = collections.Counter(int(p.split(".")[1]) for p in routes if p.startswith("layers."))

    def order(item):
        path, (name, _) = item
        parts = path.split(".")
        return (1, int(parts[1]), name) if parts[0] == "layers" else (0, 0, name)

    for path, (name, rule) in tqdm(
        sorted(routes.items(), key=order), desc=desc, disable=not progress, unit="tensor",
    ):
        x = apply_rule(rule, load(name), config)
        assert x.shape == expected[path], (name, x.shape, expected[path])
        parts = path.split(".")
        if parts[0] != "layers":
            params[path] = jnp.asarray(x, dtype=dtype)
            continue
        i = int(parts[1])
        layer = params["layers"][i]
        layer[parts[2]] = x  # f32 numpy until the layer is complete
        left[i] -= 1
        if not left[i]:
            params["layers"][i] = {k: jnp.asarray(v, dtype=dtype) for k, v in fuse_layer(layer, config).items()}
            layer.clear()  # free the split copies
        del x
    return params
