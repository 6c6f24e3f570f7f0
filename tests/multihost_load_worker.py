"""`load(dir, mesh=)` of a `save_pretrained` checkpoint, in a child process of tests/test_load_mesh.py:

    python tests/multihost_load_worker.py single ROOT              (one process, 8 CPU devices)
    python tests/multihost_load_worker.py multi ROOT PORT PID      (process PID of 2, 4 CPU devices each)

ROOT holds what the test saved: <family>/ (save_pretrained's directory) and <family>.npz
(the weights as numpy, flat "layers.0.o" keys). `sharding.shard_params` raises while `load` runs: the params must
come from orbax's restore into their shardings, not from a whole copy placed afterwards.
Prints one `RESULT {json}` line (process 0 only for `multi`). XLA_FLAGS and JAX_PLATFORMS
come from the test's environment."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

PROMPTS = ["the cat sat on the mat, the cat", "abcabcabc", "1 2 3 1 2 3", "hello hello"]
NEW = 8


@contextlib.contextmanager
def no_shard_params():
    """`sharding.shard_params` raising (`load` imports it at its call)."""
    from lookahead_jax.core import sharding

    def refuse(*a, **k):
        raise AssertionError("load(mesh=) placed a whole copy (shard_params) instead of restoring shards")

    saved, sharding.shard_params = sharding.shard_params, refuse
    try:
        yield
    finally:
        sharding.shard_params = saved


def patch_tokenizer():
    """`load` returns the tests' byte tokenizer (`save_pretrained` wrote a placeholder)."""
    import lookahead_jax.loading
    from multihost_worker import Tokenizer

    class Loader:
        @staticmethod
        def load(path):
            assert (pathlib.Path(path) / "BYTES").exists(), path
            return Tokenizer()

    lookahead_jax.loading.Tokenizer = Loader


def flat(params) -> dict:
    import jax

    from lookahead_jax.core.sharding import path_str

    return {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}


def load_on(name, mesh, dtype="float32"):
    from lookahead_jax.loading import load

    with no_shard_params():
        return load(str(name), dtype, mesh=mesh)


def compare(model, ref, mesh) -> dict:
    """Leaves of `model` not in `param_shardings`' sharding, or not equal to `ref`'s."""
    import numpy as np

    from lookahead_jax.core import sharding as sh

    got, want = flat(model.params), flat(sh.param_shardings(model.config, mesh))
    return dict(shardings=[k for k in want if got[k].sharding != want[k]],
                values=[k for k, x in flat(ref.params).items() if not np.array_equal(np.asarray(got[k]), np.asarray(x))])


def preset(root, mesh, ref) -> list:
    """A preset on a mesh: its first load (`_convert` stubbed: it saves the tiny llama as
    the preset's checkpoint and returns it whole, as the GGUF conversion does) restores the
    checkpoint it saved into shards; the second restores the cached one."""
    import os
    import shutil

    from lookahead_jax import loading, presets

    os.environ["LOOKAHEAD_JAX_CACHE"] = str(root / "cache")
    converted = []

    def convert(name, target, dtype, progress, stale):
        shutil.copytree(root / "llama", target)
        converted.append(name)
        return loading.load(str(target), dtype, keep_unpacked=True)  # whole, on one device

    loading._convert = convert
    out = []
    for _ in range(2):
        model, _ = load_on(presets.DEFAULT_MODEL, mesh)
        out.append(dict(converted=len(converted), **compare(model, ref, mesh)))
    return out


def single(root) -> dict:
    """Every leaf in exactly `param_shardings`' sharding (= `shard_params`' of the whole
    copy), equal to `load(dir)` without a mesh (f32 and bf16), and greedy on the mesh
    gives the one-device tokens; a preset's checkpoint too (`preset`)."""
    import jax
    import numpy as np

    from lookahead_jax.core import sharding as sh
    from lookahead_jax.generate import generate
    from lookahead_jax.loading import load

    assert jax.device_count() == 8, jax.devices()
    mesh, out = sh.make_mesh(data=2, model=4), {}
    for family in ("llama", "gemma3"):
        for dtype in ("float32", "bfloat16"):
            model, tok = load_on(root / family, mesh, dtype)
            plain, _ = load(str(root / family), dtype, keep_unpacked=True)
            placed = flat(sh.shard_params(plain.params, plain.config, mesh))  # the old path
            want = flat(sh.param_shardings(model.config, mesh))
            got, ref = flat(model.params), flat(plain.params)
            out[f"{family}/{dtype}"] = dict(
                keys=sorted(got) == sorted(want) == sorted(ref),
                config=model.config == plain.config,
                shardings=[k for k in want if got[k].sharding != want[k] or got[k].sharding != placed[k].sharding],
                dtypes=sorted({str(x.dtype) for x in got.values()}),
                values=[k for k in ref if not np.array_equal(np.asarray(got[k]), np.asarray(ref[k]))],
                on_mesh=all(x.sharding.mesh == mesh for x in got.values()),
                o_spec=str(got["layers.0.o"].sharding.spec),
                embed_shard=list(got["embed"].addressable_shards[0].data.shape),
                lm_head="lm_head" in got,
            )
            if family == "llama" and dtype == "float32":
                kw = dict(max_new_tokens=NEW, ignore_eos=True)
                out["tokens_mesh"] = generate(model, tok, PROMPTS, mesh=mesh, **kw).token_ids
                out["tokens_one"] = generate(plain, tok, PROMPTS, **kw).token_ids
                out["preset"] = preset(root, mesh, plain)
    return out


def bytes_read() -> int:
    """Bytes TensorStore (orbax's reader) has read from files in this process so far."""
    import tensorstore as ts

    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v["value"] for m in metrics for v in m["values"])


def multi(root, port, pid) -> dict:
    """Each process's addressable shards equal the matching slices of the saved weights, on
    a mesh whose 'model' axis stays inside each process (data=2, model=4) and on one that
    spans both (model=8: a split weight is half on each), for the tiny llama and `wide` (a
    larger one stored in several chunks per weight); the bytes each process read from the
    checkpoint files; greedy on data=2,model=4 gives the one-device tokens."""
    import jax
    import numpy as np

    from lookahead_jax.core import sharding as sh
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.core.multihost import init_distributed
    from lookahead_jax.generate import generate

    init_distributed(f"127.0.0.1:{port}", 2, pid)
    enable_compilation_cache("xla-tests")
    assert jax.process_count() == 2 and jax.local_device_count() == 4
    out = {}
    for family in ("llama", "wide"):
        saved = dict(np.load(root / f"{family}.npz"))
        for name, shape in (("data=2,model=4", (2, 4)), ("model=8", (1, 8))):
            mesh = sh.make_mesh(data=shape[0], model=shape[1])
            before = bytes_read()
            model, tok = load_on(root / family, mesh)
            read = bytes_read() - before
            got, want = flat(model.params), flat(sh.param_shardings(model.config, mesh))
            bad, partial = [], []
            for k, x in got.items():
                if x.sharding != want[k]:
                    bad.append(f"{k}: sharding {x.sharding.spec} != {want[k].spec}")
                for s in x.addressable_shards:
                    if not np.array_equal(np.asarray(s.data), saved[k][s.index]):
                        bad.append(f"{k}: shard {s.index} of device {s.device.id}")
                held = {tuple((i.start or 0, i.stop) for i in s.index): s.data.size for s in x.addressable_shards}
                if sum(held.values()) < x.size:  # this process holds only part of the array
                    partial.append(k)
            out[f"{family}/{name}"] = dict(
                bad=bad, partial=sorted(partial), read=read,
                down_rows=sorted({(s.index[0].start or 0) for s in got["layers.0.down"].addressable_shards}))
            if (family, name) == ("llama", "data=2,model=4"):
                kw = dict(max_new_tokens=NEW, ignore_eos=True)
                out["tokens"] = generate(model, tok, PROMPTS, mesh=mesh, **kw).token_ids
    out["process"] = pid
    return out


def main(argv) -> int:
    import numpy as np

    patch_tokenizer()
    root = pathlib.Path(argv[1])
    if argv[0] == "single":
        from lookahead_jax.core.compile import enable_compilation_cache

        enable_compilation_cache("xla-tests")  # as the test processes (conftest.py)
        result = single(root)
    else:
        result = multi(root, int(argv[2]), int(argv[3]))
    print("RESULT " + json.dumps(result, default=lambda x: np.asarray(x).tolist()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
