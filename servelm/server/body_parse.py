"""Large JSON request bodies decoded and validated on a worker thread, not on the event loop.

FastAPI decodes a route's JSON body (`json.loads`) and validates it against the route's model
(pydantic) on the event loop before the route runs: an 8 MiB body of prompt token ids held the
loop for 2.7 s, and every other client's stream and /health with it. A route opts in by being
declared with `@post(app, path, ...)` in place of `@app.post(path, ...)` (same arguments): a
JSON body of `OFF_LOOP_BYTES` or more is then decoded and validated on a worker thread by the
route's own body field, and FastAPI's handler is handed the validated model, which pydantic takes
as it is. The route's body stays its parameter, so /openapi.json is FastAPI's as before, and a
body that fails is refused with the errors FastAPI makes (the same validation, raised the same
way), which server/errors.py answers as ever. Only for routes whose one validated input is
their body (FastAPI would list a query parameter's errors before the body's).

The GIL: a worker thread lets the loop run only between the C calls that the parse is made of,
and `json.loads` of a body or pydantic's check of a long list holds it throughout (each about
50 ms per MiB of token ids here). So the decode calls back into Python for each integer
(`_int`), and protocol.py checks a long prompt in slices: the loop waits a few ms at a time.
Other long lists (`messages`, `tokens`, `stop_token_ids`) are still one call each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from anyio import to_thread
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message

# Below this a body is parsed where it arrives (FastAPI's way). Measured on 2 shared cores: a
# body of small chat messages, the slowest kind to validate, took 7 ms at 64 KiB and 48 ms at
# 256 KiB (token ids: 1 and 10 ms), against 0.2 ms for the hop to a worker thread and back.
OFF_LOOP_BYTES = 64 << 10

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def post(app: FastAPI, path: str, **kw: Any) -> Callable[[Callable], Callable]:
    """`@app.post(path, **kw)`, the route's body parsed off the loop when large (module doc)."""

    def declare(endpoint: Callable) -> Callable:
        app.router.add_api_route(
            path, endpoint, methods=["POST"], route_class_override=OffLoopBodyRoute, **kw
        )
        return endpoint

    return declare


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose handler first parses a large JSON body on a worker thread."""

    def get_route_handler(self) -> Handler:
        handle = super().get_route_handler()
        field = self.body_field
        if field is None:  # (no body to parse)
            return handle

        async def parse_then_handle(request: Request) -> Response:
            if _media_type(request) == "application/json":
                try:
                    body = await request.body()
                except ClientDisconnect:  # cut off (BodyLimitMiddleware) or gone: FastAPI's
                    # handler hears it too, as it would have (the request's own `receive` has
                    # told it once, and would now wait for a body that will not come)
                    return await handle(Request(request.scope, _disconnected))
                if len(body) >= OFF_LOOP_BYTES:
                    parsed = await to_thread.run_sync(_validated, field, body)
                    if parsed is not _NOT_JSON:
                        # Starlette keeps what `Request.json()` decoded here, and FastAPI's
                        # handler asks it for the body: it gets the model, valid already
                        request._json = parsed
            return await handle(request)

        return parse_then_handle


_NOT_JSON = object()


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}


def _validated(field: Any, body: bytes) -> Any:
    """The body decoded as FastAPI's handler decodes it (Starlette's `json.loads`) and
    validated by the route's body field as FastAPI validates it; raises FastAPI's error for a
    body the model refuses. `_NOT_JSON` for one that does not decode: FastAPI's handler decodes
    it again (up to where it fails) and answers as ever."""
    try:
        value = json.loads(body, parse_int=_int)
    except Exception:
        return _NOT_JSON
    model, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return model


def _int(text: str) -> int:
    """A JSON integer, as `json.loads` makes one, but in a Python call: where the interpreter
    hands the GIL over (every 5 ms) to the event loop. (2.5 times the decode's time for a
    body of token ids; without it a million of them are one call.)"""
    return int(text)


def _media_type(request: Request) -> str:
    """The body's media type. Parsed off the loop only as `application/json`, which FastAPI
    decodes as JSON whatever its parameters; any other type FastAPI decides on as ever."""
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()
