"""An OpenAI-compatible server with continuous batching over the slot API.

    python -m lookahead_jax.serve --model smollm2-135m --strategy lookahead --max-batch 8

`scheduler.Scheduler` (the engine thread: one `core.slots.Slots`, requests inserted
between steps), `app.build_app` (FastAPI routes), `protocol` (request bodies: what is
served, what is refused), `chat` (chat messages through the model's template: parts,
roles, tool calls), `errors` (OpenAI's error shape for everything the server answers),
`metrics.Metrics` (Prometheus, vLLM's names with the `lookahead_jax:` prefix),
`startup.Startup` (the port opens at once: 503s while the server is built behind it). See
docs/serving.md. Needs the `serve` extra (fastapi, uvicorn, prometheus-client).
"""

from .app import Server, build_app
from .scheduler import Job, Output, QueueFull, Scheduler
from .server import ServeConfig, make_server, run, start_in_thread

__all__ = ["Job", "Output", "QueueFull", "Scheduler", "ServeConfig", "Server", "build_app", "make_server", "run", "start_in_thread"]
