"""API-key check as a pure ASGI middleware: `Authorization: Bearer <key>` on every route but probes."""

from __future__ import annotations

import hmac

from servelm.server.errors import send_error

OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})


class APIKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # Constant-time comparison: timing does not reveal how much of a guess was right.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return await self.app(scope, receive, send)
        await send_error(
            send,
            401,
            "Invalid or missing API key.",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )
