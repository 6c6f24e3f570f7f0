"""The out-of-process retriever (lookahead_jax/retrieval/remote.py, server.py): a server started
by `python -m lookahead_jax.retrieval serve` in a subprocess answers `RemoteRetriever` with
exactly the in-process retriever's arrays (BM25, and exact dense with the toy encoder of
test_retrieval.py); RaLM / RaLMSpec (async) with `retriever="remote:HOST:PORT"` give the
in-process run's tokens and passages on the tiny model, also through Slots stepped on a
thread of their own (the server's engine thread); calls from several threads at once
are each answered right; no server, a server gone, a slow one, a wrong key and bad addresses
are clear errors, not hangs."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lookahead_jax import retrieval as R
from lookahead_jax.generate import generate
from lookahead_jax.retrieval import INVALID, Corpus, RemoteRetrievalError, RemoteRetriever
from lookahead_jax.retrieval.remote import authkey_for, parse_address
from lookahead_jax.retrieval.server import READY
from lookahead_jax.strategies import RaLM, RaLMSpec

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# the server process registers test_retrieval's toy encoder, then runs the real CLI
LAUNCH = ("import sys; sys.path.insert(0, {tests!r}); import test_retrieval; "
          "from lookahead_jax.retrieval.cli import main; sys.exit(main(sys.argv[1:]))")


def start_server(*argv, env=None, wait_s: float = 180.0):
    """`serve ... --port 0` in a subprocess; (process, "HOST:PORT") once its ready line is out."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    cmd = [sys.executable, "-c", LAUNCH.format(tests=str(TESTS)), "serve", *argv, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            m = re.match(re.escape(READY) + r" (\S+):(\d+) ", line)
            if m:
                return proc, f"{m.group(1)}:{m.group(2)}"
            if not line:  # it exited
                break
    proc.kill()
    raise AssertionError(f"the retrieval server did not start: {proc.stderr.read()}")


def stop(proc) -> str:
    """SIGTERM; its stdout after the ready line (the server must exit cleanly)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_arrays(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A 120-passage corpus file (test_retrieval's) with its bm25 and dense (toy encoder)
    indexes in a cache directory of its own."""
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    from test_retrieval import make_passages, write_jsonl

    d = tmp_path_factory.mktemp("remote")
    path = write_jsonl(d / "passages.jsonl", make_passages(120, seed=3))
    cache = d / "cache"
    R.build_index("bm25", path, cache_dir=cache, progress=False)
    R.build_index("dense", path, encoder="toy", cache_dir=cache, progress=False)
    return path, cache


@pytest.fixture(scope="module", params=["bm25", "dense"])
def pair(request, indexed):
    """(in-process retriever, RemoteRetriever of a server holding the same index)."""
    path, cache = indexed
    kind = request.param
    proc, addr = start_server("--retriever", kind, "--corpus", str(path), "--encoder", "toy", "--out", str(cache))
    remote = RemoteRetriever(addr)
    yield R.load_retriever(kind, path, encoder="toy", cache_dir=cache), remote
    remote.close()
    assert "retrieval server stopped" in stop(proc)


# ----------------------------------------------------------------------------- same results
def test_remote_returns_the_in_process_arrays(pair):
    from test_retrieval import QUERIES

    local, remote = pair
    assert (remote.kind, remote.size) == (local.kind, local.size)
    assert remote.info["corpus_sha256"] == local.corpus.fingerprint
    queries = QUERIES + ["", "river " * 40]
    checked = 0
    for k in (1, 3, 7, local.size):
        ids, scores = remote.retrieve(queries, k)
        assert_same_arrays((ids, scores), local.retrieve(queries, k))
        assert ids.dtype == np.int64 and scores.dtype == np.float32 and ids.shape == (len(queries), k)
        rng = np.random.default_rng(k)
        # subsets: unordered, with duplicates, one smaller than k (padded), one empty
        cands = [rng.choice(local.size, size=int(rng.integers(2, 30))) for _ in queries]
        cands[1], cands[2] = np.array([5, 5, 2], np.int32), []
        assert_same_arrays(remote.retrieve_from(queries, cands, k), local.retrieve_from(queries, cands, k))
        got, want = remote.score(queries, cands), local.score(queries, cands)
        assert len(got) == len(want) == len(queries)
        assert_same_arrays(got, want)
        checked += int((ids != INVALID).sum())
    assert checked > 0 and remote.retrieve(queries, 5)[1].max() > 0  # real hits, not all padding
    # the same checks, the same messages, before any round trip
    for call in (lambda r: r.retrieve(queries, 0), lambda r: r.retrieve("one string", 1),
                 lambda r: r.retrieve_from(queries, [[local.size]] * len(queries), 1),
                 lambda r: r.score(queries, [[0]])):
        with pytest.raises((ValueError, TypeError)) as a:
            call(local)
        with pytest.raises(type(a.value), match=re.escape(str(a.value))):
            call(remote)


def test_remote_corpus_is_the_servers(pair, indexed):
    local, remote = pair
    assert len(remote.corpus) == len(local.corpus) and remote.corpus.fingerprint == local.corpus.fingerprint
    for i in (0, 3, 119, -1):
        assert remote.corpus[i] == local.corpus[i]
    assert remote.corpus.contents(3) == local.corpus.contents(3)
    with pytest.raises(IndexError):
        remote.corpus[120]
    # a local copy: used when its sha256 is the server's, refused otherwise
    withfile = RemoteRetriever(remote.address_text, corpus=indexed[0])
    assert isinstance(withfile.corpus, Corpus) and withfile.corpus[5] == local.corpus[5]
    other = Corpus.from_passages(["another corpus"] * 1)
    with pytest.raises(ValueError, match="is not the retrieval server's .*120 passages"):
        RemoteRetriever(remote.address_text, corpus=other)


def test_two_threads_at_once(pair):
    """Four threads, each its own queries and k, interleaved: every answer is its own."""
    from test_retrieval import QUERIES

    local, remote = pair
    errors, done = [], []

    def work(t):
        try:
            for i in range(12):
                qs = [QUERIES[(t + i + j) % len(QUERIES)] + f" {t}" for j in range(1 + (i % 3))]
                k = 1 + (t + i) % 6
                assert_same_arrays(remote.retrieve(qs, k), local.retrieve(qs, k))
                c = [np.arange(t, t + 9)] * len(qs)
                assert_same_arrays(remote.retrieve_from(qs, c, k), local.retrieve_from(qs, c, k))
            done.append(t)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert sorted(done) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- RaLM / RaLMSpec
@pytest.fixture(scope="module")
def ralm_served(model, tok, tmp_path_factory):
    """test_ralm.py's kind of corpus (the tiny model's own words, so the top-1 passage
    changes while it decodes) as a file with its bm25 index, and a server for it."""
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    from test_ralm import PROMPTS
    from tiny import own_word_passages

    passages = own_word_passages(model, tok, PROMPTS, 80, 48)
    d = tmp_path_factory.mktemp("ralm-remote")
    path = d / "passages.jsonl"
    path.write_text(Corpus.from_passages(passages).to_jsonl())
    R.build_index("bm25", path, cache_dir=d / "cache", progress=False)
    proc, addr = start_server("--retriever", "bm25", "--corpus", str(path), "--out", str(d / "cache"))
    yield R.load_retriever("bm25", path, cache_dir=d / "cache"), addr, path
    stop(proc)


def test_ralm_and_ralmspec_remote_equal_in_process(model, tok, ralm_served):
    from test_ralm import PROMPTS, assert_same, run

    local, addr, path = ralm_served
    kw = dict(stride=2, query_tokens=16)
    base = run(model, tok, PROMPTS, RaLM(retriever=local, **kw))
    assert sum(len(h) - 1 for h in base.stats["passages"]) >= len(PROMPTS)  # passages really change
    remote = run(model, tok, PROMPTS, RaLM(retriever=f"remote:{addr}", **kw))
    assert_same(remote, base)
    assert [r.text for r in remote.rows] == [r.text for r in base.rows]
    assert remote.stats["retrievals"] == base.stats["retrievals"]
    # RaLMSpec, verification on its worker thread (its own connection), the corpus file local
    spec = run(model, tok, PROMPTS, RaLMSpec(retriever=f"remote:{addr}", corpus=str(path), speculation_stride=2,
                                            prefetch=5, async_verify=True, **kw))
    assert_same(spec, base)
    assert spec.stats["verify_calls"] > 0 and spec.stats["reprefills"] == base.stats["reprefills"]


def test_slots_on_an_engine_thread(model, tok, ralm_served):
    """The serving path: Slots (core/slots.py) made and stepped on a thread of their own, as
    the server's engine thread does, async RaLMSpec with the remote retriever: each request
    gives its tokens and passages alone in process."""
    import concurrent.futures as cf

    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from test_ralm import PROMPTS, run
    from tiny import drive_slots

    local, addr, _ = ralm_served
    kw = dict(stride=2, query_tokens=16, speculation_stride=2, async_verify=True)
    idx = [4, 0, 7]

    def engine():
        slots = Slots(engine_for(model), tok, 2, 1024, RaLMSpec(retriever=f"remote:{addr}", **kw))
        try:
            return drive_slots(slots, [Request(tok.encode(PROMPTS[i]), GenerationParams(max_new_tokens=24)) for i in idx])
        finally:
            slots.close()

    with cf.ThreadPoolExecutor(1) as pool:
        got = pool.submit(engine).result(timeout=600)
    for i, (row, streamed) in zip(idx, got):
        one = run(model, tok, [PROMPTS[i]], RaLMSpec(retriever=local, **kw), max_new_tokens=24)
        assert row.ids == streamed == one.token_ids[0], f"prompt {i}"
        assert row.retrieval["passages"] == one.rows[0].retrieval["passages"]


def test_ralm_remote_errors(model, tok):
    port = free_port()
    with pytest.raises(RemoteRetrievalError, match=rf"no retrieval server at 127\.0\.0\.1:{port} .*"
                                                   rf"python -m lookahead_jax\.retrieval serve .*--port {port}"):
        generate(model, tok, ["x"], max_new_tokens=2, strategy=RaLM(retriever=f"remote:127.0.0.1:{port}"))
    for bad in ("remote:nohost", "remote:127.0.0.1:http", "remote::99999"):
        with pytest.raises(ValueError, match="HOST:PORT|0..65535"):
            RaLM(retriever=bad).validate()
    RaLM(retriever="remote:localhost:8765").validate()  # no corpus needed


# ----------------------------------------------------------------------------- errors
def test_not_running_gone_and_slow(indexed):
    path, cache = indexed
    port = free_port()
    with pytest.raises(RemoteRetrievalError) as e:
        RemoteRetriever(f"127.0.0.1:{port}")
    assert "\n" not in str(e.value)
    assert f"start one with: python -m lookahead_jax.retrieval serve" in str(e.value)
    # a slow server (the labelled simulation) and a client that waits 0.5 s: an error, then a
    # fresh connection answers the next call right (the late reply is never read as its answer)
    proc, addr = start_server("--retriever", "bm25", "--corpus", str(path), "--out", str(cache),
                              "--latency-ms", "2500")
    local = R.load_retriever("bm25", path, cache_dir=cache)
    r = RemoteRetriever(addr, timeout=0.5)
    assert r.simulated_latency_ms == 2500 and "SIMULATED" in repr(r)
    with pytest.raises(RemoteRetrievalError, match="did not answer retrieve within 0.5 s"):
        r.retrieve(["cat running"], 3)
    others = [np.setdiff1d(np.arange(local.size), local.retrieve(["cat running"], 3)[0])]  # not the late reply
    assert_same_arrays(r.retrieve_from(["cat running"], others, 3), local.retrieve_from(["cat running"], others, 3))
    # the server goes away mid-run: the next call fails at once, naming the command
    proc.kill()
    proc.wait(30)
    with pytest.raises(RemoteRetrievalError, match="went away during score|no retrieval server"):
        r.score(["cat"], [[1, 2]])
    proc.communicate()


def test_keys(indexed, monkeypatch):
    path, cache = indexed
    proc, addr = start_server("--retriever", "bm25", "--corpus", str(path), "--out", str(cache),
                              env={"LOOKAHEAD_JAX_RETRIEVAL_KEY": "s3cret"})
    try:
        monkeypatch.delenv("LOOKAHEAD_JAX_RETRIEVAL_KEY", raising=False)
        with pytest.raises(RemoteRetrievalError, match="refused this client's key"):
            RemoteRetriever(addr)
        assert RemoteRetriever(addr, authkey="s3cret").size == 120
        monkeypatch.setenv("LOOKAHEAD_JAX_RETRIEVAL_KEY", "s3cret")
        assert RemoteRetriever(addr).size == 120
    finally:
        stop(proc)
    monkeypatch.delenv("LOOKAHEAD_JAX_RETRIEVAL_KEY")
    with pytest.raises(ValueError, match="not a loopback address.*LOOKAHEAD_JAX_RETRIEVAL_KEY"):
        authkey_for("10.1.2.3")
    assert authkey_for("10.1.2.3", "k") == b"k" and authkey_for("127.0.0.1")
    assert parse_address("remote:example.org:80") == ("example.org", 80)


def test_serve_cli_errors(indexed, tmp_path, capsys):
    from lookahead_jax.retrieval.cli import main

    path, cache = indexed
    assert main(["serve", "--corpus", str(path), "--retriever", "bm25", "--out", str(tmp_path)]) == 2
    assert "python -m lookahead_jax.retrieval build" in capsys.readouterr().err  # no index there
    with socket.socket() as s:  # the port taken
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--corpus", str(path), "--retriever", "bm25", "--out", str(cache),
                     "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
