"""The server's start-up (`serve.startup.Startup`, `server.lazy_app`, `__main__.serve`): the
port opens before the server is built.

* While the build runs (here it blocks on an Event), /health answers 503 {"status":
  "loading", "stage"}, /metrics 503, the API routes 503 in OpenAI's error shape; once it
  is built, /health turns 200 (after the warm-up's minimum set) and a completion answers.
* A build that raises stops serving: `serve` prints `error: ...` and exits 2 for a
  configuration error (ValueError), logs the traceback and exits 1 for anything else.
* An unknown model name is an `error:` line and exit status 2 before anything listens (in
  this process, and as `python -m lookahead_jax.serve`, slow: the imports take seconds).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lookahead_jax.serve import ServeConfig, make_server, start_in_thread  # noqa: E402
from lookahead_jax.serve.server import lazy_app  # noqa: E402
from tiny import ByteTokenizer, tiny_model  # noqa: E402

OPENAI_ERROR = {"message", "type", "param", "code"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, seconds: float = 300):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_port_answers_while_the_server_is_built():
    cfg = ServeConfig(model="tiny", strategy="greedy", max_batch=2, max_len=128, warmup="greedy")
    release, building = threading.Event(), threading.Event()

    def build(stage):
        stage("model")
        building.set()
        assert release.wait(120)
        return make_server(cfg, tiny_model("llama", seed=1), ByteTokenizer(), stage=stage)

    startup = lazy_app(cfg, build)
    uv, thread, url = start_in_thread(startup)
    try:
        assert building.wait(60)
        r = httpx.get(url + "/health")
        body = r.json()
        assert r.status_code == 503 and body["status"] == "loading" and body["stage"] == "model", body
        assert body["ready"] is False and body["seconds"] >= 0
        assert httpx.get(url + "/metrics").status_code == 503
        for path, req in (("/v1/completions", dict(model="tiny", prompt="hi", max_tokens=2)),
                          ("/v1/chat/completions", dict(model="tiny", messages=[{"role": "user", "content": "hi"}])),
                          ("/tokenize", dict(prompt="hi"))):
            r = httpx.post(url + path, json=req)
            err = r.json()["error"]
            assert r.status_code == 503 and set(err) == OPENAI_ERROR and err["code"] == 503, (path, r.text)
            assert "loading" in err["message"] and "/health" in err["message"] and r.headers["retry-after"]
        assert httpx.get(url + "/v1/models").status_code == 503
        release.set()
        wait_for(lambda: httpx.get(url + "/health").status_code == 200)
        body = httpx.get(url + "/health").json()
        assert body["status"] == "ok" and body["programs_ready"] >= body["programs_minimum"] > 0
        r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="hi", max_tokens=2), timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        server = startup.app.state.server
    finally:
        release.set()
        uv.should_exit = True
        thread.join(60)
    assert startup.error is None and not server.scheduler.alive  # the built app's lifespan drained it


def test_a_server_served_any_way_warms_up():
    """A `make_server` server served without `run` / `lazy_app` (a library user's own
    uvicorn, `start_in_thread`, `build_app`): its app's lifespan starts the warm-up
    `ServeConfig.warmup` asks for (default greedy) as the command does: /health counts the
    configuration's programs, the minimum set compiled before a request is admitted, none
    compiled on the request path; `warmup="none"` leaves the programs to their first use."""
    served = {}
    for warmup in ("greedy", "none"):
        cfg = ServeConfig(model="tiny", strategy="lookahead", max_batch=2, max_len=256, prefill_chunk=32,
                          warmup=warmup)
        srv = make_server(cfg, tiny_model("llama", seed=4), ByteTokenizer())
        uv, thread, url = start_in_thread(srv)
        try:
            wait_for(lambda: httpx.get(url + "/health").status_code == 200)
            r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="hello", max_tokens=4), timeout=300)
            assert r.status_code == 200
            served[warmup] = httpx.get(url + "/health").json()
        finally:
            uv.should_exit = True
            thread.join(60)
    warm, cold = served["greedy"], served["none"]
    assert warm["programs_total"] == len(srv.scheduler.slots.programs())
    assert warm["programs_ready"] >= warm["programs_minimum"] > 0 and warm["compiled_in_requests"] == 0
    assert cold["programs_total"] is None and cold["compiled_in_requests"] > 0


@pytest.mark.parametrize("error, status", [(ValueError, 2), (RuntimeError, 1)])
def test_a_failed_build_stops_the_server(capsys, caplog, error, status):
    """`serve` (what `main` runs) with a build that raises once the port is open: uvicorn
    stops, and the process would exit 2 with the `error:` line (a configuration error) or
    1 with the logged traceback (anything else)."""
    from lookahead_jax.serve.__main__ import serve

    port = free_port()
    seen = {}

    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
            return True
        except OSError:
            return False

    def build(stage):
        stage("model")
        wait_for(listening, 60)  # the port opens as the build starts
        seen["listening"] = True
        raise error("checkpoint /x is malformed")

    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="lookahead_jax.serve"):
        with pytest.raises(SystemExit) as stop:
            serve(ServeConfig(model="smollm2-135m", port=port, warmup="none"), build=build)
    assert stop.value.code == status and time.monotonic() - t0 < 30
    assert seen == {"listening": True}
    err = capsys.readouterr().err
    if status == 2:
        assert "error: checkpoint /x is malformed\n" in err
    else:
        assert "error:" not in err
        (rec,) = [r for r in caplog.records if r.getMessage() == "the server could not start"]
        assert rec.exc_info is not None and rec.exc_info[0] is RuntimeError
    assert not listening()  # the port is closed again


def test_an_unknown_model_fails_before_anything_listens(capsys, monkeypatch):
    import lookahead_jax.serve.__main__ as main

    monkeypatch.setattr(main, "run", lambda *a, **k: pytest.fail("it started serving"))
    with pytest.raises(SystemExit) as stop:
        main.serve(ServeConfig(model="no-such-model", port=free_port()))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown model 'no-such-model': not a preset")


@pytest.mark.slow
def test_an_unknown_model_fails_before_anything_listens_as_a_command():
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.serve", "--model", "no-such-model", "--port", str(port)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "error: unknown model 'no-such-model'" in p.stderr, p.stderr
    assert "Uvicorn running" not in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("verbose", [False, True])
def test_other_libraries_info_lines_only_with_verbose(verbose):
    """The server's own INFO lines always; orbax / absl / jax INFO lines (orbax's checkpoint
    reads read as failures) only with --verbose; their warnings always."""
    code = ("import logging, sys\n"
            "from lookahead_jax.serve.__main__ import configure_logging\n"
            "configure_logging(sys.argv[1] == 'v')\n"
            "for name in ('orbax', 'absl', 'jax._src.xla_bridge', 'lookahead_jax.serve'):\n"
            "    logging.getLogger(name).info('info from %s', name)\n"
            "logging.getLogger('orbax').warning('warning from orbax')\n")
    err = subprocess.run([sys.executable, "-c", code, "v" if verbose else "-"], capture_output=True, text=True,
                         timeout=120, check=True).stderr
    assert "info from lookahead_jax.serve" in err and "warning from orbax" in err, err
    for name in ("orbax", "absl", "jax._src.xla_bridge"):
        assert (f"info from {name}" in err) == verbose, err
