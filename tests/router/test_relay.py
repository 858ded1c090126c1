"""SSE relay internals: event framing across chunks, usage capture, in-band errors (no processes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CollectorRegistry, Histogram

from servelm.router.replicas import Lease, Replica
from servelm.router.streaming import Received, StreamState, relay, sse_events

USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)


async def chunks(*parts: bytes, fail: bool = False) -> AsyncIterator[bytes]:
    for p in parts:
        yield p
    if fail:
        raise httpx.ReadError("connection reset")


async def collect(*parts: bytes, fail: bool = False, strip_usage: bool = False):
    replica = Replica("http://r:1")
    finished: list[StreamState] = []
    upstream = httpx.Response(200)
    state = StreamState(replica, Lease(replica), upstream, strip_usage, finished.append, times=[])
    events = sse_events(chunks(*parts, fail=fail))
    first = await events.__anext__()
    delay = Histogram("d", "d", registry=CollectorRegistry())
    body = b"".join([out async for out in relay(first, events, state, delay)])
    return body, state, finished, replica


def test_events_are_framed_across_chunk_boundaries() -> None:
    async def run() -> list[Received]:
        parts = (b'data: {"a"', b":1}\n\ndata: 2\n", b"\ndata: 3\r\n\r\n")
        return [r async for r in sse_events(chunks(*parts))]

    got = asyncio.run(run())
    assert [r.events for r in got] == [[b'data: {"a":1}\n\n'], [b"data: 2\n\n", b"data: 3\r\n\r\n"]]


def test_usage_is_captured_and_hidden_when_the_router_asked_for_it() -> None:
    parts = (b'data: {"choices":[{"text":"hi"}]}\n\n', USAGE, b"data: [DONE]\n\n")
    body, state, finished, replica = asyncio.run(collect(*parts, strip_usage=True))
    assert b"usage" not in body and body.endswith(b"data: [DONE]\n\n")
    assert state.usage_total == 5 and state.outcome == "200" and finished == [state]
    assert replica.in_flight == 0 and len(state.times) == 2  # one time per event passed on
    body, state, _, _ = asyncio.run(collect(*parts))
    assert b'"usage"' in body and state.usage_total == 5


def test_a_replica_dying_mid_stream_ends_with_an_error_event_and_done() -> None:
    body, state, finished, replica = asyncio.run(
        collect(b'data: {"choices":[]}\n\n', b"data: {partial", fail=True)
    )
    events = body.decode().strip().split("\n\n")
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "replica_failed"
    assert events[-1] == "data: [DONE]"
    assert state.outcome == "stream_error" and replica.in_flight == 0 and finished


def test_a_stream_closed_without_done_gets_an_error_event() -> None:
    body, state, _, _ = asyncio.run(collect(b'data: {"choices":[]}\n\n'))
    assert b'"error"' in body and body.endswith(b"data: [DONE]\n\n")
    assert state.error and "before [DONE]" in state.error
