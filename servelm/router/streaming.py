"""Relaying a replica's SSE stream: event framing, usage capture, in-band errors, disconnects.

Bytes go out as soon as an event is complete (its blank line arrived): each upstream chunk's
complete events are written in one send, nothing waits for more. Holding back a half-received
event costs the client nothing (SSE clients act on whole events) and lets the router end a
broken stream with a clean error event rather than half an event glued to one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client import Histogram
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from servelm.router.replicas import Lease, Replica
from servelm.server.sse import DONE, error_event


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
    usage_total: int | None = None
    output_seen: int = 0  # choices with output passed on, each at least one token
    done_seen: bool = False
    error: str | None = None
    outcome: str = field(default="client_closed")  # -> "200" or "stream_error"
    closed: bool = False
    kept: int = 0  # events passed on from the last upstream chunk

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


def _data(event: bytes) -> bytes:
    lines = [ln[5:].removeprefix(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"\n".join(lines)


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
        data = _data(ev)
        if data.strip() == b"[DONE]":
            state.done_seen = True
        elif state.count_output or b'"usage"' in data:
            try:
                obj = json.loads(data)
                choices = obj.get("choices")
                if state.count_output and isinstance(choices, list):
                    state.output_seen += sum(_has_output(c) for c in choices)
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("total_tokens") is not None:
                    state.usage_total = int(usage["total_tokens"])
                    if state.strip_usage and not choices:
                        continue
            except (ValueError, AttributeError, TypeError):
                pass
        keep.append(ev)
    state.kept = len(keep)
    return b"".join(keep)


async def relay(
    first: Received, events: AsyncIterator[Received], state: StreamState, delay: Histogram
) -> AsyncIterator[bytes]:
    """The client's body: upstream events as they come, ended by [DONE] whatever happens."""
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
                state.error = "the replica closed the stream before [DONE]"
        except httpx.HTTPError as exc:
            state.error = f"the replica failed mid-stream: {type(exc).__name__}: {exc}"
        if state.error is not None:
            state.outcome = "stream_error"
            yield (
                error_event(503, f"{state.error} ({state.replica.url})", "replica_failed") + DONE
            ).encode()
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
