"""`load(dir, mesh=)` of a `save_pretrained` checkpoint restores every param straight into
its NamedSharding on the mesh (orbax, `sharding.checkpoint_sharding`) instead of reading the
model whole and placing it (`shard_params`, which the children make raise while `load`
runs): on one process of 8 CPU devices (data=2, model=4), and over 2 processes of 4 CPU
devices each (`jax.distributed`), where each process gets its own devices' shards and, on
a mesh whose 'model' axis spans both, reads about half of the checkpoint's files (weights
stored in chunks, `convert.checkpoint.CHUNK_BYTES`); a preset's converted checkpoint too
(its first load and a cached one). The children are `multihost_load_worker.py` (the main
pytest process has one device)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from lookahead_jax.core.sharding import path_str
from lookahead_jax.generate import generate
from lookahead_jax.loading import save_pretrained
from multihost_load_worker import NEW, PROMPTS
from multihost_worker import TINY, Tokenizer
from test_multihost import finish, free_port
from tiny import tiny_model

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "multihost_load_worker.py"
# gemma3: tied embeddings (no lm_head: embed is the head), K=2 kv heads (qkv replicated on model=4)
FAMILIES = {"llama": dict(seed=2, **TINY), "gemma3": dict(seed=1, vocab_size=260, tie_embeddings=True),
            # 21 MB of weights, every one split on model=8; embed, lm_head, gate_up and down span
            # several chunks of checkpoint.CHUNK_BYTES (2 MiB) each
            "wide": dict(family="llama", seed=3, vocab_size=4096, d_model=256, n_layers=1, n_heads=8,
                         n_kv_heads=8, head_dim=32, d_ff=4096)}


class _Placeholder:
    """save_pretrained's tokenizer: the worker's `load` gives the byte tokenizer back."""

    def save(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "BYTES").write_text("")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """ROOT with <family>/ (save_pretrained) and <family>.npz (its weights, flat keys)."""
    import jax

    root = tmp_path_factory.mktemp("saved")
    models = {}
    for name, kw in FAMILIES.items():
        model = tiny_model(**{"family": name, **kw})
        model.name = name
        save_pretrained(model, _Placeholder(), root / name)
        np.savez(root / f"{name}.npz", **{path_str(p): np.asarray(x)
                                          for p, x in jax.tree_util.tree_leaves_with_path(model.params)})
        models[name] = model
    return root, models


def _env(devices: int) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), e.get("PYTHONPATH", "")])
    return e


def _result(out: str) -> dict:
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == 1, out[-2000:]
    return json.loads(lines[0][len("RESULT "):])


def test_load_with_a_mesh_restores_each_leaf_into_its_sharding(saved):
    root, _ = saved
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(WORKER), "single", str(root)], env=_env(8), cwd=root,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    r = _result(p.stdout)
    for name in ("llama/float32", "llama/bfloat16", "gemma3/float32", "gemma3/bfloat16"):
        x = r[name]
        assert x["keys"] and x["config"] and x["on_mesh"], (name, x)
        assert x["shardings"] == [], (name, x["shardings"])  # = param_shardings = shard_params'
        assert x["values"] == [], (name, x["values"])  # = load(dir) without a mesh
        assert x["dtypes"] == [name.split("/")[1]], (name, x["dtypes"])
        assert x["o_spec"] == str(P("model", None)) and x["embed_shard"] == [65, 64], (name, x)
        assert x["lm_head"] == (name.startswith("llama")), name  # gemma3's is the tied embed
    assert r["tokens_mesh"] == r["tokens_one"]
    # a preset: converted (stubbed), then its checkpoint restored into shards; then from the cache
    assert [x["converted"] for x in r["preset"]] == [1, 1], r["preset"]
    assert all(x["shardings"] == [] and x["values"] == [] for x in r["preset"]), r["preset"]
    assert len(r["tokens_one"]) == len(PROMPTS) and all(len(t) == NEW for t in r["tokens_one"])
    print(f"one process, 8 devices: {time.monotonic() - t0:.0f} s")


def test_two_processes_each_restore_their_own_shards(saved, tmp_path):
    root, models = saved
    port, t0 = free_port(), time.monotonic()
    procs = []
    for pid in range(2):
        out, err = open(tmp_path / f"p{pid}.out", "w"), open(tmp_path / f"p{pid}.err", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "multi", str(root), str(port), str(pid)],
                                      stdout=out, stderr=err, env=_env(4), cwd=tmp_path))
    rcs, outs, errs = finish(tmp_path, procs, timeout=300)
    assert rcs == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    want = generate(models["llama"], Tokenizer(), PROMPTS, max_new_tokens=NEW, ignore_eos=True).token_ids
    wide = sum(x.nbytes for x in np.load(root / "wide.npz").values())
    for pid, out in enumerate(outs):
        r = _result(out)
        assert r["process"] == pid
        for family in ("llama", "wide"):
            one, both = r[f"{family}/data=2,model=4"], r[f"{family}/model=8"]
            F = models[family].config.d_ff
            assert one["bad"] == [] and both["bad"] == [], (pid, family, one["bad"][:6], both["bad"][:6])
            # data=2,model=4: each process holds a whole replica (its 4 devices are one 'model' row)
            assert one["partial"] == [] and one["down_rows"] == [F // 4 * i for i in range(4)]
            # model=8 spans both: a split weight is half on each process (down [F, D] by rows)
            assert {"layers.0.down", "layers.0.o", "layers.0.gate_up"} <= set(both["partial"]), both["partial"]
            assert both["down_rows"] == [F // 2 * pid + F // 8 * i for i in range(4)]
        # `wide` on model=8: each process read about half of the checkpoint's files, not all of
        # them (the tiny weights, one chunk each, are read whole; reads of chunks less than
        # 1 MB apart are merged by TensorStore, as orbax configures it, and how many merge
        # varies from run to run: 0.47-0.48 x the weights here quiet, 0.64 once in a loaded
        # CI run; stored in one chunk per leaf, each process reads 1.09 x, which fails this)
        one, both = r["wide/data=2,model=4"]["read"], r["wide/model=8"]["read"]
        assert one > 0.9 * wide and both < 0.75 * wide, (pid, one, both, wide)
        assert r["tokens"] == want, pid
        print(f"process {pid} read {both / 1e6:.1f} MB of `wide` on model=8, {one / 1e6:.1f} MB on "
              f"data=2,model=4 ({wide / 1e6:.1f} MB of weights)")
    print(f"2 processes: {time.monotonic() - t0:.0f} s")
