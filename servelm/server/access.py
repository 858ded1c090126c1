"""The outermost layer of the server and of the router: each answered request gets a request id
(the client's `X-Request-Id`, or a new one), sent back in the answer's `X-Request-Id`, and one
log line (`servelm.access`) when its answer is complete; its status is passed to `on_status`
(the server's `http_requests_total`). Probes (a router's too), scrapes and the dashboard are
left out of both: their rate would drown the clients' requests in the log and in any panel."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from urllib.parse import quote

from servelm.server.auth import OPEN_PATHS

logger = logging.getLogger("servelm.access")

# A client's id is taken as it is when it is short and plain (it goes into logs and headers).
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")


# Sent by `servelm route` on its health probes (a GET of /v1/models each second from each
# router): they are not clients' requests either.
PROBE_HEADER = b"x-servelm-probe"


def quiet(scope: dict) -> bool:
    if scope["path"] in OPEN_PATHS or scope["path"].startswith("/dashboard"):
        return True
    return scope["method"] == "GET" and any(k == PROBE_HEADER for k, _ in scope["headers"])


def note_response_id(scope: dict, response_id: str) -> None:
    """Puts the answer's own id (`chatcmpl-...`) on the request's log line."""
    scope.setdefault("state", {})["response_id"] = response_id


class AccessMiddleware:
    """Pure ASGI. A client's `X-Request-Id` is kept for correlation (logs, the answer's header,
    a router's call to its replica); the engine's ids stay the server's own, unique whatever
    clients send."""

    def __init__(self, app, on_status: Callable[[int], None] | None = None) -> None:
        self.app, self.on_status = app, on_status

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or quiet(scope):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        request_id = given.decode() if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        headers = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]
        headers.append((b"x-request-id", request_id.encode()))
        state = {**scope.get("state", {}), "request_id": request_id}
        scope = {**scope, "headers": headers, "state": state}
        status: int | None = None
        start = time.perf_counter()

        async def tagged(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                out.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": out}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except Exception:
            status = status or 500  # what the error handler answers
            raise
        finally:
            if status is not None:
                if self.on_status is not None:
                    self.on_status(status)
                client = scope.get("client") or ("-", 0)
                answer = state.get("response_id")
                logger.info(
                    '%s "%s %s" %d %.3f s request_id=%s%s',
                    client[0],
                    scope["method"],
                    quote(scope["path"]),  # as uvicorn logs it: "%0A" must not start a line
                    status,
                    time.perf_counter() - start,
                    request_id,
                    f" id={answer}" if answer else "",
                )
