"""Sharding: partition rules (in process) and sharded == single-device runs on 8 CPU devices.

The main pytest process has initialised JAX with one device, so every multi-device check
runs in a child `python -c` with XLA_FLAGS=--xla_force_host_platform_device_count=8 and a
(data=2, model=4) mesh: one child per tiny config (llama, gemma3), both started at once.
A child runs `_child_main` (the `_child_*` functions below) and prints one `RESULT {json}`
line that the tests assert on, so a failure shows the numbers.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from lookahead_jax.core import sharding as sh
from lookahead_jax.models import KVCache, init_params
from tiny import tiny_config

TESTS = pathlib.Path(__file__).resolve().parent
N_DEVICES = 8

# Tiny configs for the mesh runs. vocab 260 = 4 * 65 so the vocab splits over model=4
# (ByteTokenizer needs >= 259). llama: N=8, K=4, F=128 all divide 4 -> every rule splits.
# gemma3: K=2 does not -> qkv and the cache's kv heads fall back to replication; tied
# embeddings, so the vocab-split embed is also the LM head.
CONFIGS = {
    "llama": dict(vocab_size=260, n_heads=8, n_kv_heads=4, head_dim=8),
    "gemma3": dict(vocab_size=260, tie_embeddings=True, final_logit_softcap=30.0),
    "qwen2": dict(vocab_size=260),  # q/k/v biases; K=2 kv heads
}
FAMILIES = tuple(CONFIGS)


def kv_heads_split(family) -> bool:
    """Whether the family's tiny config has kv heads that divide model=4 (then K is split
    over "model" in the weights and the cache; otherwise replicated over it)."""
    return tiny_config(family, **CONFIGS[family]).n_kv_heads % 4 == 0


def abstract_mesh(data, model):
    return AbstractMesh((data, model), sh.AXES, axis_types=(AxisType.Auto,) * 2)


def leaves_with_paths(tree):
    return {sh.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, P))}


# ----------------------------------------------------------------------------- rule table
@pytest.mark.parametrize("family,kw", [
    ("llama", {}), ("llama", dict(tie_embeddings=True)), ("qwen2", {}), ("gemma3", {}),
])
def test_every_leaf_gets_a_rank_matching_spec(family, kw):
    cfg = tiny_config(family, **kw)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    specs = sh.param_specs(cfg, abstract_mesh(2, 4))
    p_leaves, s_leaves = leaves_with_paths(params), leaves_with_paths(specs)
    assert p_leaves.keys() == s_leaves.keys()
    for path, leaf in p_leaves.items():
        spec = s_leaves[path]
        assert isinstance(spec, P), path
        assert len(spec) == leaf.ndim, (path, spec, leaf.shape)
        assert all(a in (None, sh.MODEL) for a in spec), (path, spec)  # params: no "data"
    shardings = sh.param_shardings(cfg, abstract_mesh(2, 4))
    assert jax.tree.structure(shardings) == jax.tree.structure(params)


def test_specs_split_heads_mlp_and_vocab_when_they_divide():
    cfg = tiny_config("qwen2", vocab_size=260, n_heads=8, n_kv_heads=4, head_dim=8)
    s = sh.param_specs(cfg, abstract_mesh(2, 4))
    layer = s["layers"][1]
    assert s["embed"] == P("model", None) and s["lm_head"] == P(None, "model")
    assert s["final_norm"] == P(None)
    assert layer["qkv"] == P(None, "model", None, None)  # [D,K,G+2,H]: whole GQA groups
    assert layer["qkv_bias"] == P("model", None, None)
    assert layer["gate_up"] == P(None, None, "model")  # [D,2,F]
    for name in ("o", "down"):
        assert layer[name] == P("model", None), name
    for name in ("attn_norm", "mlp_norm"):
        assert layer[name] == P(None), name


def test_gemma_norms_replicated():
    s = sh.param_specs(tiny_config("gemma3"), abstract_mesh(1, 2))["layers"][0]
    for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "attn_norm", "mlp_norm"):
        assert s[name] == P(None), name


def test_fallback_to_replication_when_not_divisible(caplog):
    # N=6 (o), K=3 (qkv, qkv_bias and the cache), F=96, V=259 on model=4: every split but
    # the MLP's falls back; D=48 and everything else as usual.
    cfg = tiny_config("qwen2", d_model=48, n_heads=6, n_kv_heads=3, head_dim=8, d_ff=96)
    with caplog.at_level(logging.WARNING, logger="lookahead_jax"):
        s = sh.param_specs(cfg, abstract_mesh(1, 4))
    mlp = {"gate_up": P(None, None, "model"), "down": P("model", None)}
    for path, spec in leaves_with_paths(s).items():
        name = path.split(".")[-1]
        assert spec == mlp.get(name, P(*[None] * len(spec))), (path, spec)
    text = caplog.text
    for unit in ("n_heads=6", "n_kv_heads=3", "vocab_size=259"):
        assert unit in text, unit
    assert "n_kv_heads=3; replicating layers.*.qkv, layers.*.qkv_bias" in text
    assert "n_heads=6; replicating layers.*.o" in text
    assert "embed, lm_head" in text
    assert "d_ff" not in text  # 96 divides by 4: gate_up/down still split


def test_fallback_is_per_tensor():
    # model=8: N=8 divides (o split), K=2 does not (qkv replicated), F=128 divides.
    cfg = tiny_config("llama", n_heads=8, n_kv_heads=2, head_dim=8)
    s = sh.param_specs(cfg, abstract_mesh(1, 8))["layers"][0]
    assert s["o"] == P("model", None)
    assert s["qkv"] == P(None, None, None, None)
    assert s["gate_up"] == P(None, None, "model") and s["down"] == P("model", None)
    # split whole heads only: N*H = 64 divides 16 but N = 8 does not -> replicated
    s16 = sh.param_specs(cfg, abstract_mesh(1, 16))["layers"][0]
    assert s16["o"] == P(None, None) and s16["gate_up"] == P(None, None, "model")


def test_d_ff_fallback():
    cfg = tiny_config("llama", d_ff=90)  # 90 % 4 = 2
    s = sh.param_specs(cfg, abstract_mesh(1, 4))["layers"][0]
    assert s["gate_up"] == P(None, None, None) and s["down"] == P(None, None)
    assert s["o"] == P("model", None)  # N=4 divides: attention still split


def test_cache_specs():
    cfg = tiny_config("llama", n_kv_heads=4)
    c = sh.cache_specs(cfg, abstract_mesh(2, 4))
    assert isinstance(c, KVCache) and len(c.k) == len(c.v) == cfg.n_layers
    assert c.k[0] == c.v[1] == P("data", "model", None, None)
    assert c.length == P("data")
    gqa = sh.cache_specs(tiny_config("llama", n_kv_heads=2), abstract_mesh(2, 4), batch=3)
    assert gqa.k[0] == P(None, None, None, None) and gqa.length == P(None)


def test_unknown_param_path_is_an_error():
    with pytest.raises(ValueError, match="layers.0.w_extra"):
        sh.rule_for("layers.0.w_extra")
    with pytest.raises(ValueError, match="mesh axes"):
        sh.param_specs(tiny_config("llama"),
                       AbstractMesh((8,), ("x",), axis_types=(AxisType.Auto,)))


def test_rules_match_transformer_shapes():
    # each rule's legend dims give the leaf's shape for every family
    for family in ("llama", "qwen2", "gemma3"):
        cfg = tiny_config(family)
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
        for path, leaf in leaves_with_paths(params).items():
            dims, spec = sh.rule_for(path)
            assert len(dims) == leaf.ndim == len(spec), path


def test_one_device_mesh_and_shape_checks():
    mesh = sh.make_mesh()  # the main process has one device
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    cfg = tiny_config("llama")
    params = init_params(cfg, jax.random.PRNGKey(0))
    ps = sh.shard_params(params, cfg, mesh)
    assert ps["layers"][0]["qkv"].sharding.spec == P(None, "model", None, None)
    bad = dict(params, embed=params["embed"].T)
    with pytest.raises(ValueError, match="embed"):
        sh.shard_params(bad, cfg, mesh)
    with pytest.raises(ValueError, match="needs 8 devices"):
        sh.make_mesh(2, 4)
    cache = sh.init_sharded_cache(cfg, 2, 16, jnp.bfloat16, mesh)
    assert cache.k[1].shape == (2, cfg.n_kv_heads, 16, cfg.head_dim) and cache.k[1].dtype == jnp.bfloat16
    assert cache.k[1].sharding.spec == P("data", "model", None, None)
    assert cache.length.sharding.spec == P("data") and int(cache.length.sum()) == 0
    abstract = sh.abstract_params(cfg, mesh, jnp.bfloat16)
    assert abstract["layers"][1]["down"].sharding.spec == P("model", None)
    assert abstract["layers"][1]["down"].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- 8 devices
def _start_child(family: str, *args) -> subprocess.Popen:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_sharding; "
            f"test_sharding._child_main(*{(family, *args)!r})")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory, request):
    """family -> the child's results. The children of the families the selected tests use
    start at once (they overlap on 2 cores) and are waited for on first use."""
    wanted = set()
    for item in request.session.items:
        if item.module is request.module:
            spec = getattr(item, "callspec", None)
            wanted.add(spec.params["family"] if spec and "family" in spec.params else "gemma3")  # checkpoint test
    procs = {f: _start_child(f, *((str(tmp_path_factory.mktemp("ckpt") / "ckpt"),) if f == "gemma3" else ()))
             for f in ("llama", "gemma3", "qwen2") if f in wanted}
    done = {}

    def get(family):
        if family not in done:
            try:
                out, err = procs[family].communicate(timeout=600)
            except subprocess.TimeoutExpired:
                procs[family].kill()
                out, err = procs[family].communicate()
            rc = procs[family].returncode
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            done[family] = (json.loads(lines[0][len("RESULT "):]) if rc == 0 and len(lines) == 1
                            else f"child {family} failed (rc={rc}):\n{err[-4000:]}\n{out[-1000:]}")
        if isinstance(done[family], str):
            pytest.fail(done[family])
        return done[family]

    yield get
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _spec(x) -> str:
    """Spec of an array's NamedSharding padded to its rank (jit drops trailing Nones)."""
    spec = tuple(x.sharding.spec)
    return str(P(*spec, *[None] * (x.ndim - len(spec))))


def _child_setup(family):
    from lookahead_jax.core.compile import enable_compilation_cache
    from tiny import tiny_model

    enable_compilation_cache("xla-tests")  # as conftest does for the test processes

    assert jax.device_count() == N_DEVICES, jax.devices()
    model = tiny_model(family, seed=1, **CONFIGS[family])
    mesh = sh.make_mesh(data=2, model=4)
    return model, mesh


def _shard_facts(ps, mesh) -> dict:
    o = ps["layers"][0]["o"]
    return dict(
        o_spec=_spec(o), o_shard=list(o.addressable_shards[0].data.shape),
        qkv_spec=_spec(ps["layers"][0]["qkv"]),
        embed_shard=list(ps["embed"].addressable_shards[0].data.shape),
        all_on_mesh=all(x.sharding.mesh == mesh for x in jax.tree.leaves(ps)),
    )


def _child_forward(model, mesh) -> dict:
    """Cached forward (prefill, then a 3-token step) under jit: sharded vs one device."""
    import functools

    from lookahead_jax.models import advance, forward, init_cache

    cfg = model.config
    B, P0, T, S = 4, 20, 3, 32  # 20 + 3 tokens > gemma3's window of 16: sliding layers bite
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, P0 + T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P0 + T, dtype=jnp.int32), (B, P0 + T))
    causal = jnp.arange(S)[None, None, :] <= jnp.arange(P0 + T)[None, :, None]  # [1,P0+T,S]
    mask = jnp.broadcast_to(causal, (B, P0 + T, S))
    fwd = jax.jit(functools.partial(forward, config=cfg))

    def run(params, cache, put):
        l1, cache = fwd(params, put(tokens[:, :P0]), put(pos[:, :P0]), cache, put(mask[:, :P0]))
        cache = advance(cache, P0)
        l2, cache = fwd(params, put(tokens[:, P0:]), put(pos[:, P0:]), cache, put(mask[:, P0:]))
        return l1, l2, cache

    r1, r2, rc = run(model.params, init_cache(cfg, B, S), lambda x: x)
    ps = sh.shard_params(model.params, cfg, mesh)
    s1, s2, sc = run(ps, sh.shard_cache(init_cache(cfg, B, S), mesh),
                     lambda x: sh.shard_batch(x, mesh))
    diff = lambda a, b: float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))  # noqa: E731
    return dict(
        logits_diff=max(diff(r1, s1), diff(r2, s2)),
        cache_diff=max(diff(a, b) for a, b in zip(rc.k + rc.v, sc.k + sc.v)),
        logits_scale=float(jnp.max(jnp.abs(r2))),
        logits_devices=len(s2.sharding.device_set),
        logits_spec=_spec(s2),
        cache_spec=_spec(sc.k[0]),
        cache_shard=list(sc.k[0].addressable_shards[0].data.shape),
        **_shard_facts(ps, mesh),
    )


def _child_generate(model, mesh) -> dict:
    """generate() greedy and lookahead with sharded params == one device; then the jitted
    prefill + tree-verify steps with the batch and cache also split over "data"."""
    import types

    from lookahead_jax.core.tree import verify_block
    from lookahead_jax.generate import generate
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.core.inputs import StepInputs, StepMode
    from lookahead_jax.core.verify import jitted_extend
    from lookahead_jax.models import init_cache
    from lookahead_jax.core.sampling import SamplingParams
    from lookahead_jax.drafters.trie import TrieDrafter
    from lookahead_jax.drafters.ngram_trie import Draft, NgramTrie
    from lookahead_jax.core.verify import jitted_verify_step
    from tiny import ByteTokenizer

    cfg, tok = model.config, ByteTokenizer()
    ps = sh.shard_params(model.params, cfg, mesh)
    sharded = types.SimpleNamespace(config=cfg, params=ps, name="sharded", dtype=np.float32)
    prompts = ["def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib", "abc abc abc abc"]
    kw = dict(max_new_tokens=20, max_cache_len=128, ignore_eos=True)
    look = dict(strategy="lookahead", decoding_length=8)
    out = {(n, "greedy"): generate(m, tok, prompts, **kw)
           for n, m in (("single", model), ("sharded", sharded))}

    def warm_drafter():  # a trie that has seen the outputs: drafts accept, partially
        trie = NgramTrie(branch_length=12)
        for ids in out["single", "greedy"].token_ids:
            trie.insert_output(ids)
        return TrieDrafter(branch_length=12, trie=trie)

    for name, m in (("single", model), ("sharded", sharded)):
        out[name, "lookahead"] = generate(m, tok, prompts, **kw, **look, drafter=warm_drafter())
    # what the compiled verify step was given: params as sharded, and the cache?
    exe = engine_for(sharded).compiled.executables("verify")[0]
    in_params, in_cache = exe.input_shardings[0][:2]

    # the decode steps with B split over "data" too: prefill, then a tree whose chain holds
    # the greedy continuation (3 drafts + a wrong sibling) -> 4 tokens emitted per row
    greedy = out["single", "greedy"].token_ids
    sp = SamplingParams()
    B, P0, S = len(prompts), 64, 128
    ids = [tok.encode(p) for p in prompts]
    tokens = np.zeros((B, P0), np.int32)
    for b, x in enumerate(ids):
        tokens[b, :len(x)] = x
    lens = np.array([len(x) for x in ids], np.int32)
    seeds, rows = np.zeros(B, np.uint32), np.arange(B, dtype=np.int32)
    wrong = lambda t: 3 + (t - 3 + 1) % 256  # noqa: E731  another byte token
    drafts = [Draft([g[1], g[2], wrong(g[2]), g[3]], [-1, 0, 0, 1]) for g in greedy]

    def steps(params, cache, put):
        first, cache = jitted_extend(cfg)(params, cache, StepInputs(put(tokens), put(seeds), put(rows), n_new=put(lens)),
                                          mode=StepMode(window=tokens.shape[1]))
        blk = verify_block(np.asarray(first.tokens), drafts, 4)
        x = StepInputs.tree(blk, np.ones(B, bool), seeds, rows)
        out, cache = jitted_verify_step(cfg, sp)(params, cache, jax.tree.map(put, x), mode=StepMode())
        return first.tokens, out.tokens, out.n, cache

    r = steps(model.params, init_cache(cfg, B, S), lambda x: x)
    s = steps(ps, sh.init_sharded_cache(cfg, B, S, np.float32, mesh), lambda x: sh.shard_batch(x, mesh))
    cache_diff = max(  # committed slots only (the rest is scratch)
        float(np.max(np.abs(np.asarray(a)[b, :, :n] - np.asarray(c)[b, :, :n])))
        for a, c in zip(r[3].k + r[3].v, s[3].k + s[3].v)
        for b, n in enumerate(np.asarray(r[3].length).tolist()))
    return dict(
        tokens={f"{n}/{st}": o.token_ids for (n, st), o in out.items()},
        steps={f"{n}/{st}": o.stats["forward_steps"] for (n, st), o in out.items()},
        verify_params_specs_as_sharded=all(
            a.spec == b.sharding.spec for a, b in zip(jax.tree.leaves(in_params), jax.tree.leaves(ps))),
        verify_cache_spec=str(in_cache.k[0].spec),
        step_first=[np.asarray(r[0]).tolist(), np.asarray(s[0]).tolist()],
        step_emitted=[np.asarray(r[1]).tolist(), np.asarray(s[1]).tolist()],
        step_n=[np.asarray(r[2]).tolist(), np.asarray(s[2]).tolist()],
        step_length=[np.asarray(r[3].length).tolist(), np.asarray(s[3].length).tolist()],
        step_cache_diff=cache_diff,
        step_cache_spec=_spec(s[3].k[0]),
        step_emitted_devices=len(s[1].sharding.device_set),
        greedy=greedy,
        mesh_generate=_child_mesh_generate(model, tok),
    )


def _strip(spec: tuple) -> tuple:
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def _child_mesh_generate(model, tok) -> dict:
    """generate(..., mesh=...): params by the rules, batch rows and the cache over "data",
    inside generate; batch 8 with prompts of different lengths, greedy and lookahead, on
    (data=2, model=4) and (data=8), against one device."""
    from lookahead_jax.generate import generate
    from lookahead_jax.drafters.trie import TrieDrafter
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.strategies import Greedy

    base = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib abc abc abc abc"
    prompts = [base[: 12 + 7 * i] for i in range(8)]
    kw = dict(max_new_tokens=12, ignore_eos=True)
    greedy = generate(model, tok, prompts, **kw)
    # each row's own greedy text as its reference: the drafts are right, so lookahead must
    # take fewer steps than tokens on every mesh (a check that drafts reach the mesh path)
    look = dict(strategy="lookahead", decoding_length=8,
                references=[[p + t] for p, t in zip(prompts, greedy.texts)])
    out = {"single/greedy": greedy.token_ids,
           "single/lookahead": generate(model, tok, prompts, **kw, **look,
                                          drafter=TrieDrafter(branch_length=12)).token_ids}
    facts = {}
    for shape in ((2, 4), (8, 1)):
        mesh = sh.make_mesh(data=shape[0], model=shape[1])
        name = f"data={shape[0]},model={shape[1]}"
        out[name + "/greedy"] = generate(model, tok, prompts, **kw, mesh=mesh).token_ids
        out[name + "/greedy-device-steps"] = generate(model, tok, prompts, **kw, mesh=mesh,
                                                      strategy=Greedy(device_steps=5)).token_ids
        la = generate(model, tok, prompts, **kw, **look, mesh=mesh, drafter=TrieDrafter(branch_length=12))
        out[name + "/lookahead"] = la.token_ids
        exe = engine_for(model, mesh).compiled.executables("verify")[-1]
        # axes of size 1 split nothing: written as None, so specs compare by what they split
        spec = lambda x: str(P(*_strip(tuple(None if a is not None and mesh.shape[a] == 1 else a  # noqa: E731
                                             for a in x.spec))))
        facts[name] = dict(cache_in=spec(exe.input_shardings[0][1].k[0]),
                           cache_out=spec(exe.output_shardings[-1].k[0]),
                           lookahead_steps=la.stats["forward_steps"])
    return dict(tokens=out, facts=facts)


def _child_checkpoint(model, mesh, tmpdir) -> dict:
    """restore_checkpoint straight into the rule shardings (checkpoint_sharding)."""
    from lookahead_jax.convert.checkpoint import restore_checkpoint, save_checkpoint

    save_checkpoint(tmpdir, model.config, model.params)
    cfg, params = restore_checkpoint(tmpdir, sharding=sh.checkpoint_sharding(mesh))
    want = sh.param_shardings(cfg, mesh)
    abstract = sh.abstract_params(cfg, mesh)
    return dict(
        config_equal=cfg == model.config,
        shardings_equal=all(x.sharding == w for x, w in zip(jax.tree.leaves(params), jax.tree.leaves(want))),
        abstract_equal=all(a.sharding == x.sharding and a.shape == x.shape and a.dtype == x.dtype
                           for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(params))),
        values_equal=all(np.array_equal(np.asarray(a), np.asarray(b))
                         for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(model.params))),
        structure_equal=jax.tree.structure(params) == jax.tree.structure(model.params),
        **_shard_facts(params, mesh),
    )


def _child_main(family, ckpt_dir=None) -> None:
    """Body of one child process: every multi-device check of `family`."""
    from tiny import tiny_model

    model, mesh = _child_setup(family)
    # For the logits comparison, a head without tiny_model's sharpening (and a smaller tied
    # embedding): logits of O(1-10), so atol 1e-5 spans several f32 ulps of the largest
    # logit rather than ~1 (the sharpened head gives logits ~25, where a different
    # reduction order alone moves them by ~1e-5).
    plain = tiny_model(family, seed=1, head_scale=1.0, **CONFIGS[family])
    if plain.config.tie_embeddings:
        plain.params["embed"] = plain.params["embed"] * 0.25
    result = dict(forward=_child_forward(plain, mesh), generate=_child_generate(model, mesh))
    if ckpt_dir:
        result["checkpoint"] = _child_checkpoint(model, mesh, ckpt_dir)
    print("RESULT " + json.dumps(result), flush=True)


# gemma3 and qwen2 in CI's full run only: each family is a child process of ~1 min
MESH_FAMILIES = [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_sharded_forward_matches_one_device(mesh_runs, family):
    r = mesh_runs(family)["forward"]
    assert r["logits_diff"] <= 1e-5, r
    assert r["cache_diff"] <= 1e-5, r
    assert r["logits_scale"] > 1.0, r  # a real comparison, not of near-zero logits
    assert r["logits_devices"] == N_DEVICES
    assert r["all_on_mesh"]
    cfg = tiny_config(family, **CONFIGS[family])
    # o [N*H,D] split by rows over model=4; embed [V,D] split by rows (V=260)
    assert r["o_spec"] == str(P("model", None))
    assert r["o_shard"] == [cfg.n_heads * cfg.head_dim // 4, cfg.d_model]
    assert r["embed_shard"] == [cfg.vocab_size // 4, cfg.d_model]
    if kv_heads_split(family):  # llama's K=4 divides: kv heads split in the weights and in the cache
        assert r["qkv_spec"] == str(P(None, "model", None, None))
        assert r["cache_spec"] == str(P("data", "model", None, None))
        assert r["cache_shard"] == [2, 1, 32, cfg.head_dim]
    else:  # K=2 on model=4: replicated over model, batch still over data
        assert r["qkv_spec"] == str(P(None, None, None, None))
        assert r["cache_spec"] == str(P("data", None, None, None))
        assert r["cache_shard"] == [2, 2, 32, cfg.head_dim]


@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_sharded_generate_matches_one_device(mesh_runs, family):
    r = mesh_runs(family)["generate"]
    t = r["tokens"]
    assert t["sharded/greedy"] == t["single/greedy"]
    assert t["sharded/lookahead"] == t["single/greedy"]
    assert t["single/lookahead"] == t["single/greedy"]
    assert all(len(x) == 20 for x in t["single/greedy"])
    n = r["steps"]  # same drafts, same acceptance; fewer forwards than greedy
    assert n["sharded/lookahead"] == n["single/lookahead"] < n["sharded/greedy"] == 20
    assert r["verify_params_specs_as_sharded"]
    # jitted prefill + verify with batch and cache over "data" too
    g = r["greedy"]
    assert r["step_first"][0] == r["step_first"][1] == [x[0] for x in g]
    assert r["step_emitted"][0] == r["step_emitted"][1] == [x[1:5] + [-1] for x in g]
    assert r["step_n"][0] == r["step_n"][1] == [4, 4]
    assert r["step_length"][0] == r["step_length"][1]
    assert r["step_cache_diff"] <= 1e-5, r["step_cache_diff"]
    assert r["step_emitted_devices"] == N_DEVICES
    kv_split = "model" if kv_heads_split(family) else None
    assert r["step_cache_spec"] == str(P("data", kv_split, None, None))


@pytest.mark.parametrize("family", MESH_FAMILIES)
def test_generate_with_a_mesh_matches_one_device(mesh_runs, family):
    """generate(mesh=...) on (data=2, model=4) and (data=8): batch 8, prompts of 8
    lengths, greedy (also 5 steps per device call) and lookahead give the one-device tokens; the cache is split over
    "data" (and kv heads over "model" where they divide) going into and out of the step."""
    r = mesh_runs(family)["generate"]["mesh_generate"]
    t = r["tokens"]
    want = t["single/greedy"]
    assert len(want) == 8 and all(len(x) == 12 for x in want)
    for name, ids in t.items():
        assert ids == want, name
    kv_split = "model" if kv_heads_split(family) else None
    f = r["facts"]
    assert f["data=2,model=4"]["cache_in"] == f["data=2,model=4"]["cache_out"] == str(P(*_strip(("data", kv_split))))
    assert f["data=8,model=1"]["cache_in"] == f["data=8,model=1"]["cache_out"] == str(P("data"))
    assert all(x["lookahead_steps"] < 12 for x in f.values())  # the references' drafts accepted


@pytest.mark.slow  # gemma3's child (CI's full run)
def test_restore_checkpoint_into_shards(mesh_runs):
    r = mesh_runs("gemma3")["checkpoint"]
    assert r["config_equal"] and r["structure_equal"]
    assert r["shardings_equal"] and r["abstract_equal"] and r["all_on_mesh"]
    assert r["values_equal"]
    # gemma3 tiny: N=4 divides model=4 (o split), K=2 does not (qkv replicated)
    assert r["o_spec"] == str(P("model", None)) and r["qkv_spec"] == str(P(None, None, None, None))
