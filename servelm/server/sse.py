"""Server-sent events framing: `data: <json>\\n\\n`, an in-band error event, and `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from servelm.server.errors import error_body

DONE = "data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def typed_event(payload: dict[str, Any]) -> str:
    """A Responses API event (its `type` named on the `event:` line, as OpenAI sends it)."""
    return f"event: {payload['type']}\n{event(payload)}"


def error_event(status: int, message: str, code: str | None = None) -> str:
    return event(error_body(status, message, None, code))


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
