"""The OpenAI-compatible server (`lookahead_jax.serve`), started in this process on a free
port and driven by the real `openai` client (and httpx for raw bodies).

* Completions and chat completions, streaming and not, give offline `generate`'s tokens.
* Lossless under continuous batching: 9 concurrent requests of other lengths, prompts,
  kinds and strategies (lookahead, and plain decoding asked per request) on 4 slots, each
  equal to `generate` alone with the same options.
* Chunked prefill: a long prompt prefilled in blocks while short requests decode gives
  generate's tokens (a second server, prefill_chunk=32); bad --prefill-chunk values.
* A stream the client abandons frees its slot; malformed bodies get 400 with a message
  naming the field; a full waiting queue gets 429; a failing step fails its requests
  with 500 and the server goes on; /metrics, /v1/models, /health, /tokenize, /detokenize.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lookahead_jax.fetch import status  # noqa: E402
from lookahead_jax.generate import generate  # noqa: E402
from lookahead_jax.serve import ServeConfig, make_server, start_in_thread  # noqa: E402
from tiny import load_prompts  # noqa: E402

MAX_LEN = 512
SLOTS = 4
TEXTS = [p["prompt"][:240] for p in load_prompts(3)]  # 9 prompts: RAG / code / math


@pytest.fixture(scope="module")
def loaded():
    """(model, tokenizer, name): SmolLM2-135M when installed, else the tiny model."""
    if status("smollm2-135m") != "not installed":
        import lookahead_jax as lj

        model, tok = lj.load("smollm2-135m", progress=False)
        return model, tok, "smollm2-135m"
    from tiny import ByteTokenizer, tiny_model

    return tiny_model("llama", seed=1), ByteTokenizer(), "tiny"


@pytest.fixture(scope="module")
def server(loaded):
    """A lookahead server (fixed decoding length: one verify bucket) on 4 slots."""
    model, tok, name = loaded
    cfg = ServeConfig(model=name, strategy="lookahead", strategy_options=(("decoding_length", 16),),
                      max_batch=SLOTS, max_len=MAX_LEN, max_waiting=64, warmup="none")  # (steps compile at first use)
    srv = make_server(cfg, model, tok)
    uv, thread, srv.url = start_in_thread(srv)
    yield srv
    uv.should_exit = True
    thread.join(60)
    assert not srv.scheduler.alive  # the lifespan drained and stopped the engine thread


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def offline(loaded, prompts, max_new, **kw):
    """generate's tokens for `prompts`, decoded in batches of SLOTS rows (padded with other
    prompts): the server's shapes, so its compiled steps serve both (rows do not depend on
    each other)."""
    model, tok, _ = loaded
    out = []
    for i in range(0, len(prompts), SLOTS):
        part = prompts[i:i + SLOTS]
        pad = TEXTS[:SLOTS - len(part)]
        out += generate(model, tok, part + pad, max_new_tokens=max_new, max_cache_len=MAX_LEN,
                        **kw).token_ids[:len(part)]
    return out


def ids_of(choice):
    return list(getattr(choice, "token_ids", None) or [])


def run_one(client, name, kind, prompt, max_new, stream, strategy):
    """One request through the openai client; (token ids, text)."""
    extra = {"return_token_ids": True, "lookahead_jax": {"strategy": strategy} if strategy else {}}
    common = dict(model=name, max_tokens=max_new, temperature=0, stream=stream, extra_body=extra)
    if kind == "chat":
        r = client.chat.completions.create(messages=prompt, **common)
        if not stream:
            return ids_of(r.choices[0]), r.choices[0].message.content
        ids, text = [], ""
        for ch in r:
            for c in ch.choices:
                ids += ids_of(c)
                text += c.delta.content or ""
        return ids, text
    r = client.completions.create(prompt=prompt, **common)
    if not stream:
        return ids_of(r.choices[0]), r.choices[0].text
    ids, text = [], ""
    for ch in r:
        for c in ch.choices:
            ids += ids_of(c)
            text += c.text or ""
    return ids, text


def test_completion_and_chat_stream_and_not(loaded, server, client):
    name = server.model_name
    msgs = [{"role": "user", "content": "Name three colours."}]
    want_chat, want = offline(loaded, [msgs, "The capital of France is"], 16)
    whole, streamed = (run_one(client, name, "chat", msgs, 16, stream, None) for stream in (False, True))
    assert whole[0] == streamed[0] == want_chat
    assert whole[1] == streamed[1] and whole[1]
    a = run_one(client, name, "completion", "The capital of France is", 16, False, None)
    b = run_one(client, name, "completion", "The capital of France is", 16, True, None)
    assert a[0] == b[0] == want and a[1] == b[1]
    r = client.completions.create(model=name, prompt="One, two,", max_tokens=5, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens == 5
    assert all(x <= 0 for x in lp.token_logprobs)


def test_lossless_under_continuous_batching(loaded, server, client):
    """9 requests (3 lengths, chat and completion, streamed or not, lookahead or plain) on 4
    slots: each is inserted while others decode, and gives generate's greedy tokens."""
    name = server.model_name
    cases = []
    for i, text in enumerate(TEXTS):
        kind = "chat" if i % 3 == 1 else "completion"
        prompt = [{"role": "user", "content": text}] if kind == "chat" else text
        cases.append((kind, prompt, (8, 24, 40)[i % 3], i % 2 == 0, "greedy" if i % 4 == 3 else None))
    refs = {}
    for max_new in (8, 24, 40):  # one batch per length
        group = [c for c in cases if c[2] == max_new]
        refs.update({id(c): ids for c, ids in zip(group, offline(loaded, [c[1] for c in group], max_new))})
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        futs = {id(c): pool.submit(run_one, client, name, *c) for c in cases}
        got = {k: f.result()[0] for k, f in futs.items()}
    for c in cases:
        assert got[id(c)] == refs[id(c)], c[:3]
    assert server.scheduler.running == {}


def test_cancelled_stream_frees_its_slot(server, client):
    sched = server.scheduler
    before = sched.metrics.success.labels(server.model_name, "abort")._value.get()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json=dict(prompt="Count from one to a thousand:", max_tokens=400, temperature=0,
                                stream=True)) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    deadline = time.time() + 60
    # (the earlier tests' chat answers queue prefix-cache warm jobs, which take a free slot
    # while nothing runs: wait for them too; `warm_pending` covers a job from the moment it
    # leaves the queue until its slot is free again)
    while (sched.running or sched.waiting or sched.warm_pending) and time.time() < deadline:
        time.sleep(0.05)
    assert sched.running == {} and not sched.warm_pending and len(sched.slots.free_slots) == SLOTS
    assert sched.metrics.success.labels(server.model_name, "abort")._value.get() == before + 1
    r = client.completions.create(model=server.model_name, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "prompt"),  # no prompt
    ({"prompt": 3}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"prompt": "hi " * 600, "max_tokens": 4}, "maximum context length"),
    ({"prompt": "hi", "max_tokens": 100000}, "maximum context length"),
    ({"prompt": "hi", "lookahead_jax": {"strategy": "ralm"}}, "lookahead_jax.strategy"),
    ({"prompt": "hi", "lookahead_jax": {"bogus": 1}}, "bogus"),
    ({"prompt": "hi", "lookahead_jax": {"return_retrieval": True}}, "retrieves nothing"),
    ({"prompt": [999999]}, "token ids"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_malformed_requests_get_400(server, body, field):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] or err["param"] == field, err
    assert err["code"] == 400


def test_bad_json_chat_and_model_errors(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_full_queue_gets_429(server):
    """With admission held (the engine thread admits nothing), requests fill the waiting
    queue; past max_waiting the next one gets 429; once released, the held ones are
    served or (their clients gone) cancelled."""
    sched = server.scheduler
    old = sched.max_waiting
    streams = []
    sched._admit = lambda: None  # this instance only: jobs stay waiting
    try:
        sched.max_waiting = 2
        # chat streams answer at once (their role chunk), before a slot is free
        body = dict(messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, temperature=0,
                    stream=True)
        http = httpx.Client(timeout=120)
        for _ in range(2):
            s = http.stream("POST", server.url + "/v1/chat/completions", json=body)
            streams.append(s)
            s.__enter__()
        assert len(sched.waiting) == 2
        r = http.post(server.url + "/v1/completions", json=dict(prompt="hi", max_tokens=2))
        assert r.status_code == 429 and "waiting" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "RateLimitError"
    finally:
        del sched._admit
        sched.max_waiting = old
        for s in streams:
            s.__exit__(None, None, None)
    wait_idle(sched)


def wait_idle(sched, quiet_s: float = 1.0, timeout_s: float = 120.0) -> None:
    """Until the scheduler has held no job for `quiet_s` on end (a job popped from the
    queue is in neither `waiting` nor `running` while it is admitted: one empty look is
    not enough)."""
    deadline, quiet_since = time.time() + timeout_s, None
    while time.time() < deadline:
        if sched.running or sched.waiting:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since >= quiet_s:
            return
        time.sleep(0.02)
    raise AssertionError(f"the scheduler still holds jobs after {timeout_s} s: {sched.running}, {sched.waiting}")


def test_a_failing_step_fails_its_requests_not_the_server(server, client):
    sched = server.scheduler
    wait_idle(sched)  # earlier tests' requests done: the injected failure meets this test's request
    slots = sched.slots

    def boom():
        raise RuntimeError("injected step failure")

    slots.step = boom  # this Slots object only: the scheduler rebuilds its slots after the failure
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        client.completions.create(model=server.model_name, prompt="Hi", max_tokens=5, temperature=0)
    assert sched.alive and sched.slots is not slots
    r = client.completions.create(model=server.model_name, prompt="Hi", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5


def test_metrics_models_tokenize(server, client):
    text = httpx.get(server.url + "/metrics").text
    for metric in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                   "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                   "prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                   "num_requests_waiting", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                   "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"lookahead_jax:{metric}" in text, metric
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("lookahead_jax:") and "per_pos" not in line}
    assert values["lookahead_jax:time_to_first_token_seconds_count"] >= 10
    assert values["lookahead_jax:spec_decode_num_drafts_total"] > 0
    assert 0 < values["lookahead_jax:spec_decode_num_accepted_tokens_total"] <= \
        values["lookahead_jax:spec_decode_num_draft_tokens_total"]
    assert [m.id for m in client.models.list().data] == [server.model_name]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith(
        "Hello world")


@pytest.mark.slow
def test_sampled_requests_equal_generate(loaded, server, client):
    """n samples at temperature > 0 (a seed), with penalties: generate's rows."""
    name = server.model_name
    r = client.completions.create(model=name, prompt="Once upon a time", max_tokens=12, temperature=0.8,
                                  top_p=0.9, seed=7, n=2, presence_penalty=0.5, extra_body={"return_token_ids": True})
    out = generate(loaded[0], loaded[1], ["Once upon a time"], max_new_tokens=12, max_cache_len=MAX_LEN,
                   temperature=0.8, top_p=0.9, seed=7, n=2, presence_penalty=0.5)
    assert [ids_of(c) for c in r.choices] == out.token_ids


def test_chunked_prefill_server_equals_generate(loaded):
    """A second server with 32-token prefill blocks: a long prompt (many blocks) sent with
    short ones, all concurrent, each equal to offline generate."""
    model, tok, name = loaded
    cfg = ServeConfig(model=name, strategy="lookahead", strategy_options=(("decoding_length", 16),),
                      max_batch=SLOTS, max_len=MAX_LEN, max_waiting=64, prefill_chunk=32, warmup="none")
    srv = make_server(cfg, model, tok)
    uv, thread, url = start_in_thread(srv)
    try:
        chunked = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        long_prompt = " ".join(p["prompt"] for p in load_prompts()[:3])[:1200]
        while len(tok.encode(long_prompt)) > 300:  # the cache holds MAX_LEN (byte tokens: the tiny model)
            long_prompt = long_prompt[:-50]
        assert len(tok.encode(long_prompt)) > 8 * 32
        cases = [("completion", t, 16, i % 2 == 0, None) for i, t in enumerate([long_prompt] + TEXTS[:3])]
        want = offline(loaded, [c[1] for c in cases], 16)
        with cf.ThreadPoolExecutor(len(cases)) as pool:
            futs = [pool.submit(run_one, chunked, name, *c) for c in cases]
            got = [f.result()[0] for f in futs]
        assert got == want
        sched = srv.scheduler
        assert sched.slots.prefill_chunk == 32 and sched.running == {} and sched.slots.prefilling == []
    finally:
        uv.should_exit = True
        thread.join(60)


def test_bad_prefill_chunk_is_an_error():
    from lookahead_jax.serve.__main__ import parse

    for bad in (1, -2, 2.5):
        with pytest.raises(ValueError, match="--prefill-chunk must be 0"):
            make_server(ServeConfig(prefill_chunk=bad))
    assert parse(["--prefill-chunk", "none"]).prefill_chunk == 0
    assert parse(["--prefill-chunk", "96"]).prefill_chunk == 96
    with pytest.raises(SystemExit):
        parse(["--prefill-chunk", "1"])


def test_step_budget_option():
    """--step-budget K reaches the slots (0, the default: one prefill block a step); below
    1 it is an error naming the flag."""
    from lookahead_jax.serve.__main__ import parse

    assert parse([]).step_budget is None and parse(["--step-budget", "3"]).step_budget == 3.0
    with pytest.raises(ValueError, match="--step-budget must be >= 1"):
        make_server(ServeConfig(step_budget=0.5))


def test_a_stopped_server_is_freed():
    """A server started, asked once and stopped is garbage once its caller drops it: the
    app's routes (which FastAPI keeps in process-wide caches) must not hold the Server, or
    every server a process starts keeps its engine, model and KV caches."""
    import gc
    import weakref

    from tiny import ByteTokenizer, tiny_model

    srv = make_server(ServeConfig(model="tiny", strategy="greedy", max_batch=2, max_len=128, warmup="none"),
                      tiny_model("llama", seed=1), ByteTokenizer())
    uv, thread, url = start_in_thread(srv)
    try:
        r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="hi", max_tokens=2), timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        uv.should_exit = True
        thread.join(60)
    ref = weakref.ref(srv)
    del srv, uv, thread
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_health_tells_the_warm_up_and_requests_wait_for_its_minimum_set():
    """While the minimum set of step programs compiles, /health answers 503 with the
    progress and a request waits (nothing is admitted); once it is compiled, /health is 200,
    the request is answered, and /metrics and /health count the configuration's programs,
    none compiled on the request path."""
    from tiny import ByteTokenizer, tiny_model

    srv = make_server(ServeConfig(model="tiny", strategy="lookahead", max_batch=2, max_len=256, prefill_chunk=32,
                                  warmup="none"), tiny_model("llama", seed=3), ByteTokenizer())
    sched = srv.scheduler
    sched.ready.clear()  # as `warm_up_in_background` does before its thread starts (here: when the test says)
    uv, thread, url = start_in_thread(srv)
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up" and r.json()["ready"] is False
        with cf.ThreadPoolExecutor(1) as pool:
            ask = pool.submit(httpx.post, url + "/v1/completions",
                              json=dict(model="tiny", prompt="hello there", max_tokens=4), timeout=300)
            time.sleep(1.0)
            assert not ask.done() and sched.running == {}  # waits for the warm-up
            sched.warm_up_in_background().join(300)
            assert ask.result().status_code == 200
        body = httpx.get(url + "/health").json()
        assert body["status"] == "ok" and body["programs_total"] == len(sched.slots.programs())
        assert body["programs_ready"] >= body["programs_minimum"] > 0 and body["compiled_in_requests"] == 0
        metrics = httpx.get(url + "/metrics").text
        assert f'lookahead_jax:programs_total{{model_name="tiny"}} {float(body["programs_total"])}' in metrics
        assert "lookahead_jax:programs_compiled" in metrics and "lookahead_jax:compile_seconds" in metrics
    finally:
        uv.should_exit = True
        thread.join(60)
