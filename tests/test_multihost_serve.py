"""The server over several processes: `python -m lookahead_jax.serve` run by 2 local
processes of 4 CPU devices each (gloo) on one (data=2, model=4) mesh spanning both;
process 0 serves HTTP and the other follows its engine (`serve.replica`). 8 concurrent
requests (greedy and sampled, short prompts and long ones prefilled in blocks, two that
share a cached prefix) give the tokens `generate` gives on one device; stopping process 0
ends both.

The processes are `multihost_worker.py serve ...` (the tiny random model of a fixed seed,
the same weights on both), as in test_multihost.py; compiling takes minutes on a 2-core
CPU: marked slow.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import pytest

from lookahead_jax.generate import generate
from multihost_worker import Tokenizer, tiny_multihost
from test_multihost import RUN_S, finish, free_port, read, start

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MAX_LEN = 256
HEAD = "the cat sat on the mat, the dog sat on the log; " * 3  # 150 tokens: blocks of 32, cached once


def cases() -> list:
    """(prompt, max_tokens, temperature, seed) of the 8 requests."""
    short = ["abcabcabcabc", "1 2 3 1 2 3 1 2 3", "hello hello hello", "to be or not to be"]
    return [(short[0], 24, 0.0, 0), (short[1], 16, 0.0, 0), (short[2], 20, 0.8, 5), (short[3], 12, 0.8, 9),
            (HEAD + "and then", 16, 0.0, 0), (HEAD + "so the cat", 16, 0.8, 3),
            ("x = x + 1; " * 12, 24, 0.0, 0), ("la la la", 8, 0.0, 0)]


def complete(url: str, prompt: str, max_tokens: int, temperature: float, seed: int) -> list:
    body = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                return_token_ids=True)
    r = httpx.post(url + "/v1/completions", json=body, timeout=RUN_S)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


@pytest.mark.slow
def test_two_process_server_answers_concurrent_requests_with_one_process_tokens(tmp_path):
    port = free_port()
    cmd = ["serve", "--model", "tiny", "--mesh", "data=2,model=4", "--max-batch", "4", "--max-len", str(MAX_LEN),
           "--strategy", "lookahead", "--option", "decoding_length=8", "--prefill-chunk", "32",
           "--prefix-cache-mb", "16", "--port", str(port)]
    procs = start(tmp_path, [[cmd], [cmd]])
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:  # the port opens at once; 200 once the warm-up's minimum set is compiled
            if any(p.poll() is not None for p in procs):
                pytest.fail("a process ended before serving:\n" + "\n".join(e[-3000:] for e in read(tmp_path, "err")))
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > RUN_S:
                pytest.fail("the server was not ready in time:\n" + read(tmp_path, "err")[0][-3000:])
            time.sleep(1)
        ready = time.monotonic() - t0
        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda c: complete(url, *c), cases()))
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        procs[0].send_signal(signal.SIGTERM)  # process 0 drains and ends the record: the other ends too
    rcs, outs, errs = finish(tmp_path, procs, timeout=120)
    assert rcs == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert "following process 0's engine" in errs[1] and "process 0's engine ended" in errs[1], errs[1][-3000:]
    model, tok = tiny_multihost(), Tokenizer()
    want = [generate(model, tok, [p], max_new_tokens=n, max_cache_len=MAX_LEN, temperature=t, seed=s).token_ids[0]
            for p, n, t, s in cases()]
    assert got == want
    assert got[2] != generate(model, tok, [cases()[2][0]], max_new_tokens=20, max_cache_len=MAX_LEN).token_ids[0]
    # lookahead drafted and had drafts accepted; the second long prompt took the first's blocks
    accepted = [line for line in metrics.splitlines() if line.startswith("lookahead_jax:spec_decode_num_accepted_tokens_total")]
    hits = [line for line in metrics.splitlines() if line.startswith("lookahead_jax:prefix_cache_hits_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, metrics[-3000:]
    assert hits and float(hits[0].split()[-1]) > 0, metrics[-3000:]
    print(f"2-process server: ready in {ready:.0f} s, 8 requests answered as one process")
