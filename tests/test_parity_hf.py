"""Parity with HF transformers (PyTorch, float32) on tiny random models of every family.

For each of llama (tied), llama3 (rope_scaling llama3, untied head, head_dim != D/N),
qwen2 and gemma3 (sliding window 4 with sliding and full layers), the HF state dict is
converted with `convert.params_from_hf_state_dict` and our `models.forward` must give the
HF logits (atol 1e-4) for:

  (a) a prefill of a batch of sequences;
  (b) incremental decoding with our KV cache (a short prefill, then token by token);
  (c) a token tree after a cached prefix: every node's logits equal HF's full forward on
      prefix + root-to-node path (positions = prefix length + depth, mask = prefix slots
      + ancestors incl. self); rows of the batch have different prefix lengths;

plus, for our model alone, incremental decoding == one full forward (same argmax, close
logits), and `save_pretrained` -> `convert.load_hf_dir` (single file and sharded) gives
the same config and params as the state-dict path.

Masks are built explicitly here (boolean [B,T,S]), independent of the library's helpers.
Axis legend: B batch, T new tokens, S cache slots, V vocab.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lookahead_jax import convert, models  # noqa: E402

KINDS = ("llama", "llama3", "qwen2", "gemma3")
ATOL = 1e-4

_forward = jax.jit(models.forward, static_argnames="config")


def run(params, config, cache, tokens, positions, mask):
    """Our forward on numpy inputs -> (logits [B,T,V] numpy, cache)."""
    logits, cache = _forward(
        params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache,
        jnp.asarray(mask, bool), config=config,
    )
    return np.asarray(logits), cache


def hf_logits(hf, tokens) -> np.ndarray:
    """HF full forward, tokens [B,T] -> logits [B,T,V]."""
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def causal_mask(length, T: int, S: int) -> np.ndarray:
    """[B,T,S]: query t of row b sits at slot length[b]+t and sees slots 0..length[b]+t.

    # length=[2], T=2, S=5 -> [[1,1,1,0,0],[1,1,1,1,0]]
    """
    length = np.asarray(length)[:, None, None]
    t = np.arange(T)[None, :, None]
    s = np.arange(S)[None, None, :]
    return s <= length + t


def tree_depth_and_ancestors(parents):
    """parents [T] (-1 = root; a parent precedes its children) -> depth [T], anc [T,T].

    anc[t, j]: node j is t itself or an ancestor of t.
    # parents: [-1, 0, 0, 1] -> depth: [0, 1, 1, 2]; anc[3] = [1, 1, 0, 1]
    """
    T = len(parents)
    anc = np.zeros((T, T), bool)
    for t in range(T):
        j = t
        while j >= 0:
            anc[t, j] = True
            j = parents[j]
    return anc.sum(1) - 1, anc


def decode_incrementally(params, config, tokens, prefill: int, S: int):
    """Prefill `prefill` tokens, then one token per forward; -> logits [B,T,V]."""
    B, T = tokens.shape
    cache = models.init_cache(config, B, S)
    pos = np.broadcast_to(np.arange(prefill), (B, prefill))
    out, cache = run(params, config, cache, tokens[:, :prefill], pos,
                     causal_mask(np.zeros(B, int), prefill, S))
    cache = models.advance(cache, prefill)
    steps = [out]
    for t in range(prefill, T):
        out, cache = run(params, config, cache, tokens[:, t:t + 1], np.full((B, 1), t),
                         causal_mask(np.full(B, t), 1, S))
        cache = models.advance(cache, 1)
        steps.append(out)
    return np.concatenate(steps, axis=1)


def full_forward(params, config, tokens, S: int):
    B, T = tokens.shape
    cache = models.init_cache(config, B, S)
    pos = np.broadcast_to(np.arange(T), (B, T))
    return run(params, config, cache, tokens, pos, causal_mask(np.zeros(B, int), T, S))[0]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tiny_hf):
    """(kind, hf model, our config, our params) converted from the HF state dict."""
    hf = tiny_hf(request.param)
    config = models.ModelConfig.from_hf(hf.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = convert.params_from_hf_state_dict(sd, config)
    return request.param, hf, config, params


def test_config_from_hf(pair):
    kind, hf, config, _ = pair
    c = hf.config
    assert config.family == {"llama3": "llama"}.get(kind, kind)
    assert config.tie_embeddings == bool(c.tie_word_embeddings)
    if kind == "llama3":
        assert config.rope_scaling is not None and config.rope_scaling.kind == "llama3"
        assert config.head_dim == 24 and not config.tie_embeddings
    if kind == "gemma3":
        assert config.layer_types == ("sliding", "full", "sliding")
        assert config.sliding_window == 4 and config.query_pre_attn_scalar == 24
        assert config.rope_scaling.kind == "linear" and config.rope_local_theta == 1e4


def test_prefill_batch_matches_hf(pair):
    kind, hf, config, params = pair
    rng = np.random.default_rng(1)
    B, T, S = 3, 12, 16
    tokens = rng.integers(0, config.vocab_size, (B, T))
    cache = models.init_cache(config, B, S)
    pos = np.broadcast_to(np.arange(T), (B, T))
    ours, _ = run(params, config, cache, tokens, pos, causal_mask(np.zeros(B, int), T, S))
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0  # the comparison is not trivially small
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


def test_incremental_decoding_matches_hf(pair):
    kind, hf, config, params = pair
    rng = np.random.default_rng(2)
    B, T, S = 2, 11, 16  # T > 2 * sliding window (gemma3: 4)
    tokens = rng.integers(0, config.vocab_size, (B, T))
    ours = decode_incrementally(params, config, tokens, prefill=3, S=S)
    np.testing.assert_allclose(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_incremental_decoding_equals_full_forward(pair):
    """Our model alone: cached token-by-token logits == one full forward."""
    kind, _, config, params = pair
    rng = np.random.default_rng(3)
    B, T, S = 2, 12, 16
    tokens = rng.integers(0, config.vocab_size, (B, T))
    inc = decode_incrementally(params, config, tokens, prefill=1, S=S)
    full = full_forward(params, config, tokens, S)
    np.testing.assert_allclose(inc, full, atol=1e-5, rtol=1e-5)  # f32 rounding only
    # Same greedy token wherever the top-2 gap is not a near tie.
    top2 = np.sort(full, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 1e-4
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(inc.argmax(-1)[clear], full.argmax(-1)[clear])


PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3, 5])
# parents: [-1, 0, 0, 1, 1, 2, 3, 5] -> depth: [0, 1, 1, 2, 2, 2, 3, 3]


def test_tree_forward_matches_hf_paths(pair):
    kind, hf, config, params = pair
    rng = np.random.default_rng(4)
    B, P, S = 2, 7, 24
    T = len(PARENTS)
    lengths = np.array([5, 7])  # row 0 commits only 5 of its 7 prefilled slots
    prefix = rng.integers(0, config.vocab_size, (B, P))
    cache = models.init_cache(config, B, S)
    _, cache = run(params, config, cache, prefix, np.broadcast_to(np.arange(P), (B, P)),
                   causal_mask(np.zeros(B, int), P, S))
    cache = models.advance(cache, jnp.asarray(lengths, jnp.int32))

    depth, anc = tree_depth_and_ancestors(PARENTS)
    np.testing.assert_array_equal(depth, [0, 1, 1, 2, 2, 2, 3, 3])
    tree = rng.integers(0, config.vocab_size, (B, T))
    positions = lengths[:, None] + depth[None, :]  # [B,T]
    mask = np.zeros((B, T, S), bool)
    for b in range(B):
        mask[b, :, : lengths[b]] = True  # the committed prefix
        mask[b, :, lengths[b]: lengths[b] + T] = anc  # ancestors incl. self
    ours, _ = run(params, config, cache, tree, positions, mask)

    for b in range(B):
        for t in range(T):
            path = np.nonzero(anc[t])[0]  # root .. t (parents precede children)
            ids = np.concatenate([prefix[b, : lengths[b]], tree[b, path]])[None]
            ref = hf_logits(hf, ids)[0, -1]
            np.testing.assert_allclose(
                ours[b, t], ref, atol=ATOL, rtol=0, err_msg=f"{kind} row {b} node {t}"
            )


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_load_hf_dir_matches_state_dict(pair, tmp_path, sharded):
    kind, hf, config, params = pair
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "50GB")
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == sharded, files
    cfg2, params2 = convert.load_hf_dir(tmp_path)
    assert cfg2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
