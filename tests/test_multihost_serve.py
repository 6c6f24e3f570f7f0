"""The server over several processes: `python -m lookahead_jax.serve` run by 2 local
processes of 4 CPU devices each (gloo) on one (data=2, model=4) mesh spanning both;
process 0 serves HTTP and the other follows its engine (`serve.replica`). 8 concurrent
requests (greedy and sampled, short prompts and long ones prefilled in blocks, two that
share a cached prefix; a step budget, whose timed choice of blocks is process 0's) give the
tokens `generate` gives on one device; stopping process 0 ends both.

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
from lookahead_jax.strategies import RaLM
from multihost_worker import DRAFT, Tokenizer, tiny_multihost
from test_multihost import RUN_S, bm25_corpus, finish, free_port, read, start

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


RAG = dict(retriever="bm25", stride=2, query_tokens=16, max_passage_tokens=64)


def options(opts: dict) -> list:
    return [a for k, v in opts.items() for a in ("--option", f"{k}={v}")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lookahead", "ralmspec", "specinfer"])
def test_two_process_server_answers_concurrent_requests_with_one_process_tokens(tmp_path, monkeypatch, strategy):
    """lookahead (prefix cache, step budget); ralmspec over a BM25 index (process 0's
    retrievals, OS3's stride; its slots prefill whole prompts and take only greedy requests
    here, as RaLM decodes with the slots' sampling); specinfer with a noisy draft model (its
    auto budget's choice is process 0's)."""
    port = free_port()
    cmd = ["serve", "--model", "tiny", "--mesh", "data=2,model=4", "--max-batch", "4", "--max-len", str(MAX_LEN),
           "--strategy", strategy, "--prefill-chunk", "32", "--prefix-cache-mb", "16", "--port", str(port)]
    one = "greedy"  # the strategy of one-device generate (greedy: the lossless reference)
    if strategy == "lookahead":
        cmd += options({"decoding_length": 8}) + ["--step-budget", "2"]
    elif strategy == "ralmspec":
        rag = dict(RAG, corpus=bm25_corpus(tmp_path, monkeypatch))
        cmd += options(dict(rag, speculation_stride="auto"))
        one = RaLM(**rag)
    else:
        cmd += options({"draft_model": DRAFT})
    # (greedy only on ralmspec, whose slots decode with one sampling, and on specinfer, whose
    # sampled tokens follow which steps drafted: its auto budget's choice, timed)
    requests = [c if strategy == "lookahead" else (c[0], c[1], 0.0, 0) for c in cases()]
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
            try:
                got = list(pool.map(lambda c: complete(url, *c), requests))
            except AssertionError as e:  # a request failed: what each process said
                pytest.fail(f"{e}\n" + "\n".join(f"process {i}:\n{t[-4000:]}"
                                                   for i, t in enumerate(read(tmp_path, "err"))))
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        procs[0].send_signal(signal.SIGTERM)  # process 0 drains and ends the record: the other ends too
    rcs, outs, errs = finish(tmp_path, procs, timeout=120)
    assert rcs == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert "following process 0's engine" in errs[1] and "process 0's engine ended" in errs[1], errs[1][-3000:]
    model, tok = tiny_multihost(), Tokenizer()
    want = [generate(model, tok, [p], max_new_tokens=n, max_cache_len=MAX_LEN, temperature=t, seed=s,
                     strategy=one).token_ids[0] for p, n, t, s in requests]
    assert got == want
    if strategy == "ralmspec":  # the passages change the tokens
        assert got != [generate(model, tok, [p], max_new_tokens=n, max_cache_len=MAX_LEN).token_ids[0]
                       for p, n, _, _ in requests]
    elif strategy == "lookahead":  # a sampled request samples
        assert got[2] != generate(model, tok, [cases()[2][0]], max_new_tokens=20, max_cache_len=MAX_LEN).token_ids[0]
    value = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("lookahead_jax:") and "position" not in line}
    if strategy == "lookahead":  # drafts accepted; the second long prompt took the first's blocks
        assert value["lookahead_jax:spec_decode_num_accepted_tokens_total"] > 0, metrics[-3000:]
        assert value["lookahead_jax:prefix_cache_hits_total"] > 0, metrics[-3000:]
    elif strategy == "specinfer":  # its draft model drafted for some steps
        assert value["lookahead_jax:spec_decode_num_drafts_total"] > 0, metrics[-3000:]
    else:  # retrievals speculated and verified
        assert value["lookahead_jax:retrieval_speculations_total"] > 0, metrics[-3000:]
    print(f"2-process {strategy} server: ready in {ready:.0f} s, 8 requests answered as one process")
