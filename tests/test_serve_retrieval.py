"""The retrieval strategies (ralm, ralmspec, knnlm) through the OpenAI-compatible server,
on the tiny llama + byte tokenizer, a corpus of the model's own words (so the top-1
passage really changes) with its BM25 index built in a temporary cache, and a KNN-LM
datastore built from it. Servers are configured as `python -m lookahead_jax.serve` parses
its flags, started in this process and driven by the real `openai` client.

* Concurrent chat and completion requests (streamed or not) on 3 slots give offline
  `generate`'s tokens with the same strategy options, and the same passages
  (`lookahead_jax.return_retrieval`); ralm also with a sampled request among greedy ones
  (the slots are rebuilt for its values); knnlm plain and speculative give plain
  KNN-LM's tokens and log-probabilities.
* The speculation counters reach /metrics, equal to the run's own.
* A missing index or datastore stops the server at startup with the command that builds
  it; plain decoding asked of a retrieval server, and a prompt + completion that leave no
  room for the passage, get 400 with a message.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("bm25s")
pytest.importorskip("Stemmer")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lookahead_jax import retrieval as R  # noqa: E402
from lookahead_jax.generate import generate  # noqa: E402
from lookahead_jax.serve import make_server, start_in_thread  # noqa: E402
from lookahead_jax.serve.__main__ import main as serve_main, parse as serve_parse  # noqa: E402
from tiny import load_prompts, own_word_passages  # noqa: E402

MAX_LEN = 512
SLOTS = 3
MAX_NEW = 20
PROMPTS = [r["prompt"][:60] for r in load_prompts(2)]  # 6 prompts, 3 sources
RALM = dict(retriever="bm25", stride=2, query_tokens=16, max_passage_tokens=96)


@pytest.fixture(scope="module")
def corpus_path(model, tok, tmp_path_factory):
    """passages.jsonl of 60 passages (one titled) from the model's own words, its BM25
    index built in a cache of this module's own (LOOKAHEAD_JAX_CACHE, set for the module)."""
    passages = own_word_passages(model, tok, PROMPTS, 60, 40)
    d = tmp_path_factory.mktemp("serve-retrieval")
    path = d / "passages.jsonl"
    path.write_text(R.Corpus.from_passages(passages).to_jsonl())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOKAHEAD_JAX_CACHE", str(d / "cache"))
        R.build_index("bm25", str(path), progress=False)
        yield path


@pytest.fixture(scope="module")
def datastore(model, tok, corpus_path):
    from lookahead_jax.knnlm import build_datastore

    return build_datastore(model, tok, str(corpus_path), path=corpus_path.parent / "ds", progress=False)


def flags(strategy, **options):
    """The command line of a server of `strategy` on SLOTS slots."""
    argv = ["--model", "tiny", "--strategy", strategy, "--max-batch", str(SLOTS), "--max-len", str(MAX_LEN)]
    for k, v in options.items():
        argv += ["--option", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return argv


@contextlib.contextmanager
def serving(model, tok, argv):
    """A server configured from `argv` (as `python -m lookahead_jax.serve` parses it):
    (server, openai client). Without a `--warmup` in argv: none (steps compile at first use)."""
    srv = make_server(serve_parse(argv if "--warmup" in argv else argv + ["--warmup", "none"]), model, tok)
    uv, thread, url = start_in_thread(srv)
    srv.url = url
    try:
        yield srv, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        uv.should_exit = True
        thread.join(60)
    assert not srv.scheduler.alive


def ask(client, prompt, stream=False, **kw):
    """One request (chat when `prompt` is messages): (token ids, finish reason, retrieval
    record, log-probabilities or None)."""
    kw = dict(dict(model="tiny", max_tokens=MAX_NEW, temperature=0, stream=stream,
                   extra_body={"return_token_ids": True, "lookahead_jax": {"return_retrieval": True}}), **kw)
    chat = isinstance(prompt, list)
    r = client.chat.completions.create(messages=prompt, **kw) if chat else \
        client.completions.create(prompt=prompt, **kw)
    chunks = list(r) if stream else [r]
    ids, finish, rec, lps = [], None, None, None
    for ch in chunks:
        for c in ch.choices:
            ids += list(getattr(c, "token_ids", None) or [])
            finish = c.finish_reason or finish
            rec = getattr(c, "retrieval", None) or rec
            if not chat and c.logprobs is not None:
                lps = (lps or []) + list(c.logprobs.token_logprobs)
    return ids, finish, rec, lps


def concurrently(client, cases):
    """Every (prompt, stream, options) case at once; their `ask` results in order."""
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        futs = [pool.submit(ask, client, p, s, **kw) for p, s, kw in cases]
        return [f.result() for f in futs]


def metrics(srv) -> dict:
    text = httpx.get(srv.url + "/metrics").text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("lookahead_jax:")}


def chats(idx):
    return [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPTS[i]}]
            for i in idx]


def offline(model, tok, prompts, strategy, **kw):
    """generate's rows (the server's cache length: its compiled steps serve both)."""
    return generate(model, tok, prompts, strategy=strategy, max_new_tokens=MAX_NEW, max_cache_len=MAX_LEN,
                    **kw).rows


def assert_passages(rec, row, corpus):
    """The choice's retrieval record says what generate's row does, with the titles."""
    assert [(p["from_token"], p["position"], p["id"]) for p in rec["passages"]] == \
        [(p["from_token"], p["position"], p["id"]) for p in row.retrieval["passages"]]
    assert all(p["title"] == corpus[p["position"]].title for p in rec["passages"])
    assert rec["reprefills"] == row.retrieval["reprefills"]


# ------------------------------------------------------------------------- ralm / ralmspec
def test_ralmspec_concurrent_requests_equal_generate(model, tok, corpus_path):
    """6 requests (4 chats, one streamed, 2 completions) on 3 slots: generate's tokens and
    passages; the run's speculation counters on /metrics; plain decoding and a completion
    with no room for the passage are refused with 400."""
    opts = dict(RALM, corpus=corpus_path, speculation_stride=2)
    corpus = R.load_corpus(str(corpus_path))
    msgs, texts = chats([0, 1, 2, 3]), PROMPTS[4:6]
    with serving(model, tok, flags("ralmspec", **opts)) as (srv, client):
        got = concurrently(client, [(m, i == 1, {}) for i, m in enumerate(msgs)] + [(t, False, {}) for t in texts])
        m = metrics(srv)
        run = srv.scheduler.slots.run.summary()["retrieval"]
        plain = httpx.post(srv.url + "/v1/chat/completions", json=dict(
            messages=msgs[0], max_tokens=4, lookahead_jax={"strategy": "greedy"}))
        long = httpx.post(srv.url + "/v1/completions", json=dict(prompt=PROMPTS[0], max_tokens=MAX_LEN - 80))
        with pytest.raises(openai.BadRequestError, match="its own requests"):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=4,
                                      extra_body={"lookahead_jax": {"strategy": "greedy"}})
    want = offline(model, tok, msgs, "ralmspec", **opts) + offline(model, tok, texts, "ralmspec", **opts)
    for (ids, finish, rec, _), row in zip(got, want):
        assert ids == row.token_ids and finish == {"eos": "stop"}.get(row.finish_reason, row.finish_reason)
        assert_passages(rec, row, corpus)
        assert rec["speculations"] == row.retrieval["speculations"]
    assert sum(len(rec["passages"]) for _, _, rec, _ in got) > len(got)  # passages change mid-answer
    P = "lookahead_jax:retrieval_"
    for metric, counter in (("calls", "retrieval_calls"), ("queries", "retrievals"), ("reprefills", "reprefills"),
                            ("speculations", "speculations"), ("speculation_checks", "speculation_checks"),
                            ("speculation_hits", "speculation_hits"), ("rollbacks", "rollbacks"),
                            ("rollback_tokens", "rollback_tokens"), ("verify_calls", "verify_calls")):
        assert m.get(P + metric + "_total", 0) == run[counter], metric  # a counter never incremented is not listed
    assert m[P + "speculation_checks_total"] > 0 and m[P + "verify_calls_total"] > 0
    assert m[P + "seconds_total"] > 0
    assert plain.status_code == 400 and "--strategy greedy" in plain.json()["error"]["message"]
    assert plain.json()["error"]["param"] == "lookahead_jax.strategy"
    assert long.status_code == 400 and "for the retrieved passage" in long.json()["error"]["message"]


def test_ralm_greedy_and_sampled_requests_equal_generate(model, tok, corpus_path):
    """ralm on 3 slots: 4 greedy requests and a sampled one (its own sampling values: the
    slots wait for it and are rebuilt) each give generate's tokens and passages."""
    opts = dict(RALM, corpus=corpus_path)
    corpus = R.load_corpus(str(corpus_path))
    msgs = chats([1, 3])
    sampled = dict(temperature=0.8, seed=5)
    cases = [(msgs[0], False, {}), (PROMPTS[0], True, {}), (PROMPTS[2], False, sampled), (msgs[1], True, {}),
             (PROMPTS[5], False, {})]
    with serving(model, tok, flags("ralm", **opts)) as (srv, client):
        got = concurrently(client, cases)
        m = metrics(srv)
        assert srv.scheduler.per_request_sampling is False  # the slots refused other values: rebuilt
    want = offline(model, tok, msgs, "ralm", **opts) + offline(model, tok, [PROMPTS[0], PROMPTS[5]], "ralm", **opts)
    want = [want[0], want[2], offline(model, tok, [PROMPTS[2]], "ralm", **opts, **sampled)[0], want[1], want[3]]
    for (ids, _, rec, _), row, case in zip(got, want, cases):
        assert ids == row.token_ids, case
        assert_passages(rec, row, corpus)
    assert m["lookahead_jax:retrieval_queries_total"] >= len(cases)
    assert "lookahead_jax:retrieval_speculations_total" not in m  # ralm does not speculate


# ------------------------------------------------------------------------- knnlm
@pytest.mark.parametrize("speculative", [False, True])
def test_knnlm_concurrent_requests_equal_plain_knnlm(model, tok, datastore, speculative):
    """KNN-LM on 3 slots, plain and speculative: 4 concurrent requests give plain KNN-LM's
    tokens (completions: and log-probabilities) from offline generate."""
    opts = dict(datastore=datastore, knn_k=4)
    msgs = chats([2])
    cases = [(PROMPTS[1], False, dict(logprobs=0)), (msgs[0], True, {}), (PROMPTS[3], True, dict(logprobs=0)),
             (PROMPTS[4], False, dict(logprobs=0))]
    with serving(model, tok, flags("knnlm", **opts, speculative=speculative, speculation_stride=3)) as (srv, client):
        got = concurrently(client, cases)
        m = metrics(srv)
        run = srv.scheduler.slots.run.summary()["retrieval"]
    texts = [PROMPTS[1], PROMPTS[3], PROMPTS[4]]
    rows = offline(model, tok, texts, "knnlm", logprobs=True, **opts)
    want = [rows[0], offline(model, tok, msgs, "knnlm", **opts)[0], rows[1], rows[2]]
    for (ids, _, rec, lps), row, case in zip(got, want, cases):
        assert ids == row.token_ids, case
        if "logprobs" in case[2]:
            assert lps == row.logprobs and len(lps) == len(ids)
        assert rec["searches"] > 0 and ("speculations" in rec) == speculative
    assert m["lookahead_jax:retrieval_calls_total"] == run["search_calls"]
    assert m["lookahead_jax:retrieval_queries_total"] == run["searches"]
    if speculative:
        assert 0 < m["lookahead_jax:retrieval_speculation_checks_total"] == run["speculation_checks"]
        assert m["lookahead_jax:retrieval_speculations_total"] == run["speculations"]
    else:
        assert "lookahead_jax:retrieval_speculations_total" not in m


@pytest.mark.parametrize("strategy,speculative", [("knnlm", False), ("knnlm", True), ("ralmspec", None)])
def test_retrieval_steps_compile_in_the_warm_up(tok, corpus_path, tmp_path, strategy, speculative):
    """A retrieval run's own jitted steps, which the program inventory cannot list
    (KNN-LM's forward, search, mixture and speculative rounds; ralmspec's are the listed
    ones), are compiled by the warm-up's rehearsal request (on slots of its own), and for
    speculative KNN-LM the verification search of every round length is queued there too,
    so requests compile nothing; /health reports none compiled in them."""
    from lookahead_jax.knnlm import build_datastore
    from tiny import tiny_model

    fresh = tiny_model("llama", seed=11)  # an engine of its own: what compiles is this test's
    if strategy == "knnlm":
        ds = build_datastore(fresh, tok, str(corpus_path), path=tmp_path / "ds", progress=False)
        argv = flags("knnlm", datastore=ds, knn_k=4, speculative=speculative, speculation_stride=3)
    else:
        argv = flags("ralmspec", **dict(RALM, corpus=corpus_path, speculation_stride=2))
    srv = make_server(serve_parse(argv), fresh, tok)
    compiled = srv.scheduler.engine.compiled
    srv.scheduler.warm_up(wait="all")
    compiled.settle()  # (what the warm-up queued in the background)
    n = len(compiled.compilations)
    uv, thread, url = start_in_thread(srv)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        got = concurrently(client, [(PROMPTS[1], False, {}), (chats([2])[0], True, {}), (PROMPTS[3], False, {})])
        health = httpx.get(url + "/health").json()
        run = srv.scheduler.slots.run.summary()["retrieval"]
    finally:
        uv.should_exit = True
        thread.join(60)
    assert all(ids for ids, *_ in got) and run["searches" if strategy == "knnlm" else "retrievals"] > 0
    assert compiled.compilations[n:] == []
    assert health["compiled_in_requests"] == 0


# ------------------------------------------------------------------------- startup errors
def test_a_missing_index_stops_the_server_at_startup(model, tok, corpus_path, monkeypatch, capsys):
    """The command (`main`) on an index, corpus or datastore that is not there: the `error:`
    line naming the fix, exit status 2 (a missing retriever before it listens; the rest
    once the port is open and the server is built behind it, which then stops)."""
    import socket

    import lookahead_jax.loading as loading

    other = corpus_path.parent / "unindexed.jsonl"
    other.write_text(R.Corpus.from_passages(["one passage", "another passage"]).to_jsonl())
    with pytest.raises(R.IndexNotBuilt, match=r"python -m lookahead_jax\.retrieval build .*--retriever bm25"):
        make_server(serve_parse(flags("ralmspec", retriever="bm25", corpus=other)), model, tok)
    monkeypatch.setattr(loading, "load", lambda *a, **k: (model, tok))  # `--model tiny`
    monkeypatch.setattr(loading, "vocab_size", lambda name: None)  # (its name checked before listening)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = ["--port", str(sock.getsockname()[1]), "--warmup", "none"]
    cases = [(flags("ralm", retriever="bm25", corpus=other), "lookahead_jax.retrieval build"),
             (flags("ralm", retriever="bm25", corpus=other.parent / "nope.jsonl"), "corpus file not found"),
             (flags("ralm"), "needs a retriever"),
             (flags("knnlm", datastore=other.parent / "no-datastore"), "lookahead_jax.knnlm build")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            serve_main(argv + port)
        assert e.value.code == 2
        err = "\n" + capsys.readouterr().err  # (uvicorn's lines first, where it listened)
        assert "\nerror: " in err and message in err[err.index("\nerror: "):], err
    with pytest.raises(SystemExit):
        serve_parse(flags("ralm", retriever="bm25", decoding_length=7))
    assert "not an option of strategy 'ralm'" in capsys.readouterr().err
