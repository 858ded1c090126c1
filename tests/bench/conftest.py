"""Fixtures for bench tests: in-memory tokenizers and a stand-in OpenAI-compatible server.

The stand-in is a small hand-written Starlette app (a third-party server stand-in, not servelm's
own server) served by uvicorn on a loopback port in a background thread. It streams
OpenAI-shaped SSE with known delays and exposes servelm:-named Prometheus metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from servelm.bench.command import add_arguments

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu apple berry "
    "cherry grape lemon mango olive peach plum melon river stone cloud storm ocean forest "
    "desert valley mountain island bridge castle garden market harbor meadow"
).split()


def word_level_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE trained in memory, so words merge into multi-byte tokens."""
    from tokenizers import decoders

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"], show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def word_tokenizer() -> Tokenizer:
    return word_level_tokenizer()


@pytest.fixture(scope="session")
def trained_bpe() -> Tokenizer:
    return bpe_tokenizer()


@dataclass
class StandIn:
    """Behaviour and observations of the stand-in server."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    ttft_per_in_flight_s: float = 0.0  # > 0 makes TTFT grow with load, like a queue
    api_key: str | None = None
    send_usage: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("servelm:prompt_tokens", "p", registry=r)
        self.generation_tokens = Counter("servelm:generation_tokens", "g", registry=r)
        self.prefix_queries = Counter("servelm:prefix_cache_queries", "q", registry=r)
        self.prefix_hits = Counter("servelm:prefix_cache_hits", "h", registry=r)
        self.running = Gauge("servelm:num_requests_running", "r", registry=r)
        self.ttft = Histogram(
            "servelm:time_to_first_token_seconds",
            "t",
            registry=r,
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/metrics", self._metrics),
            ]
        )

    def _denied(self, request: Request) -> Response | None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            error = {"error": {"message": "invalid api key", "type": "auth", "code": 401}}
            return JSONResponse(error, status_code=401)
        return None

    async def _models(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse({"data": [{"id": "standin-model"}]})

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain")

    async def _generate(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        return StreamingResponse(self._stream(body, chat), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        n = int(body.get("max_tokens") or 4)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.running.inc()
        self.prompt_tokens.inc(10)
        self.prefix_queries.inc(10)
        self.prefix_hits.inc(5)
        try:
            ttft = self.ttft_s + self.ttft_per_in_flight_s * self.in_flight
            await asyncio.sleep(ttft)
            self.ttft.observe(ttft)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.itl_s)
                choice: dict[str, Any] = {"index": 0, "finish_reason": None}
                if chat:
                    choice["delta"] = {"content": f"w{i} "}
                else:
                    choice["text"] = f"w{i} "
                if i == n - 1:
                    choice["finish_reason"] = "length"
                yield _sse({"id": "x", "choices": [choice]})
                self.generation_tokens.inc()
            if self.send_usage:
                usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
                yield _sse({"id": "x", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            self.running.dec()


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def serve(app: Starlette) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Start `app` on a free loopback port in a daemon thread; return (server, thread, url)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("stand-in server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """A running stand-in server (no API key); tweak its delays before sending."""
    yield from _running(StandIn())


@pytest.fixture
def standin_with_key() -> Iterator[StandIn]:
    """A running stand-in server that wants the API key "secret"."""
    yield from _running(StandIn(api_key="secret"))


def _running(state: StandIn) -> Iterator[StandIn]:
    server, thread, state.url = serve(state.app())
    try:
        yield state
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def parse(argv: list[str]) -> argparse.Namespace:
    """`servelm bench`'s arguments, parsed."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def tokenizer_dir(tmp_path: Path, word_tokenizer: Tokenizer) -> str:
    """A folder holding `word_tokenizer` as tokenizer.json."""
    folder = tmp_path / "tok"
    folder.mkdir()
    word_tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)
