"""One process of a multi-process CLI run in tests/test_multihost.py (2 of them, 4 CPU devices each):

    python tests/multihost_worker.py ARGS... [--then ARGS...]   (the generate command's arguments)
    python tests/multihost_worker.py serve ARGS...              (the serve command's)

Each `--then` starts another command in the same processes (the distributed runtime and the
compiled programs kept), after the previous one ended.

The command's `load` gives the tiny random model of `tiny_multihost` (the same weights on every
process: a fixed seed), placed on the command's mesh, and a byte tokenizer; `--draft-model
tiny/draft` (SpecInfer) loads `tiny_draft`, the same model with noise on its weights. XLA_FLAGS
and JAX_PLATFORMS come from the test's environment (LOOKAHEAD_JAX_CACHE too: a retriever's index;
LOOKAHEAD_TEST_STALL_AT=P:N: process P stalls before its collective N, `stall_before`)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tiny import ByteTokenizer, tiny_model  # noqa: E402

# vocab 260 = 4 * 65: the vocab splits over model=4; kv heads 4 split too (as in test_sharding)
TINY = dict(vocab_size=260, n_heads=8, n_kv_heads=4, head_dim=8)


class Tokenizer(ByteTokenizer):
    """ByteTokenizer whose decode skips id 259 (the 260-token vocab's one id past the bytes)."""

    def decode(self, ids, skip_special_tokens=False):
        return super().decode([i for i in ids if int(i) < 259], skip_special_tokens)


DRAFT = "tiny/draft"  # the --draft-model name that loads `tiny_draft` (a hub-id form: no vocab check)


def tiny_multihost():
    return tiny_model("llama", seed=2, **TINY)


def tiny_draft(scale=0.3):
    """`tiny_multihost` with Gaussian noise (relative `scale`, a fixed key) on every weight: a
    draft that agrees with the target often, not always (as test_specinfer's `perturbed`)."""
    import jax
    import jax.numpy as jnp

    model = tiny_multihost()
    leaves, tdef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    model.params = jax.tree.unflatten(tdef, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
                                             for x, k in zip(leaves, keys)])
    return model


def fake_load(name, dtype="float32", mesh=None, **_):
    from lookahead_jax.core.sharding import shard_params

    model = tiny_draft() if name == DRAFT else tiny_multihost()
    if mesh is not None:
        model.params = shard_params(model.params, model.config, mesh)
    return model, Tokenizer()


def stall_before(process: int, n: int) -> None:
    """A stall for tests/test_multihost.py: `process`'s main thread sleeps for good in host
    code just before it would enter its collective `n` (`multihost.collective`, counted
    from 1), its heartbeat thread still running: alive, not progressing."""
    import contextlib
    import time

    import jax

    from lookahead_jax.core import multihost

    enter = multihost.collective

    @contextlib.contextmanager
    def stalling():
        if jax.process_index() == process and multihost.progress()[0] + 1 == n:
            print(f"stalling before collective {n}", file=sys.stderr, flush=True)
            time.sleep(10 ** 6)
        with enter():
            yield

    multihost.collective = stalling


def main(argv) -> int:
    import os

    import lookahead_jax.loading
    from lookahead_jax import cli

    from lookahead_jax.core.compile import enable_compilation_cache

    enable_compilation_cache("xla-tests")  # as the test processes (conftest.py)
    lookahead_jax.loading.load = fake_load
    if os.environ.get("LOOKAHEAD_TEST_STALL_AT"):  # (tests/test_multihost.py)
        stall_before(*map(int, os.environ["LOOKAHEAD_TEST_STALL_AT"].split(":")))
    if argv[:1] == ["serve"]:  # the server: process 0 serves HTTP, the other follows it
        from lookahead_jax.serve.__main__ import main as serve

        lookahead_jax.loading.vocab_size = lambda name: TINY["vocab_size"]  # (the model name's check)
        serve([a for a in argv[1:] if a != "--then"])
        return 0
    rc, cmd = 0, []
    for a in argv + ["--then"]:
        if a != "--then":
            cmd.append(a)
            continue
        rc = cli.main(cmd)
        print("--- end of command", flush=True)
        if rc:
            return rc
        cmd = []
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
