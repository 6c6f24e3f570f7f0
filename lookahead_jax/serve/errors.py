"""Every error the app returns, in OpenAI's shape (`protocol.error_body`:
`{"error": {"message", "type", "param", "code"}}`), with a message that says what is wrong
and where:

    a body that is not UTF-8     400 "the body is not UTF-8: invalid start byte at byte 12"
    a body that is not JSON      400 "the body is not valid JSON: Expecting ',' delimiter at
                                      line 1 column 48"
    a body that does not validate 400 naming the field ("max_tokens: ...", param the field;
                                      an unknown field: "unknown field")
    an `APIError` of a route     its status, message and param
    an unknown route, a wrong method  404, 405 (with `Allow`)
    anything else                500 (uvicorn logs its traceback)

Host only (no jax).
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, param=None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def respond(status: int, message: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _where(doc: str, pos: int) -> str:
    """'line L column C' of character `pos` of `doc` (as json's own messages count them)."""
    line = doc.count("\n", 0, pos) + 1
    return f"line {line} column {pos - doc.rfind(chr(10), 0, pos)}"


def validation_message(errors: list) -> tuple:
    """(message, param) of a `RequestValidationError`'s errors: each error as `field:
    what`, the first error's field as `param`."""
    msgs, params = [], []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        loc = loc[1:] if loc[:1] == ("body",) else loc
        kind, ctx = e.get("type"), e.get("ctx") or {}
        if kind == "json_invalid":
            pos = loc[0] if loc and isinstance(loc[0], int) else None
            doc = e.get("doc")
            where = f" at {_where(doc, pos)}" if doc is not None and pos is not None else \
                (f" at character {pos}" if pos is not None else "")
            msgs.append(f"the body is not valid JSON: {ctx.get('error', 'JSON decode error')}{where}")
            continue
        field = ".".join(str(x) for x in loc)
        if kind == "value_error" and "error" in ctx:
            what = str(ctx["error"])
        elif kind == "extra_forbidden":
            what = "unknown field: this server does not implement it (docs/serving.md lists the fields it serves)"
        elif kind == "missing":
            what = "required"
        elif kind in ("model_attributes_type", "dict_type") and not field:
            what = "the body must be a JSON object (sent with Content-Type: application/json)"
        else:
            what = str(e.get("msg"))
        msgs.append(f"{field}: {what}" if field else what)
        params.append(field or None)
    return "; ".join(msgs) or "invalid request", (params[0] if params else None)


def install(app) -> None:
    """The exception handlers of the module docstring on `app`."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid" and isinstance(exc.body, str):
            errors[0] = dict(errors[0], doc=exc.body)
        return respond(400, *validation_message(errors))

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return respond(exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def _http(req, exc: HTTPException):
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body"
            return respond(400, f"the body is not {cause.encoding.upper()}: {cause.reason} at byte {cause.start}")
        if exc.status_code == 404:
            message = f"no route {req.url.path} (routes: /v1/completions, /v1/chat/completions, /v1/models, ...)"
        elif exc.status_code == 405:
            message = f"{req.method} is not allowed on {req.url.path} (allowed: {exc.headers.get('Allow', '?')})" \
                if exc.headers else f"{req.method} is not allowed on {req.url.path}"
        else:
            message = str(exc.detail)
        return respond(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):  # (Starlette raises it on after this answer: uvicorn logs it)
        return respond(500, f"internal error: {type(exc).__name__}: {exc}")
