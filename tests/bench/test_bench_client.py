"""Tests for servelm.bench.client: SSE parsing of recorded byte streams and error mapping."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from servelm.bench.client import (
    DONE,
    StreamError,
    Target,
    chunk_text,
    normalise_base_url,
    parse_sse_line,
    send_request,
)
from servelm.bench.results import RequestRecord
from servelm.bench.workload import RequestSpec

SPEC = RequestSpec(index=3, prompt="hello", prompt_tokens=1, output_tokens=3)
TARGET = Target(api_url="http://bench.test/v1", model="m")


def chat_chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def recorded(*events: dict | str, newline: str = "\n") -> bytes:
    """An SSE body as a server might send it, with a comment and an `event:` field."""
    parts = [": keep-alive", "", "event: message"]
    for event in events:
        payload = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
        parts += [f"data: {payload}", ""]
    return newline.join(parts).encode() + newline.encode()


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def run_with(handler: Callable[[httpx.Request], httpx.Response]) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, TARGET, SPEC, run_start=0.0)

    return asyncio.run(go())


def streaming(chunks: list[bytes], status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(status, headers=headers, content=body())

    return handler


GOOD = [
    chat_chunk(None),  # role-only opening delta: no text, so not the first token
    chat_chunk("Grüße"),  # multi-byte characters, split mid-character below
    chat_chunk(" 🌍"),
    chat_chunk(" end", finish="length"),
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}},
    DONE,
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_stream_split_at_awkward_places(size: int, newline: str) -> None:
    record = run_with(streaming(split_every(recorded(*GOOD, newline=newline), size)))
    assert record.ok, record.error_message
    assert record.output_tokens == 5  # usage wins over the 3 text chunks
    assert record.server_prompt_tokens == 11
    assert len(record.itl_s) == 2  # gaps between the 3 text chunks
    assert record.ttft_s is not None and record.e2e_s is not None
    assert 0 <= record.ttft_s <= record.e2e_s
    assert (record.index, record.prompt_tokens, record.requested_output_tokens) == (3, 1, 3)


def test_tokens_counted_from_chunks_without_usage() -> None:
    events = [chat_chunk("a"), chat_chunk("b"), chat_chunk("c"), chat_chunk("", "stop"), DONE]
    record = run_with(streaming([recorded(*events)]))
    assert record.ok and record.output_tokens == 3 and record.server_prompt_tokens is None


def test_in_band_error_event() -> None:
    error = {"error": {"message": "out of KV cache", "type": "server_error", "code": 500}}
    record = run_with(streaming([recorded(chat_chunk("a"), error, DONE)]))
    assert record.error == "stream-error"
    assert record.error_message == "out of KV cache"
    assert record.ttft_s is None and record.output_tokens == 0 and record.itl_s == []


def test_stream_cut_short() -> None:
    record = run_with(streaming([recorded(chat_chunk("a"), chat_chunk("b"))]))
    assert record.error == "stream-error" and "before [DONE]" in record.error_message


def test_bad_json_is_a_stream_error() -> None:
    record = run_with(streaming([b'data: {"choices": [\n\n']))
    assert record.error == "stream-error"


def test_http_status_is_the_error_kind() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "slow down", "code": 429}})

    record = run_with(handler)
    assert (record.error, record.error_message) == ("429", "slow down")
    assert not record.ok and record.tpot_s is None


def test_timeout_and_connect_errors() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no bytes", request=request)

    assert run_with(timeout).error == "timeout"
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def go() -> RequestRecord:
        target = Target(api_url=f"http://127.0.0.1:{port}/v1", model="m", timeout_s=5)
        async with httpx.AsyncClient() as client:
            return await send_request(client, target, SPEC, run_start=0.0)

    assert asyncio.run(go()).error == "connect"


def test_non_streaming_reply_is_accepted() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 2}}
        return httpx.Response(200, json=body)

    record = run_with(handler)
    assert record.ok and record.output_tokens == 2 and record.ttft_s == record.e2e_s


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    for other in ("", ": comment", "event: message", "id: 4", "retry: 10", "data:"):
        assert parse_sse_line(other) is None
    with pytest.raises(StreamError):
        parse_sse_line("data: [1, 2]")


def test_chunk_text_reads_chat_and_completion_shapes() -> None:
    assert chunk_text(chat_chunk("x")) == "x"
    assert chunk_text({"choices": [{"text": "y", "index": 0}]}) == "y"
    assert chunk_text({"choices": [], "usage": {}}) == ""
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "z"}}]}) == "z"


def test_normalise_base_url() -> None:
    expected = ("http://h:8000", "http://h:8000/v1")
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", " http://h:8000/v1/ "):
        assert normalise_base_url(url) == expected
    assert normalise_base_url("https://api.x/openai/v1")[1] == "https://api.x/openai/v1"
