"""Relaying a replica's SSE stream: event framing, usage capture, in-band errors, disconnects.

Bytes go out as soon as an event is complete (its blank line arrived): each upstream chunk's
complete events are written in one send, nothing waits for more. Holding back a half-received
event costs the client nothing (SSE clients act on whole events) and lets the router end a
broken stream with a clean error event rather than half an event glued to one.

Two framings: chat and completions chunks end with `data: [DONE]`; the Responses API's typed
events (`event: response.created` ...) have no [DONE] and end with the event that carries the
finished response (`response.completed`, `.incomplete`, `.failed`), its usage inside.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Histogram
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from servelm.router.replicas import Lease, Replica
from servelm.server.sse import DONE, error_event, typed_event

# the events a Responses stream ends with (`error`: OpenAI's, for a stream that fails early)
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


@dataclass
class Received:
    events: list[bytes]
    wall_time: float  # time.time(): comparable with another process's clock
    perf_time: float


@dataclass
class StreamState:
    replica: Replica
    lease: Lease
    upstream: httpx.Response
    strip_usage: bool  # drop the usage-only chunk (the router asked for it, not the client)
    finish: Callable[[StreamState], None]  # bookkeeping once the stream is over, however it ends
    times: list[float] | None = None
    count_output: bool = False  # count output_seen (for a rate limit: parses every event)
    typed: bool = False  # the Responses API's typed events, not chunks and [DONE]
    head: dict[str, Any] | None = None  # a typed stream's response as it opened
    usage_total: int | None = None
    output_seen: int = 0  # choices with output passed on, each at least one token
    done_seen: bool = False
    error: str | None = None
    outcome: str = field(default="client_closed")  # -> "200" or "stream_error"
    closed: bool = False
    kept: int = 0  # events passed on from the last upstream chunk
    passed: int = 0  # events passed on in all (a typed stream numbers its events from 0)

    async def close(self) -> None:
        """Close the upstream stream, release the replica, run `finish`; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.upstream.aclose()
        finally:
            self.lease.release()
            self.finish(self)


def _event_end(buf: bytes) -> int:
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else -1


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[Received]:
    """Each upstream chunk's complete events, stamped with when they arrived."""
    buf = b""
    async for chunk in chunks:
        wall, perf = time.time(), time.perf_counter()
        buf += chunk
        events = []
        while (end := _event_end(buf)) >= 0:
            events.append(buf[:end])
            buf = buf[end:]
        if events:
            yield Received(events, wall, perf)
    if buf.strip():
        raise httpx.RemoteProtocolError("the stream ended inside an event")


def _field(event: bytes, name: bytes = b"data") -> bytes:
    """An SSE field's value (`data` lines joined, as a client joins them)."""
    n = len(name) + 1
    lines = [ln[n:].removeprefix(b" ") for ln in event.splitlines() if ln.startswith(name + b":")]
    return b"\n".join(lines)


def usage_total(answer: Any) -> int | None:
    """The usage total of a body or streamed chunk: its `usage`, or the `usage` of the response
    a Responses event carries (both name it `total_tokens`); None when it has none."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    if usage is None and isinstance(answer.get("response"), dict):
        usage = answer["response"].get("usage")
    try:
        return int(usage["total_tokens"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):  # no usage, or not one a replica would write
        return None


def opening_response(first: Received) -> dict[str, Any] | None:
    """The response a Responses stream opens with (its `response.created` event), if any."""
    try:
        event = json.loads(_field(first.events[0]))
    except ValueError:
        return None
    response = event.get("response") if isinstance(event, dict) else None
    return response if isinstance(response, dict) else None


def _has_output(choice: object) -> bool:
    """A completions choice with text, or a chat choice whose delta holds more than its role."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(v for k, v in delta.items() if k != "role")
    return bool(choice.get("text"))


def _pass_through(events: list[bytes], state: StreamState) -> bytes:
    keep = []
    for ev in events:
        data = _field(ev)
        if data.strip() == b"[DONE]":
            state.done_seen = True
        elif state.count_output or b'"usage"' in data:
            try:
                obj = json.loads(data)
                choices = obj.get("choices")
                if state.count_output and isinstance(choices, list):
                    state.output_seen += sum(_has_output(c) for c in choices)
                elif state.count_output and state.typed:  # each delta at least one token
                    state.output_seen += str(obj.get("type")).endswith(".delta")
                total = usage_total(obj)
                if total is not None:
                    state.usage_total = total
                    if state.strip_usage and not choices:
                        continue
            except (ValueError, AttributeError, TypeError):
                pass
        if state.typed and _field(ev, b"event").decode(errors="replace") in RESPONSE_ENDS:
            state.done_seen = True
        keep.append(ev)
    state.kept = len(keep)
    state.passed += len(keep)
    return b"".join(keep)


def _failed(state: StreamState, message: str) -> bytes:
    """The in-band end of a stream the replica broke: an error event and [DONE], or for a typed
    stream the `response.failed` the replica would have sent (OpenAI's `error` event when the
    stream never said which response it is)."""
    if not state.typed:
        return (error_event(503, message, "replica_failed") + DONE).encode()
    sequence = state.passed
    if state.head is None:
        payload = {"type": "error", "code": "replica_failed", "message": message, "param": None}
    else:
        error = {"code": "server_error", "message": message}
        response = {**state.head, "status": "failed", "error": error}
        payload = {"type": "response.failed", "response": response}
    payload["sequence_number"] = sequence
    return typed_event(payload).encode()


async def relay(
    first: Received, events: AsyncIterator[Received], state: StreamState, delay: Histogram
) -> AsyncIterator[bytes]:
    """The client's body: upstream events as they come, ended by [DONE] (a typed stream: by
    its closing event) whatever happens."""
    try:
        try:
            received: Received | None = first
            while received is not None:
                out = _pass_through(received.events, state)
                if out:
                    if state.times is not None:  # one entry per event passed on
                        state.times.extend([received.wall_time] * state.kept)
                    yield out
                    delay.observe(time.perf_counter() - received.perf_time)
                received = await anext(events, None)
            if state.done_seen:
                state.outcome = "200"
            else:
                end = "its closing event" if state.typed else "[DONE]"
                state.error = f"the replica closed the stream before {end}"
        except httpx.HTTPError as exc:
            state.error = f"the replica failed mid-stream: {type(exc).__name__}: {exc}"
        if state.error is not None:
            state.outcome = "stream_error"
            yield _failed(state, f"{state.error} ({state.replica.url})")
    finally:
        await state.close()


class RelayResponse(StreamingResponse):
    """A StreamingResponse that stops reading upstream as soon as the client goes away and
    always closes the stream (upstream connection, replica lease), even if never iterated."""

    def __init__(
        self, body: AsyncIterator[bytes], state: StreamState, headers: dict[str, str]
    ) -> None:
        super().__init__(body, state.upstream.status_code, headers, media_type="text/event-stream")
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.state.close()
