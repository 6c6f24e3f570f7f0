"""`python -m lookahead_jax.serve --model smollm2-135m [--strategy lookahead] ...`

The port opens at once, the model loads behind it (/health: 503 while it loads and warms
up, then 200). A configuration the server cannot start with is one `error:` line naming
the fix, exit status 2: bad options or an unknown model name before anything listens;
what shows only as the server is built (a malformed checkpoint, a preset not fetched, a
retrieval index or KNN-LM datastore not built, a missing corpus file) once the port is
open, which then closes. Any other failure of the build: its traceback, exit status 1."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ..argparsing import Parser, add_distributed_flags, parse_mesh
from ..strategies import REGISTRY

from ..core.multihost import check_flags
from .server import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, DEFAULT_STEP_BUDGET, ServeConfig, check, run

log = logging.getLogger("lookahead_jax.serve")


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _chunk(text: str) -> int:
    """--prefill-chunk: an integer >= 2, or 0 / "none" (whole prompts, as 0)."""
    if text.strip().lower() in ("0", "none"):
        return 0
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, or 0 / none for whole prompts, got {text!r}")
    return n


def parse(argv=None) -> ServeConfig:
    p = parser()
    a = p.parse_args(argv)
    return _config(p, a)


def parser() -> argparse.ArgumentParser:
    """The command's `argparsing.Parser` (every option's default in --help)."""
    p = Parser(prog="python -m lookahead_jax.serve", description="OpenAI-compatible server with continuous batching")
    p.add_argument("--model", default="smollm2-135m", help="a preset name or a local path")
    p.add_argument("--strategy", default="greedy", help="greedy | lookahead | specinfer (a request may ask for "
                   "greedy on these) | ralm | ralmspec | knnlm (retrieval: their options name the index)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a strategy option, e.g. decoding_length=7, draft_model=PATH, retriever=bm25 and "
                   "corpus=PATH (ralm, ralmspec), datastore=DIR or speculative=true (knnlm) (repeatable)")
    p.add_argument("--max-batch", type=int, default=8, help="slots decoded together")
    p.add_argument("--max-len", type=int, default=2048, help="KV cache slots per request (prompt + completion "
                   "+ the verify block; ralm / ralmspec: + the retrieved passage)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests that may wait for a slot (then 429)")
    p.add_argument("--prefill-chunk", type=_chunk, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prompt tokens forwarded per prefill block: a longer prompt is prefilled one block "
                   "per step while the running requests keep decoding (0 or none: whole prompts at once; "
                   f"default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--step-budget", type=float, default=DEFAULT_STEP_BUDGET or 0, metavar="K",
                   help="experimental: while requests decode, a step forwards prefill blocks of the waiting "
                   "prompts up to K times the running batch's recent decode step (at least one block), and an "
                   "insert forwards none; 0 (the default): one block a step, the first at insert")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB, metavar="MB",
                   help="MiB of prompt-block K/V kept for later prompts that begin with the same tokens (a "
                   "repeated passage, system prompt or earlier turns): they prefill only the rest, with the same "
                   "tokens; least recently used blocks go first; 0: off; needs --prefill-chunk (default "
                   f"{DEFAULT_PREFIX_CACHE_MB}: ~11,600 tokens of SmolLM2-135M in float32)")
    p.add_argument("--no-logprobs", action="store_true", help="decode without log-probabilities")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' dtype")
    p.add_argument("--served-model-name", default=None, help="the model name requests give and responses "
                   "carry (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--warmup", default="greedy", choices=("none", "greedy", "all"),
                   help="compile this configuration's step programs (listed in the log) in the background: the "
                   "port opens at once, /health answers 503 with the progress until the minimum set is compiled, "
                   "the rest compile while requests are served and steps do without them meanwhile (greedy, the "
                   "default, and all are the same: sampling is data, one program serves both); none: each "
                   "program compiles at its first use")
    p.add_argument("--mesh", default=None, metavar="data=N,model=M",
                   help="split the model over 'model' (tensor parallel) and the slots' rows over 'data' on a mesh "
                   "of the devices (every process's, over several processes); default: one device")
    add_distributed_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also log other libraries' INFO lines (orbax, "
                   "absl, jax, ...); without it they log warnings and errors only")
    return p


def _config(p, a) -> ServeConfig:
    """The `ServeConfig` of the parsed arguments `a` (`p.error` on bad ones)."""
    if a.strategy not in REGISTRY:
        p.error(f"--strategy {a.strategy!r}: choose one of {', '.join(REGISTRY)}")
    fields = [f.name for f in dataclasses.fields(REGISTRY[a.strategy])]
    opts = []
    for o in a.option:
        if "=" not in o:
            p.error(f"--option {o!r}: expected NAME=VALUE")
        k, v = o.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in fields:
            p.error(f"--option {k}: not an option of strategy {a.strategy!r}; its options: "
                    + (", ".join(fields) or "none"))
        opts.append((k, _value(v.strip())))
    mesh = parse_mesh(p, a.mesh)
    distributed = (a.coordinator_address, a.num_processes, a.process_id, a.distributed_auto)
    error = check_flags(*distributed[:3], a.stall_timeout)
    if error:
        p.error(error)
    return ServeConfig(a.model, a.strategy, tuple(opts), a.max_batch, a.max_len, a.max_waiting, not a.no_logprobs,
                       a.dtype, a.served_model_name, a.host, a.port, a.warmup, a.prefill_chunk,
                       a.step_budget or None, a.prefix_cache_mb, mesh, distributed, a.stall_timeout)


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    configure_logging(a.verbose)
    serve(_config(p, a))


def configure_logging(verbose: bool) -> None:
    """The server's INFO lines (lookahead_jax: warm-up progress, requests, engine errors;
    uvicorn's own loggers keep theirs); other libraries' (orbax's checkpoint reads, absl,
    jax) only from WARNING up unless `verbose`: their INFO lines read as failures to an
    operator. force: an import (absl, via jax) may have configured the root logger first."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("lookahead_jax").setLevel(logging.INFO)
    for name in ("absl", "orbax", "jax"):  # libraries that set their own loggers' levels
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def serve(cfg: ServeConfig, build=None) -> None:
    """Serve `cfg` until interrupted, as the command does: `check(cfg)`, then `run` (the
    port opens at once; `build(stage)`, by default `make_server`, builds the server behind
    it). A configuration it cannot start with: the `error:` line and SystemExit(2); any
    other failure of the build: logged with its traceback, SystemExit(1)."""
    from ..core.compile import enable_compilation_cache
    from ..core.multihost import check_same_config, init_distributed
    from ..retrieval import EncoderUnavailable, IndexUnavailable

    try:
        # before any other JAX call: several processes (process 0 serves, the others follow it)
        if init_distributed(*cfg.distributed[:3], auto=cfg.distributed[3], stall_timeout_s=cfg.stall_timeout_s):
            if not cfg.mesh:
                raise ValueError("several processes need --mesh (e.g. data=2,model=4 over 2 processes of 4 "
                                 "devices each): the mesh spans every process's devices")
            check_same_config(dataclasses.asdict(dataclasses.replace(cfg, distributed=(), host="", port=0)))
        check(cfg)
        enable_compilation_cache()  # the server owns its process: compiled steps go to JAX's persistent cache
        run(cfg, build=build)
    except (ValueError, OSError, IndexUnavailable, EncoderUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception:
        log.exception("the server could not start")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
