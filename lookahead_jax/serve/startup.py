"""Serving before the server exists: the port opens at once, and the server (model load,
engine, scheduler, the strategy's index) is built in a background thread.

    startup = Startup(build)                  # build(stage) -> the ASGI app to serve
    uv = startup.uvicorn(host=..., port=...)  # a uvicorn.Server over it
    uv.run()                                  # returns when stopped, or after a failed build
    if startup.error is not None: raise startup.error

`Startup` is itself the ASGI app uvicorn serves. When uvicorn starts it (the lifespan's
startup, just before the port is bound) a thread runs `build(stage)`; `stage(name)` names
what it is doing ("model", "engine"). Until the built app is mounted every request is
answered at once, nothing waits:

    GET /health    503 {"status": "loading", "stage": "model", "seconds": 3.2, "ready": false}
    GET /metrics   503 (a scrape sees the target down until it serves)
    anything else  503 in OpenAI's error shape, saying the model is loading (Retry-After)

Then the built app's own lifespan is run (the server's starts the engine thread; on
shutdown it drains) and every request goes to it (/health: 503 with the warm-up's
progress, then 200). A build that raises stops uvicorn and keeps the exception in
`error`, for the caller to report. Host only: no jax.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Optional

from fastapi.responses import JSONResponse, PlainTextResponse

from .protocol import error_body

log = logging.getLogger("lookahead_jax.serve")


class Startup:
    """An ASGI app that answers 503 while `build(stage)` builds the app to serve in a
    background thread, then hands it every request (module docstring)."""

    def __init__(self, build: Callable[[Callable[[str], None]], Callable]):
        self.build = build
        self.stage = "starting"
        self.error: Optional[BaseException] = None  # what the build raised
        self.app = None  # the built app, once its lifespan has started
        self.t0 = time.perf_counter()
        self._server = None  # the uvicorn.Server that serves this (`uvicorn`): a failed build stops it
        self._loop = self._scope = self._mounting = self._inner = None
        self._closed = False

    def uvicorn(self, **config):
        """A `uvicorn.Server` over this app (`config`: uvicorn.Config's arguments) that a
        failed build stops."""
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self, **config))
        return self._server

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading(scope, receive, send)

    async def _lifespan(self, scope, receive, send):
        await receive()  # lifespan.startup
        self._loop, self._scope = asyncio.get_running_loop(), scope
        self.t0 = time.perf_counter()
        threading.Thread(target=self._build, name="lookahead-jax-build", daemon=True).start()
        announce = asyncio.ensure_future(self._announce())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        announce.cancel()
        self._closed = True  # a build that ends now is not mounted
        if self._mounting is not None:
            await self._mounting
        if self._inner is not None:
            await self._inner.say("shutdown")
        await send({"type": "lifespan.shutdown.complete"})

    async def _announce(self):
        """Logs once the port is open (uvicorn binds it after the lifespan's startup)."""
        server = self._server
        if server is None:
            return
        while not server.started:
            await asyncio.sleep(0.01)
        if self.app is None and self.error is None:
            log.info("listening on http://%s:%s while the server is built: /health answers 503 until it is "
                     "loaded and warmed up", server.config.host, server.config.port)

    async def _loading(self, scope, receive, send):
        seconds = round(time.perf_counter() - self.t0, 1)
        state = "failed" if self.error is not None else "loading"
        if scope["path"] == "/health":
            body = dict(status=state, stage=self.stage, seconds=seconds, ready=False)
            response = JSONResponse(body, status_code=503)
        elif scope["path"] == "/metrics":
            response = PlainTextResponse(f"# the server is {state} ({self.stage}, {seconds} s)\n", status_code=503)
        elif self.error is not None:
            response = JSONResponse(error_body("The server failed to start and is stopping.", 503), status_code=503)
        else:
            message = (f"The model is loading ({self.stage}, {seconds} s so far): retry shortly, or poll "
                       "GET /health until it answers 200.")
            response = JSONResponse(error_body(message, 503), status_code=503, headers={"Retry-After": "2"})
        await response(scope, receive, send)

    # ------------------------------------------------------------------ the build
    def _stage(self, name: str) -> None:
        self.stage = name

    def _build(self) -> None:
        try:
            app = self.build(self._stage)
        except Exception as e:  # noqa: BLE001 - reported by whoever serves (`error`)
            self._fail(e)
            return
        log.info("server built in %.1f s", time.perf_counter() - self.t0)
        self.stage = "starting"
        try:
            self._loop.call_soon_threadsafe(self._mount, app)
        except RuntimeError:  # the loop has closed: serving stopped meanwhile
            pass

    def _fail(self, e: BaseException) -> None:
        self.error, self.stage = e, "failed"
        log.error("the server could not be built (%s after %.1f s): stopping", type(e).__name__,
                  time.perf_counter() - self.t0)
        if self._server is not None:
            self._server.should_exit = True

    def _mount(self, app) -> None:  # on the loop
        if not self._closed:
            self._mounting = asyncio.ensure_future(self._start(app))

    async def _start(self, app) -> None:
        inner = _Lifespan(app, self._scope)
        try:
            await inner.say("startup")
        except Exception as e:  # noqa: BLE001 - as a failed build
            self._fail(e)
            return
        self._inner, self.app = inner, app


class _Lifespan:
    """An ASGI app's lifespan driven from outside a server: `say("startup")` now,
    `say("shutdown")` later; each returns once the app has answered, or raises what
    the app raised."""

    def __init__(self, app, scope):
        self._to, self._back = asyncio.Queue(), asyncio.Queue()
        self._task = asyncio.ensure_future(app(dict(scope), self._to.get, self._back.put))

    async def say(self, what: str) -> None:
        await self._to.put({"type": "lifespan." + what})
        reply = asyncio.ensure_future(self._back.get())
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            message = reply.result()
        else:  # the app returned or raised without answering
            reply.cancel()
            message = {}
        if message.get("type") == f"lifespan.{what}.complete":
            if what == "shutdown":
                await self._task
            return
        await asyncio.wait({self._task}, timeout=10)  # a failed lifespan raises after it answers
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()
        raise RuntimeError(f"the app's lifespan {what} failed: {message.get('message') or 'no answer'}")
