"""Building a server from a configuration (`make_server`) and running it under uvicorn
(`run`, or `start_in_thread` on a free local port); `__main__` parses the command line
into a `ServeConfig`, and tests and the benchmark call the same functions."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

log = logging.getLogger("lookahead_jax.serve")

# a block of 64 prompt tokens costs ~5-7 decode steps of 4 slots (SmolLM2-135M f32 on the
# 2-core CPU, docs/serving.md): a long prompt holds running requests that long per step
DEFAULT_PREFILL_CHUNK = 64
# off by default: measured, a budget of 3 or 4 decode steps with 16- or 32-token chunks left
# the stream's largest gap at 1.3-1.9 s against 0.9 s for one 64-token block a step
# (bench/results/admission.json; docs/serving.md, "Admission")
DEFAULT_STEP_BUDGET = None


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    strategy: str = "greedy"
    strategy_options: tuple = ()  # (name, value) pairs: the strategy's fields (decoding_length=7, ...)
    max_batch: int = 8
    max_len: int = 2048
    max_waiting: int = 256
    logprobs: bool = True
    dtype: str = "float32"
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    warmup: str = "greedy"  # none | greedy | all: the steps compiled before serving (`Scheduler.warm_up`)
    prefill_chunk: Optional[int] = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill block (None / 0: whole prompts)
    step_budget: Optional[float] = DEFAULT_STEP_BUDGET  # prefill blocks a step carries, in decode steps (None: one)


def make_server(cfg: ServeConfig, model=None, tokenizer=None):
    """A `Server` (its scheduler not yet started: the app's lifespan starts it). `model` /
    `tokenizer`: already loaded ones (tests), else `load(cfg.model)`.

    The strategy's options are checked before the model loads; a retrieval strategy
    (ralm, ralmspec: `retriever=KIND corpus=PATH`; knnlm: `datastore=DIR` or `corpus=PATH`)
    loads its index or datastore here, once (slots rebuilt later reuse it): one not built
    is an `IndexUnavailable` whose message gives the command that builds it."""
    from ..core.engine import engine_for
    from ..loading import load
    from ..strategies import resolve
    from .app import Server
    from .metrics import Metrics
    from .scheduler import Scheduler

    if cfg.max_batch < 1 or cfg.max_len < 16 or cfg.max_waiting < 0:
        raise ValueError("--max-batch must be >= 1, --max-len >= 16 and --max-waiting >= 0")
    strategy = resolve(cfg.strategy, **dict(cfg.strategy_options))
    if cfg.prefill_chunk not in (None, 0) and not (isinstance(cfg.prefill_chunk, int) and cfg.prefill_chunk >= 2):
        raise ValueError(f"--prefill-chunk must be 0 (whole prompts) or an integer >= 2, got {cfg.prefill_chunk!r}")
    if cfg.step_budget is not None and not cfg.step_budget >= 1:
        raise ValueError(f"--step-budget must be >= 1 (decode steps a step with prefill may take) or 0 for one "
                         f"block a step, got {cfg.step_budget!r}")
    if model is None:
        model, tokenizer = load(cfg.model, cfg.dtype)
    engine = engine_for(model)
    strategy = None if strategy.drafter(engine) is None and not strategy.runs_own_loop else strategy
    name = cfg.served_model_name or cfg.model
    metrics = Metrics(name)
    eos = tuple(sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))
    sched = Scheduler(engine, tokenizer, strategy, max_batch=cfg.max_batch, max_len=cfg.max_len,
                      max_waiting=cfg.max_waiting, eos_ids=eos, logprobs=cfg.logprobs, metrics=metrics,
                      prefill_chunk=cfg.prefill_chunk or None, step_budget=cfg.step_budget)
    server = Server(sched, tokenizer, name, metrics, vocab=int(engine.config.vocab_size),
                    max_position=int(engine.config.max_position))
    server.model = model  # the engine holds its model weakly
    return server


def run(cfg: ServeConfig, server=None) -> None:
    """Serve until interrupted (SIGINT / SIGTERM: uvicorn stops accepting, open requests
    finish, then the engine thread drains and stops)."""
    import uvicorn

    from .app import build_app

    server = server or make_server(cfg)
    if cfg.warmup != "none":  # in the background: the port opens now, /health says 503 until it is done
        warm_up_in_background(server.scheduler)
    uvicorn.run(build_app(server), host=cfg.host, port=cfg.port, log_level="info",
                timeout_graceful_shutdown=60)


def warm_up_in_background(scheduler, wait: str = "minimum"):
    """`Scheduler.warm_up` in a daemon thread: the engine thread admits nothing until the
    minimum set of step programs is compiled (/health: 503 with the progress, then 200),
    and the rest compile while it serves. Returns the thread."""
    import threading

    scheduler.ready.clear()  # before the thread starts: no request is admitted meanwhile

    def work():
        try:
            scheduler.warm_up(wait=wait)
        except Exception:  # noqa: BLE001 - the steps then compile at first use; the log says why
            log.exception("warm-up failed: the step programs compile at first use")
            scheduler.ready.set()

    thread = threading.Thread(target=work, name="lookahead-jax-warm-up", daemon=True)
    thread.start()
    return thread


def start_in_thread(server):
    """Serve `server` under uvicorn on a free port of 127.0.0.1 in a daemon thread (tests,
    benchmarks); returns once it accepts: (uvicorn.Server, thread, base URL). Stop it with
    `uv.should_exit = True` and `thread.join()` (the lifespan drains the engine thread)."""
    import socket
    import threading
    import time

    import uvicorn

    from .app import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    return uv, thread, f"http://127.0.0.1:{port}"
