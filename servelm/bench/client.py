"""One benchmark request over HTTP: build the OpenAI body, read the SSE stream, time each chunk.

Timestamps are taken as each `data:` line arrives (perf_counter, one clock per process):
TTFT is the first chunk with non-empty text, every later text chunk adds one inter-token gap,
e2e ends at `[DONE]`. Token counts come from the usage chunk (`stream_options.include_usage`)
when the server sends one, else one token per text chunk. An answer that ends properly with no
text (the model's first token ended it: with --no-ignore-eos, or min_tokens ignored) is a
success with no TTFT or TPOT (and 0 output tokens where the server sends no usage): the server
answered it correctly. Failures never raise: they come back as a record whose `error` is the
HTTP status or "connect" / "timeout" / "stream-error".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from servelm.bench.results import RequestRecord
from servelm.bench.workload import RequestSpec, completion_prompt

DONE = "[DONE]"
ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


class StreamError(Exception):
    """The server broke the stream: an in-band error event, bad JSON, or no end marker."""


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    api_url: str  # ends in /v1
    model: str
    endpoint: str = "chat"  # "chat" | "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float | None = 0.0
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.api_url + ENDPOINTS[self.endpoint]


def normalise_base_url(base_url: str) -> tuple[str, str]:
    """(server root, API url ending in /v1) from a base URL given with or without /v1."""
    root = base_url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root, root + "/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for `spec`. Output length is pinned with max_tokens, and unless the server
    rejects them, ignore_eos + min_tokens (vLLM-style extensions) so the model cannot stop early."""
    body: dict[str, Any] = {"model": target.model, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if target.endpoint == "chat":
        messages = spec.messages
        if messages is None:
            messages = [{"role": "system", "content": spec.system}] if spec.system else []
            messages = [*messages, {"role": "user", "content": spec.prompt or ""}]
        body["messages"] = messages
    elif target.endpoint == "completions":
        if spec.prompt is None:
            raise ValueError("the completions endpoint needs prompts, not chat messages")
        body["prompt"] = completion_prompt(spec.system, spec.prompt)
    else:
        raise ValueError(f"unknown endpoint {target.endpoint!r}; choose from {sorted(ENDPOINTS)}")
    if spec.output_tokens is not None:
        body["max_tokens"] = spec.output_tokens
        if target.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_tokens
    if target.temperature is not None:
        body["temperature"] = target.temperature
    return body


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A `data:` line's JSON object, DONE for the end marker, None for other SSE lines
    (blank, comments, event:/id:/retry:). Raises StreamError on a malformed payload."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == DONE:
        return DONE
    if not data:
        return None
    try:
        event = json.loads(data)
    except json.JSONDecodeError as exc:
        raise StreamError(f"bad JSON in stream: {data[:80]!r}") from exc
    if not isinstance(event, dict):
        raise StreamError(f"stream event is not an object: {data[:80]!r}")
    return event


def chunk_text(event: dict[str, Any]) -> str:
    """The generated text in one streamed chunk (chat deltas or completion text)."""
    parts = []
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


async def send_request(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, run_start: float
) -> RequestRecord:
    """Send one streaming request and measure it; `run_start` is the run's perf_counter zero."""
    start = time.perf_counter()
    record = RequestRecord(
        index=spec.index,
        start_s=start - run_start,
        prompt_tokens=spec.prompt_tokens,
        requested_output_tokens=spec.output_tokens,
    )
    try:
        body = build_payload(target, spec)
        headers = auth_headers(target.api_key)
        async with client.stream(
            "POST", target.url, json=body, headers=headers, timeout=target.timeout_s
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _fail(record, str(response.status_code), error_message(text))
            if response.headers.get("content-type", "").startswith("application/json"):
                _read_whole(record, json.loads(await response.aread()), start)
            else:
                await _read_stream(record, response, start)
    except httpx.TimeoutException as exc:
        return _fail(record, "timeout", repr(exc))
    except httpx.ConnectError as exc:
        return _fail(record, "connect", str(exc) or repr(exc))
    except (httpx.HTTPError, StreamError, ValueError) as exc:
        return _fail(record, "stream-error", str(exc) or repr(exc))
    return record


async def _read_stream(record: RequestRecord, response: httpx.Response, start: float) -> None:
    last: float | None = None
    chunks = 0
    finished = False
    usage: dict[str, Any] = {}
    async for line in response.aiter_lines():
        event = parse_sse_line(line)
        if event is None:
            continue
        if isinstance(event, str):  # DONE
            finished = True
            break
        if "error" in event:
            raise StreamError(error_message(json.dumps(event)))
        now = time.perf_counter()
        if chunk_text(event):
            if last is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            last = now
            chunks += 1
        if any(c.get("finish_reason") for c in event.get("choices") or []):
            finished = True  # some servers stop here without [DONE]; usage may still follow
        usage = event.get("usage") or usage
    end = time.perf_counter()
    if not finished:
        raise StreamError("stream ended before [DONE] or a finish_reason")
    # (no text at all: record.ttft_s stays None, the answer was empty, not broken)
    record.e2e_s = end - start
    record.output_tokens = int(usage.get("completion_tokens") or chunks)
    record.server_prompt_tokens = usage.get("prompt_tokens")


def _read_whole(record: RequestRecord, body: dict[str, Any], start: float) -> None:
    """A server that ignored stream=true: the whole answer is the first (and only) token time."""
    record.e2e_s = record.ttft_s = time.perf_counter() - start
    usage = body.get("usage") or {}
    choices = body.get("choices") or [{}]
    message = choices[0].get("message") or {}
    text = message.get("content") or choices[0].get("text") or ""
    record.output_tokens = int(usage.get("completion_tokens") or (1 if text else 0))
    record.server_prompt_tokens = usage.get("prompt_tokens")


def _fail(record: RequestRecord, error: str, message: str) -> RequestRecord:
    record.error, record.error_message = error, message[:300]
    record.ttft_s = record.e2e_s = None
    record.itl_s, record.output_tokens = [], 0
    return record


def error_message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the text itself."""
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return text.strip()
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or text).strip()
