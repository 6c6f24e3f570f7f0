"""Building a server from a configuration (`check`, then `make_server`) and running it
under uvicorn (`run`: the port opens at once and the server is built behind it,
`lazy_app`; or `start_in_thread` on a free local port); `__main__` parses the command
line into a `ServeConfig`, and tests and the benchmark call the same functions."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

log = logging.getLogger("lookahead_jax.serve")

# a block of 64 prompt tokens costs ~5-7 decode steps of 4 slots (SmolLM2-135M f32 on the
# 2-core CPU, docs/serving.md): a long prompt holds running requests that long per step
DEFAULT_PREFILL_CHUNK = 64
# off by default: measured on a quiet host, 32-token chunks with a budget of 3 decode steps
# bound a stream's gaps (max 0.11 s against 0.22-0.36 s) but cost 0.86-0.94x throughput and
# 1.5-1.8x TTFT at 8 streams (bench/results/serve-srpt.json; docs/serving.md, "Admission")
DEFAULT_STEP_BUDGET = None
# prompt-block K/V kept for later prompts that begin alike (`core.prefix_cache`): SmolLM2-135M
# in f32 holds 46 KB per token, so 512 MB keep ~11,600 prompt tokens (~180 blocks of 63)
DEFAULT_PREFIX_CACHE_MB = 512


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
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB  # MiB of the prefix cache (0: off; needs prefill_chunk)
    mesh: tuple = ()  # (("data", n), ("model", m)): the devices the model and the slots' rows are split over
    distributed: tuple = (None, None, None, False)  # coordinator address, processes, process id, auto
    stall_timeout_s: float = 600.0  # `multihost.STALL_TIMEOUT_S` (0: off); in the config hash, as every flag


def check(cfg: ServeConfig, model_name: bool = True):
    """The checks that cost nothing, made before anything loads or listens: the options,
    the strategy's (`resolve`: returns the strategy), and with `model_name` that
    `cfg.model` names what `load` can load (a preset, an existing path or an HF hub id;
    `loading.vocab_size` reads no weights). A ValueError names the flag or the model."""
    from ..loading import vocab_size
    from ..strategies import resolve

    if cfg.max_batch < 1 or cfg.max_len < 16 or cfg.max_waiting < 0:
        raise ValueError("--max-batch must be >= 1, --max-len >= 16 and --max-waiting >= 0")
    strategy = resolve(cfg.strategy, **dict(cfg.strategy_options))
    if cfg.prefill_chunk not in (None, 0) and not (isinstance(cfg.prefill_chunk, int) and cfg.prefill_chunk >= 2):
        raise ValueError(f"--prefill-chunk must be 0 (whole prompts) or an integer >= 2, got {cfg.prefill_chunk!r}")
    if cfg.step_budget is not None and not cfg.step_budget >= 1:
        raise ValueError(f"--step-budget must be >= 1 (decode steps a step with prefill may take) or 0 for one "
                         f"block a step, got {cfg.step_budget!r}")
    if cfg.mesh and not {k for k, _ in cfg.mesh} <= {"data", "model"}:
        raise ValueError(f"--mesh axes are 'data' and 'model', got {dict(cfg.mesh)}")
    if not (isinstance(cfg.prefix_cache_mb, (int, float)) and cfg.prefix_cache_mb >= 0):
        raise ValueError(f"--prefix-cache-mb must be a number of MiB >= 0 (0: off), got {cfg.prefix_cache_mb!r}")
    if model_name:
        vocab_size(cfg.model)
    return strategy


def make_server(cfg: ServeConfig, model=None, tokenizer=None, stage: Optional[Callable[[str], None]] = None):
    """A `Server` (its scheduler not yet started: the app's lifespan starts it, after
    starting the warm-up `cfg.warmup` asks for, however it is served). `model` /
    `tokenizer`: already loaded ones (tests), else `load(cfg.model)`. `stage(name)` is told
    what it is doing ("model": loading it, "engine": the rest; `Startup`'s /health shows it).

    `check(cfg)` runs first (without `model`: its name checked too); a retrieval strategy
    (ralm, ralmspec: `retriever=KIND corpus=PATH`; knnlm: `datastore=DIR` or `corpus=PATH`)
    loads its index or datastore here, once (slots rebuilt later reuse it): one not built
    is an `IndexUnavailable` whose message gives the command that builds it.

    `cfg.mesh`: the model is loaded onto it and the slots' rows split over its "data" axis.
    Over several processes (`jax.distributed` initialized: `serve`) process 0's scheduler
    records its calls on the slots for the others (`replica`), which build the same server
    and follow it (`run`)."""
    from ..core.engine import engine_for
    from ..core.multihost import multiprocess
    from ..loading import load
    from .app import Server
    from .metrics import Metrics
    from .replica import Channel, Recorder
    from .scheduler import Scheduler

    stage = stage or (lambda name: None)
    strategy = check(cfg, model_name=model is None)
    mesh = None
    if cfg.mesh:
        from ..core.sharding import make_mesh

        mesh = make_mesh(**dict(cfg.mesh))
    if model is None:
        stage("model")
        t0 = time.perf_counter()
        model, tokenizer = load(cfg.model, cfg.dtype, **({"mesh": mesh} if mesh is not None else {}))
        log.info("model %s loaded in %.1f s", cfg.model, time.perf_counter() - t0)
    stage("engine")
    engine = engine_for(model, mesh)
    strategy = None if strategy.drafter(engine) is None and not strategy.runs_own_loop else strategy
    name = cfg.served_model_name or cfg.model
    metrics = Metrics(name)
    eos = tuple(sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))
    sched = Scheduler(engine, tokenizer, strategy, max_batch=cfg.max_batch, max_len=cfg.max_len,
                      max_waiting=cfg.max_waiting, eos_ids=eos, logprobs=cfg.logprobs, metrics=metrics,
                      prefill_chunk=cfg.prefill_chunk or None, step_budget=cfg.step_budget,
                      prefix_cache=int(cfg.prefix_cache_mb * 2 ** 20) or None,
                      replicate=Recorder(Channel()) if multiprocess() and _process_index() == 0 else None)
    server = Server(sched, tokenizer, name, metrics, vocab=int(engine.config.vocab_size),
                    max_position=int(engine.config.max_position), warmup=cfg.warmup)
    server.model = model  # the engine holds its model weakly
    return server


def _process_index() -> int:
    import jax

    return jax.process_index()


def lazy_app(cfg: ServeConfig, build: Optional[Callable] = None):
    """The app `run` serves, a `startup.Startup`: once it listens, a background thread
    runs `build(stage)` (default `make_server(cfg, stage=stage)`) and mounts `build_app`
    of the server it built (whose lifespan starts the warm-up and the engine thread). Until then every
    request gets a 503 at once (/health: {"status": "loading", "stage", "seconds"})."""
    from .app import build_app
    from .startup import Startup

    build = build or (lambda stage: make_server(cfg, stage=stage))

    def app(stage):
        return build_app(build(stage))  # (its lifespan starts the warm-up: `Server.warmup`)

    return Startup(app)


def run(cfg: ServeConfig, server=None, build: Optional[Callable] = None) -> None:
    """Serve until interrupted (SIGINT / SIGTERM: uvicorn stops accepting, open requests
    finish, then the engine thread drains and stops). The port opens at once; the server
    (`server` if given, else `build(stage)`, by default `make_server(cfg)`: the model
    load) is built behind it (`lazy_app`). A build that raises stops serving, and its
    exception is raised here once uvicorn has stopped.

    Over several processes, on every process but process 0: no port; the server is built
    here and follows process 0's engine (`replica.follow`) until process 0's ends."""
    from ..core.multihost import multiprocess

    if multiprocess() and _process_index() != 0:
        from .replica import Channel, follow

        server = server or (build or (lambda stage: make_server(cfg, stage=stage)))(lambda name: None)
        log.info("process %d: following process 0's engine (process 0 serves HTTP)", _process_index())
        calls = follow(server.scheduler, Channel())
        log.info("process %d: process 0's engine ended (%d calls followed)", _process_index(), calls)
        return
    if multiprocess():  # SIGTERM (re-raised by uvicorn once it stopped) ends this process as SIGINT does: its
        import signal  # exit then shuts jax.distributed down with the others (not a kill they abort on)

        signal.signal(signal.SIGTERM, signal.default_int_handler)
    startup = lazy_app(cfg, build if server is None else (lambda stage: server))
    try:
        startup.uvicorn(host=cfg.host, port=cfg.port, log_level="info", timeout_graceful_shutdown=60).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled (as `uvicorn.run` does: stopped)
        pass
    if startup.error is not None:
        raise startup.error


def start_in_thread(server):
    """Serve `server` (a `Server`, or a `lazy_app`: then the port opens before it is built)
    under uvicorn on a free port of 127.0.0.1 in a daemon thread (tests, benchmarks);
    returns once it accepts: (uvicorn.Server, thread, base URL). Stop it with
    `uv.should_exit = True` and `thread.join()` (the lifespan drains the engine thread)."""
    import socket
    import threading

    import uvicorn

    from .app import build_app
    from .startup import Startup

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    if isinstance(server, Startup):
        uv = server.uvicorn(host="127.0.0.1", port=port, log_level="warning")
    else:
        uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn stopped before it listened on 127.0.0.1:{port}")
        time.sleep(0.05)
    return uv, thread, f"http://127.0.0.1:{port}"
