"""Request bodies over a size limit get a 413 before anything reads them (issue #32).

Without it a 10 MB body was parsed and tokenized in full (3.5 s of a core) before the context
check refused it. A body that says its length (`Content-Length`, as every usual client does) is
refused before it is received; one sent in chunks is cut off as soon as it passes the limit.
"""

from __future__ import annotations

from servelm.server.errors import send_error

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a 128k-token context as text is about 0.5 MiB
DRAIN_BYTES = 64 << 20  # the most of a refused body read (and dropped) so that its 413 arrives


class BodyLimitMiddleware:
    """Pure ASGI, outermost: answers 413 (OpenAI-shaped) for a body over `limit` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._drain(receive, int(length))
            return await self._refuse(send)
        over, started, received, whole = False, False, 0, False

        async def limited() -> dict:
            nonlocal over, received, whole
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # the app sees the client go away; we answer
                    over = True
                    whole = not message.get("more_body", False)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: dict) -> None:
            nonlocal started
            if over:  # whatever the app makes of the cut body is not sent
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            if not whole:  # (a body over the limit in its last chunk has nothing left to read:
                # waiting for more held the 413 until the client gave up)
                await self._drain(receive, None)
            await self._refuse(send)

    async def _drain(self, receive, length: int | None) -> None:
        """Reads what is left of the body and drops it: a socket closed with a body unread is
        reset, and a client still sending (asyncio ones, curl) loses the 413 for a connection
        error. Past DRAIN_BYTES the connection is closed as it is: refusing is the point."""
        if length is not None and length > DRAIN_BYTES:
            return
        read = 0
        while read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return
            read += len(message.get("body", b""))

    async def _refuse(self, send) -> None:
        message = f"The request body is over {self.limit} bytes."
        await send_error(send, 413, message, "body_too_large", [(b"connection", b"close")])
