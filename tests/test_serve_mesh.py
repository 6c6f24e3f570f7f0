"""The server's scheduler on a mesh in one process (`serve --mesh data=2,model=4`): built by
`make_server` as the command builds it (slots with penalties as data, fallback, 32-token
prefill blocks, the prefix cache), warmed up, then requests inserted one after another
while others decode (one-row prefill blocks of a batch split over "data"), greedy and
sampled: each gives the tokens of `generate` on one device. In a child process of 8 CPU
devices, as tests/test_sharding.py runs its mesh checks."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
from lookahead_jax.generate import generate
from lookahead_jax.serve import ServeConfig, make_server
from lookahead_jax.serve.jobs import Job
from lookahead_jax.core.params import GenerationParams
from tiny import ByteTokenizer, load_prompts, tiny_model

model = tiny_model("llama", vocab_size=260, n_heads=8, n_kv_heads=4, head_dim=8)
tok = ByteTokenizer()
cfg = ServeConfig(model="tiny", strategy="lookahead", strategy_options=(("decoding_length", 7),), max_batch=4,
                  max_len=512, prefill_chunk=32, prefix_cache_mb=16, mesh=(("data", 2), ("model", 4)))
sched = make_server(cfg, model, tok).scheduler
sched.warm_up(wait="all")
passage = load_prompts()[0]["prompt"][:150]
texts = [passage + " Q: one", "abcabcabc", passage + " Q: two", "hello hello hello", "x = 1; " * 8]
temps = [0.0, 0.0, 0.8, 0.0, 0.7]
outs = {{}}
jobs = [Job(tok.encode(t), GenerationParams(max_new_tokens=10, temperature=temp, seed=3 + i),
            lambda o, i=i: outs.setdefault(i, []).extend(o.tokens)) for i, (t, temp) in enumerate(zip(texts, temps))]
for job in jobs:  # one at a time, the others decoding
    sched.submit([job])
    sched._admit()
    sched._step()
while sched.running or sched.waiting:
    sched._admit()
    sched._step()
got = [outs[i] for i in range(len(texts))]
want = [generate(model, tok, [t], max_new_tokens=10, max_cache_len=512, temperature=temp, seed=3 + i).token_ids[0]
        for i, (t, temp) in enumerate(zip(texts, temps))]
print("RESULT " + json.dumps(dict(same=got == want, got=got, want=want, errors=sched.errors,
                                  hits=sched.slots.prefix.cache.summary()["prefix_cache_hit_blocks"])))
"""


def test_the_server_on_a_mesh_gives_one_devices_tokens():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    code = CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["errors"] == 0 and res["same"], res
    assert res["hits"] > 0, res  # the second question took the passage's blocks
