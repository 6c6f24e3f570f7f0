"""The OpenAI surface real clients send (issue 52), on the real server path (a tiny model
served in this process, driven by httpx and the `openai` client).

* Chat messages: content as a list of parts (text joined; an image part is a 400 naming
  it), role `developer` (the template's system turn), assistant `tool_calls` with null
  content and `tool` messages rendered by a template that renders them, and a 400 from
  one that cannot (tools too); `prediction` reaches lookahead as a reference.
* Nothing accepted and ignored: every field of the openai package's completion and chat
  request types is applied, a label, or refused with a 400 naming it; unknown fields too.
  `stream_options.continuous_usage_stats` puts the usage on every chunk.
* `/v1/models/{id}`, `/tokenizer_info`, and OpenAI's error shape for unknown routes, wrong
  methods, bodies that are not UTF-8 or not JSON, and validation errors.
* The advertised context length is the accepted one: exactly it runs, one more is a 400.
* `num_requests_running` returns to 0; a dropped non-streaming request logs one line.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from lookahead_jax.serve import ServeConfig, make_server, start_in_thread  # noqa: E402
from tiny import ByteTokenizer, tiny_model  # noqa: E402

NAME = "tiny"


class ToolTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template that renders tools, tool calls and tool
    results, as Hugging Face templates take them (`tools=`, `tool_calls` on the assistant
    turn, its arguments an object)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        head = "<tools>" + json.dumps([t["function"]["name"] for t in tools]) + "\n" if tools else ""
        turns = "".join(f"<{m['role']}>{m['content']}" + "".join(
            f"<call>{c['function']['name']}({json.dumps(c['function']['arguments'])})</call>"
            for c in m.get("tool_calls", ())) + "\n" for m in messages)
        return head + turns + ("<assistant>" if add_generation_prompt else "")


def serve(tokenizer, **kw):
    cfg = ServeConfig(model=NAME, strategy="lookahead", strategy_options=(("decoding_length", 4),), max_batch=2,
                      max_len=160, **{"warmup": "none", **kw})  # (steps compile at first use)
    srv = make_server(cfg, tiny_model("llama", seed=1), tokenizer)
    uv, thread, srv.url = start_in_thread(srv)
    return srv, uv, thread


def served(tokenizer):
    """`serve(tokenizer)` for a fixture: yields the server, stops it after the module."""
    srv, uv, thread = serve(tokenizer)
    yield srv
    uv.should_exit = True
    thread.join(60)


@pytest.fixture(scope="module")
def server():
    """A lookahead server whose chat template renders tools (`ToolTokenizer`)."""
    yield from served(ToolTokenizer())


@pytest.fixture(scope="module")
def plain():
    """A server whose chat template renders no tools nor tool calls (`ByteTokenizer`'s)."""
    yield from served(ByteTokenizer())


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=120, **kw)


def refused(r, param, *words):
    """A 400 in OpenAI's error shape naming `param`, its message holding `words`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError", err
    for w in words:
        assert w in err["message"], err
    return err["message"]


def chat(srv, messages, **kw):
    return post(srv, "/v1/chat/completions", dict(messages=messages, max_tokens=2, temperature=0,
                                                  return_token_ids=True, **kw))


def prompt_text(r) -> str:
    assert r.status_code == 200, r.text
    return ByteTokenizer().decode(r.json()["prompt_token_ids"][0])


# ---------------------------------------------------------------------------- chat messages
def test_content_parts_and_the_developer_role(server):
    """Text parts are joined with newlines; `developer` is the template's system turn: the
    same prompt as strings and `system`. Any other part is a 400 naming it."""
    parts = chat(server, [{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                            {"type": "text", "text": "Be kind."}]},
                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    plain_strings = chat(server, [{"role": "system", "content": "Be brief.\nBe kind."},
                                  {"role": "user", "content": "Hi"}])
    assert prompt_text(parts) == prompt_text(plain_strings) == "<system>Be brief.\nBe kind.\n<user>Hi\n<assistant>"
    for kind, part in (("image_url", {"image_url": {"url": "http://x/y.png"}}),
                       ("input_audio", {"input_audio": {"data": "AAAA", "format": "wav"}})):
        r = chat(server, [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       dict(type=kind, **part)]}])
        refused(r, "messages.0.content", f"content part 1 is an {kind!r} part", "text only")


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": CITY}}]


def test_tool_calls_and_results_reach_a_template_that_renders_them(server):
    text = prompt_text(chat(server, TOOL_TURNS))
    assert text == ('<user>Weather in Paris?\n<assistant><call>get_weather({"city": "Paris"})</call>\n'
                    "<tool>18C, sunny\n<assistant>")
    text = prompt_text(chat(server, TOOL_TURNS, tools=TOOLS, tool_choice="none"))
    assert text.startswith('<tools>["get_weather"]\n<user>')
    # the openai client's own types, end to end
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=NAME, messages=TOOL_TURNS, tools=TOOLS, tool_choice="none",
                                       max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    # tool calls are not parsed from the output: tools with tool_choice auto (the default) are refused
    for extra in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        refused(chat(server, TOOL_TURNS, tools=TOOLS, **extra), "tool_choice", "not parsed", '"none"')
    refused(chat(server, TOOL_TURNS, tools=TOOLS, tool_choice="none", parallel_tool_calls=False),
            "parallel_tool_calls", "not parsed")
    r = post(server, "/tokenize", dict(messages=TOOL_TURNS, tools=TOOLS))
    assert ByteTokenizer().decode(r.json()["tokens"]).startswith('<tools>["get_weather"]')


def test_a_template_that_cannot_render_tool_calls_is_a_400(plain):
    """The byte tokenizer's template drops `tool_calls` and takes no `tools`: a 400 that
    says so, not a prompt silently missing them. Its `tool` turns it does render."""
    refused(chat(plain, TOOL_TURNS), "messages", "chat template cannot render tool calls", "message 1")
    refused(chat(plain, TOOL_TURNS[:1], tools=TOOLS, tool_choice="none"), "tools", "cannot render tools")
    text = prompt_text(chat(plain, [TOOL_TURNS[0], {"role": "assistant", "content": "Let me look."},
                                    TOOL_TURNS[2]]))
    assert "<tool>18C, sunny\n" in text
    r = post(plain, "/tokenize", dict(messages=TOOL_TURNS))
    refused(r, "messages", "cannot render tool calls")


def test_messages_that_are_not_served_are_refused(server):
    refused(chat(server, [{"role": "assistant", "content": None}]), "messages.0", "null only on an assistant")
    refused(chat(server, [{"role": "user", "content": "x", "tool_calls": TOOL_TURNS[1]["tool_calls"]}]),
            "messages.0", "tool_calls are part of an assistant turn")
    refused(chat(server, [{"role": "function", "name": "f", "content": "x"}]), "messages.0.role")
    refused(chat(server, [{"role": "user", "content": "x", "audio": {"id": "a"}}]), "messages.0.audio", "text only")
    refused(chat(server, [{"role": "user", "content": "x", "mood": "happy"}]), "messages.0.mood", "unknown field")
    # an assistant message echoed back from a response, its null fields included, is taken
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "audio": None, "function_call": None,
              "tool_calls": None}
    assert chat(server, [TOOL_TURNS[0], echoed, {"role": "user", "content": "and?"}]).status_code == 200


def test_prediction_is_a_reference_lookahead_drafts_from(server):
    sched = server.scheduler
    seen = []
    submit = sched.submit
    sched.submit = lambda jobs: (seen.extend(jobs), submit(jobs))[1]  # this instance only
    try:
        r = chat(server, [{"role": "user", "content": "Fix the typo: teh cat"}],
                 prediction={"type": "content", "content": "the cat"})
    finally:
        del sched.submit
    assert r.status_code == 200 and seen
    assert seen[0].references == [ByteTokenizer().encode("the cat", add_special_tokens=False)]


# ---------------------------------------------------------------------------- nothing ignored
# what the server does with each field of OpenAI's request types (each listed once)
APPLIED = {
    "completion": ["prompt", "model", "max_tokens", "n", "stream", "stream_options", "stop", "temperature", "top_p",
                   "seed", "presence_penalty", "frequency_penalty", "logprobs", "echo", "logit_bias"],
    "chat": ["messages", "model", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
             "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
             "tools", "prediction", "logit_bias"],
}
# labels OpenAI defines with no effect on the output (abuse monitoring, dashboards, cache routing): taken
LABELS = {"completion": {"user": "u1"},
          "chat": {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s1", "prompt_cache_key": "c1"}}
# refused fields: a value other than the default, and a word its 400 must hold
REFUSED = {
    "completion": {"best_of": (3, "best_of"), "suffix": ("}", "suffix")},
    "chat": {"audio": ({"voice": "alloy", "format": "wav"}, "text"),
             "modalities": (["text", "audio"], "text"), "function_call": ("auto", "tool_choice"),
             "functions": ([{"name": "f"}], "tools"), "moderation": ({"policy": "default"}, "moderation"),
             "parallel_tool_calls": (True, "not parsed"), "prompt_cache_options": ({"mode": "explicit"}, "cache"),
             "prompt_cache_retention": ("24h", "cache"), "reasoning_effort": ("high", "reasoning"),
             "response_format": ({"type": "json_object"}, "not supported yet"), "service_tier": ("flex", "tier"),
             "store": (True, "stores nothing"), "tool_choice": ("auto", "not parsed"),
             "verbosity": ("low", "verbosity"), "web_search_options": ({}, "web search")},
}
STREAM_OPTIONS = {"applied": ["include_usage"], "refused": {"include_obfuscation": (True, "obfuscation")}}


def openai_fields(kind: str) -> set:
    """The fields of the openai package's request types, streaming variants included."""
    if kind == "completion":
        from openai.types import completion_create_params as params
    else:
        from openai.types.chat import completion_create_params as params
    names = set()
    for t in (params.CompletionCreateParamsBase, params.CompletionCreateParamsStreaming,
              params.CompletionCreateParamsNonStreaming):
        names |= set(t.__annotations__)
    return names


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_openai_field_is_applied_or_refused(server, kind):
    """Each field of OpenAI's request is applied (APPLIED: the request model declares it),
    a label (LABELS: taken), or refused with a 400 naming it at a non-default value
    (REFUSED); a field in none of them (a new SDK field) fails here until it is decided."""
    from lookahead_jax.serve.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if kind == "completion" else ChatCompletionRequest
    applied, labels, refuse = APPLIED[kind], LABELS[kind], REFUSED[kind]
    assert len(applied) == len(set(applied))
    assert not (set(applied) & set(labels)) and not (set(applied) & set(refuse)) and not (set(labels) & set(refuse))
    undecided = openai_fields(kind) - set(applied) - set(labels) - set(refuse)
    assert not undecided, f"OpenAI's {kind} request has fields this server neither applies nor refuses: {undecided}"
    assert set(applied) | set(labels) <= set(model.model_fields)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    base = dict(model=NAME, max_tokens=1, temperature=0)
    base.update(prompt="Hi") if kind == "completion" else base.update(messages=[{"role": "user", "content": "Hi"}])
    for field, (value, word) in refuse.items():
        refused(post(server, path, dict(base, **{field: value})), field, word)
    assert post(server, path, dict(base, **labels)).status_code == 200
    nulls = {f: None for f in ("n", "stream", "stop", "seed", "top_p", "presence_penalty", "frequency_penalty",
                               "logprobs", "user")}
    assert post(server, path, dict(base, **nulls)).status_code == 200  # OpenAI's null: the default
    streamed = dict(base, stream=True)
    from openai.types.chat import ChatCompletionStreamOptionsParam

    assert set(ChatCompletionStreamOptionsParam.__annotations__) == \
        set(STREAM_OPTIONS["applied"]) | set(STREAM_OPTIONS["refused"])
    for field, (value, word) in STREAM_OPTIONS["refused"].items():
        refused(post(server, path, dict(streamed, stream_options={field: value})), f"stream_options.{field}", word)
    refused(post(server, path, dict(base, stream_options={"include_usage": True})), "stream_options", "stream: true")
    refused(post(server, path, dict(base, best_effort=True)), "best_effort", "unknown field")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_logit_bias_is_applied(server, kind):
    """`logit_bias` {"<id>": 100} makes every token that id (the keys are token ids as
    strings, as OpenAI sends them; the openai client's too); -100 on the unbiased first
    token bans it; keys that are not token ids of the model and values out of [-100, 100]
    are a 400 naming logit_bias."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    base = dict(model=NAME, max_tokens=3, temperature=0, return_token_ids=True)
    base.update(prompt="Hi") if kind == "completion" else base.update(messages=[{"role": "user", "content": "Hi"}])

    def ids(bias):
        r = post(server, path, dict(base, logit_bias=bias))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert ids({"77": 100}) == [77] * 3
    first = ids(None)[0]
    assert ids({str(first): -100})[0] != first
    for bias, words in (({"abc": 1}, "token ids"), ({"77": 101}, "[-100, 100]"), ({"-3": 5}, "token ids"),
                        ({"100000": 5}, "[0, 259)"), ({str(i): 1 for i in range(301)}, "at most 300")):
        refused(post(server, path, dict(base, logit_bias=bias)), "logit_bias", words)
    assert post(server, path, dict(base, logit_bias={"77": "x"})).status_code == 400  # pydantic's type check
    if kind == "completion":
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0, logit_bias={"77": 100})
        assert r.choices[0].text == ByteTokenizer().decode([77] * 3)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats(server, kind):
    """`continuous_usage_stats`: every chunk carries the usage so far; `include_usage`
    alone: only the last chunk (no choices) carries it."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    body = dict(model=NAME, max_tokens=6, temperature=0, ignore_eos=True, stream=True)
    body.update(prompt="Hi") if kind == "completion" else body.update(messages=[{"role": "user", "content": "Hi"}])

    def chunks(options):
        with httpx.stream("POST", server.url + path, json=dict(body, stream_options=options), timeout=120) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all("usage" in c for c in every)
    done = [c["usage"]["completion_tokens"] for c in every]
    assert done == sorted(done) and done[-1] == 6 and every[-1]["choices"] == []
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in every)
    last = chunks({"include_usage": True})
    assert [("usage" in c) for c in last] == [False] * (len(last) - 1) + [True]
    assert last[-1]["usage"] == every[-1]["usage"]


# ---------------------------------------------------------------------------- endpoints, errors
def test_models_by_id_and_tokenizer_info(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    one = httpx.get(server.url + f"/v1/models/{NAME}")
    assert one.status_code == 200 and one.json() == listed[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(NAME).id == NAME
    r = httpx.get(server.url + "/v1/models/org/other-model")
    assert r.status_code == 404
    assert r.json()["error"] == dict(message=r.json()["error"]["message"], type="NotFoundError", param="model",
                                     code=404)
    assert "org/other-model" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == "ToolTokenizer" and info["model_max_length"] == listed[0]["max_model_len"]


def test_every_error_is_in_openai_shape(server):
    def error(r, status):
        assert r.status_code == status, r.text
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == status
        return body["error"]

    url = server.url
    assert "/v1/nothing" in error(httpx.get(url + "/v1/nothing"), 404)["message"]
    r = httpx.get(url + "/v1/completions")
    assert "GET is not allowed" in error(r, 405)["message"] and r.headers["allow"] == "POST"
    head = {"content-type": "application/json"}
    e = error(httpx.post(url + "/v1/completions", content=b'{"prompt": "\xff"}', headers=head), 400)
    assert e["message"] == "the body is not UTF-8: invalid start byte at byte 12"
    bad = '{"prompt": "hi",\n "max_tokens": 3 "n": 1}'
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(bad)
    e = error(httpx.post(url + "/v1/completions", content=bad.encode(), headers=head), 400)
    assert e["message"] == (f"the body is not valid JSON: Expecting ',' delimiter at line {want.value.lineno} "
                            f"column {want.value.colno}")
    e = error(post(server, "/v1/completions", dict(prompt="hi", max_tokens="many")), 400)
    assert e["param"] == "max_tokens" and e["message"].startswith("max_tokens: ")
    e = error(post(server, "/v1/chat/completions", dict(max_tokens=3)), 400)
    assert e["param"] == "messages" and e["message"] == "messages: required"
    e = error(post(server, "/v1/completions", ["hi"]), 400)
    assert "must be a JSON object" in e["message"]


# ---------------------------------------------------------------------------- context length
def test_the_advertised_context_length_is_the_accepted_one(server):
    """`/v1/models`' max_model_len is the most prompt + max_tokens a request may ask for:
    exactly that much runs to the end, one token more is a 400 (the verify block is
    reserved out of --max-len, not promised)."""
    sched = server.scheduler
    limit = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert limit == sched.max_len - (sched.max_nodes + 1) < sched.max_len
    assert post(server, "/tokenize", dict(prompt="hi")).json()["max_model_len"] == limit
    prompt = ByteTokenizer().encode("Count: one, two, three")
    body = dict(model=NAME, prompt=prompt, temperature=0, ignore_eos=True)
    r = post(server, "/v1/completions", dict(body, max_tokens=limit - len(prompt)))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == limit and r.json()["choices"][0]["finish_reason"] == "length"
    msg = refused(post(server, "/v1/completions", dict(body, max_tokens=limit - len(prompt) + 1)), "max_tokens")
    assert f"maximum context length is {limit} tokens" in msg
    long = [3 + i % 200 for i in range(limit)]
    refused(post(server, "/v1/completions", dict(body, prompt=long, max_tokens=1)), "prompt")
    assert post(server, "/v1/completions", dict(body, prompt=long[:-1], max_tokens=1)).status_code == 200


# ---------------------------------------------------------------------------- operations
def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(f"lookahead_jax:{name}{{"))
    return float(line.split()[-1])


def test_running_gauge_returns_to_zero(server):
    r = post(server, "/v1/completions", dict(model=NAME, prompt="Hello", max_tokens=8, ignore_eos=True))
    assert r.status_code == 200
    # the gauges themselves, set by the engine thread as requests finish (before any scrape,
    # which reads the scheduler's counts again): within moments of the answer
    m, deadline = server.metrics, time.time() + 10
    while m.running.labels(m.name)._value.get() != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert m.running.labels(m.name)._value.get() == 0 and m.waiting.labels(m.name)._value.get() == 0
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0


def test_a_dropped_request_logs_one_line(caplog):
    """A non-streaming request whose client goes away (here while it waits: the engine
    thread admits nothing until `ready`) is cancelled with one INFO line and no traceback."""
    srv = make_server(ServeConfig(model=NAME, strategy="greedy", max_batch=1, max_len=64, warmup="none"),
                      tiny_model("llama", seed=1), ByteTokenizer())
    srv.scheduler.ready.clear()  # as a warm-up does: requests wait (no warm-up here: they wait for good)
    uv, thread, url = start_in_thread(srv)
    uvicorn_log = logging.getLogger("uvicorn")  # (it does not propagate to the root, where caplog listens)
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    # the server's own logger too: an in-process CLI run earlier in this worker leaves the
    # library's logger at WARNING (`cli._run` without -v), which hid the line (CI of aaeeefb)
    caplog.set_level(logging.INFO, logger="lookahead_jax.serve")
    try:
        # The client leaves once its request waits in the scheduler, not after a fixed
        # time: on a loaded machine a 0.5 s client timeout could end before the server
        # had read the body, and then there is no request to cancel (CI of 3c2084e).
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(dict(prompt="Hello", max_tokens=4)).encode()
        client = socket.create_connection((host, int(port)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 60
        while not srv.scheduler.waiting and time.time() < deadline:
            time.sleep(0.05)
        assert srv.scheduler.waiting, "the request never reached the scheduler"
        client.close()
        while not any("went away" in r.getMessage() for r in caplog.records) and time.time() < deadline:
            time.sleep(0.05)
        srv.scheduler.ready.set()
        while srv.scheduler.waiting and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        uv.should_exit = True
        thread.join(60)
        uvicorn_log.removeHandler(caplog.handler)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].name == "lookahead_jax.serve"
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records]
    assert not srv.scheduler.waiting and not srv.scheduler.running


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(prompt="hi", max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(prompt="hi", max_tokens=4, min_tokens=9), "min_tokens"),
    ("/v1/completions", dict(prompt="hi", temperature=0, n=2), "n"),
    ("/v1/completions", dict(prompt="hi", logprobs=21), "logprobs"),
    ("/v1/completions", dict(prompt="hi", top_p=1.5), "top_p"),
    ("/v1/completions", dict(prompt="hi", top_k=-2), "top_k"),
    ("/v1/completions", dict(prompt="hi", seed=-1), "seed"),
    ("/v1/completions", dict(prompt="hi", presence_penalty=3), "presence_penalty"),
    ("/v1/chat/completions", dict(messages=CHAT, max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", dict(messages=CHAT, max_tokens=-1), "max_tokens"),
    ("/v1/chat/completions", dict(messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=CHAT, top_logprobs=1), "top_logprobs"),  # without logprobs
])
def test_options_out_of_range_are_400s_naming_the_field_as_sent(server, path, body, param):
    """Values out of range are checked by `GenerationParams` (the one place), and the 400
    names the field as this request spells it (max_tokens, not max_new_tokens)."""
    refused(post(server, path, body), param, param)


def test_echo_returns_the_prompt_scored_by_the_prefill(server):
    """echo with logprobs k (lm-eval's loglikelihood request): the prompt's text and ids
    before the completion's, each prompt id's log-probability (None for the first) and k
    alternatives as the prefill computed them: `generate` with prompt_logprobs gives the
    same values. max_tokens 0 scores the prompt only; batched token-id prompts each get
    theirs; echo with stream is a 400 naming echo."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.generate import generate

    tok = ByteTokenizer()
    prompts = ["Hello there, general", "The cat sat on the mat."]
    ref = generate(tiny_model("llama", seed=1), tok, prompts,
                   params=GenerationParams(max_new_tokens=1, logprobs=True, prompt_logprobs=2)).rows
    r = post(server, "/v1/completions", dict(prompt=prompts[0], echo=True, logprobs=2, max_tokens=1, temperature=0))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    ids = ref[0].prompt_token_ids
    assert c["text"] == prompts[0] + ref[0].text and len(c["logprobs"]["tokens"]) == len(ids) + 1
    lps, tops = c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]
    assert lps[0] is None and tops[0] is None
    np.testing.assert_allclose(lps[1:len(ids)], ref[0].prompt_logprobs[1:], atol=1e-5)
    np.testing.assert_allclose(lps[-1], ref[0].logprobs[0], atol=1e-5)
    for got, want, lp, t in zip(tops[1:len(ids)], ref[0].prompt_top_logprobs[1:], lps[1:], ids[1:]):
        assert len(want) == 2 and got == pytest.approx({tok.decode([i]): v for i, v in want}, abs=1e-5)
        assert (want[0][0] == t) == (lp == max(got.values()))  # lm-eval's greedy test: exact equality
    assert c["logprobs"]["text_offset"][:2] == [0, len(tok.decode([ids[0]]))]
    r = post(server, "/v1/completions", dict(prompt=[tok.encode(p) for p in prompts], echo=True, logprobs=1,
                                             max_tokens=0, temperature=0))
    assert r.status_code == 200, r.text
    for c, want in zip(r.json()["choices"], ref):
        assert c["finish_reason"] == "length" and c["text"] == tok.decode(want.prompt_token_ids)
        assert len(c["logprobs"]["tokens"]) == len(want.prompt_token_ids)
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], want.prompt_logprobs[1:], atol=1e-5)
    refused(post(server, "/v1/completions", dict(prompt="hi", echo=True, stream=True)), "echo", "stream")
    refused(post(server, "/v1/completions", dict(prompt="hi", max_tokens=0)), "max_tokens", "positive integer")


def test_top_logprobs_are_the_model_s_alternatives(server):
    """Chat top_logprobs / completions logprobs k (up to 20): each generated token's k most
    likely ids where it was chosen (generate's values); greedy: the token is the first."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.generate import generate

    tok = ByteTokenizer()
    want = generate(tiny_model("llama", seed=1), tok, ["Once upon"],
                    params=GenerationParams(max_new_tokens=6, logprobs=True, top_logprobs=5)).rows[0]
    r = post(server, "/v1/completions", dict(prompt="Once upon", max_tokens=6, logprobs=5, temperature=0))
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [pytest.approx({tok.decode([i]): v for i, v in alts}, abs=1e-5)
                                  for alts in want.top_logprobs]
    r = chat(server, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=20)
    for c in r.json()["choices"][0]["logprobs"]["content"]:
        assert len(c["top_logprobs"]) == 20 and c["top_logprobs"][0]["logprob"] == c["logprob"]  # (bit for bit)
        assert [t["logprob"] for t in c["top_logprobs"]] == sorted((t["logprob"] for t in c["top_logprobs"]),
                                                                   reverse=True)


def test_speculation_metrics_per_request(server):
    """A drafting request's `metrics.speculative_decoding` (vLLM's per-request shape): the
    verify steps that checked drafts for it, the draft tokens and those accepted, their
    histogram; the same in the stream's last chunk; none for plain decoding on request, or
    for several sequences."""
    body = dict(prompt="one two three", max_tokens=24, temperature=0)
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    body["lookahead_jax"] = {"references": [text]}  # drafts: the answer itself
    deadline = time.time() + 120
    while time.time() < deadline:  # (the tree sizes compile in the background meanwhile: `fallback`)
        r = post(server, "/v1/completions", body).json()
        m = r["metrics"]["speculative_decoding"]
        if m["num_spec_steps"]:
            break
        time.sleep(1)
    assert r["choices"][0]["text"] == text and m["num_spec_steps"] > 0 and m["num_accepted_draft_tokens"] > 0

    def consistent(m, completion_tokens):
        assert 0 <= m["num_accepted_draft_tokens"] <= m["num_draft_tokens"]
        assert sum(m["acceptance_histogram"].values()) == m["num_spec_steps"]
        assert sum(int(k) * v for k, v in m["acceptance_histogram"].items()) == m["num_accepted_draft_tokens"]
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"])
        assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
        # each verify step emits its accepted drafts + 1 after the prefill's first token; the
        # last may run past max_tokens by up to its drafts (decoding_length 4)
        assert m["num_accepted_draft_tokens"] + m["num_spec_steps"] <= completion_tokens - 1 + 4

    consistent(m, r["usage"]["completion_tokens"])
    streamed = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", server.url + "/v1/completions", json=streamed, timeout=120) as st:
        chunks = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c for c in chunks if "metrics" in c] == last and len(last) == 1  # with the finish, once
    consistent(last[0]["metrics"]["speculative_decoding"], chunks[-1]["usage"]["completion_tokens"])
    assert "metrics" not in post(server, "/v1/completions", dict(body, lookahead_jax={"strategy": "greedy"})).json()
    assert "metrics" not in post(server, "/v1/completions", dict(body, n=2, temperature=0.5)).json()
