"""A large request body is decoded and validated off the event loop (server/body_parse.py): while
the server parses megabytes of token ids, other clients are answered; and what it answers for a
large body is what it answers for the same request small."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, ValidationError

from servelm.server import body_parse
from servelm.server.body_parse import OFF_LOOP_BYTES
from servelm.server.errors import install_error_handlers
from servelm.server.protocol import CompletionRequest, TokenId

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("last", "refusal"),
    [
        # the last id negative: refused by validation, so all the server does is parse it
        (-1, "prompt: must be a string"),
        # valid, and over the context: refused by its count, not by walking the ids again
        (7, "This model's maximum context length"),
    ],
)
def test_health_is_answered_while_a_large_body_is_parsed(server, last, refusal):
    ids = [7] * 1_500_000 + [last]
    body = json.dumps({"prompt": ids, "max_tokens": 1}, separators=(",", ":")).encode()
    # what parsing it takes here, as FastAPI parses a body on the loop: json.loads, then the model
    start = time.perf_counter()
    try:
        CompletionRequest.model_validate(json.loads(body))
    except ValueError:
        pass
    parse = time.perf_counter() - start

    answers: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                assert client.get("/health").status_code == 200
                answers.append(time.perf_counter())
                time.sleep(0.002)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.5)  # (the poller's connection is up)
        sent = time.perf_counter()
        reply = httpx.post(server.base_url + "/completions", content=body, headers=JSON, timeout=60)
        done = time.perf_counter()
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"].startswith(refusal)
    during = [t for t in answers if sent <= t <= done]
    around = [max(t for t in answers if t < sent), *during, min(t for t in answers if t > done)]
    longest = max(b - a for a, b in zip(around, around[1:], strict=False))
    assert len(during) >= 3, (len(during), done - sent)
    # on the loop, /health waited out the whole parse; off it, a few ms at a time
    assert longest < parse / 2, (longest, parse, done - sent)


def test_the_loop_waits_for_no_long_step_of_the_parse():
    # The parse holds the GIL for as long as any one C call of it lasts (body_parse.py): a
    # single json.loads of the body, or pydantic's check of a whole list, stopped the loop as
    # surely on a worker thread as on the loop itself.
    body = json.dumps({"prompt": [7] * 3_000_000 + [-1]}, separators=(",", ":")).encode()
    start = time.perf_counter()
    json.loads(body)
    decode = time.perf_counter() - start

    app = FastAPI()
    install_error_handlers(app)

    @body_parse.post(app, "/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        return {}

    async def main() -> tuple[httpx.Response, float]:
        gaps: list[float] = []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://servelm") as client:
            reply = asyncio.ensure_future(
                client.post("/v1/completions", content=body, headers=JSON)
            )
            last = time.perf_counter()
            while not reply.done():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            return reply.result(), max(gaps)

    reply, longest = asyncio.run(main())
    assert reply.status_code == 400 and "prompt: must be" in reply.json()["error"]["message"]
    assert longest < decode / 2, (longest, decode)


class UnionPrompt(BaseModel):
    """The prompt as a plain union of its shapes: what protocol.py's shortcut must agree with."""

    model_config = ConfigDict(strict=True)
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]


@pytest.mark.parametrize(
    "prompt",
    ["", "a", [], [0, 5], [-1], [True], [1, True], [1, "a"], ["a", 1], ["a", ""], [[1], []],
     [[]], [[1], 2], [[1], ["a"]], [[True]], [[-1]], [1.0], [None], None, 5, {"a": 1},
     [1] * 70_000, [1] * 70_000 + [-1], ["a"] * 40_000 + [1], [[1] * 40_000, [2, -2]]],
)  # fmt: skip
def test_a_prompt_is_taken_as_the_union_of_its_shapes_takes_it(prompt):
    try:
        expected = UnionPrompt(prompt=prompt).prompt
    except ValidationError:
        with pytest.raises(ValidationError, match="prompt_type"):
            CompletionRequest(prompt=prompt)
    else:
        assert CompletionRequest(prompt=prompt).prompt == expected


PAD = "x" * OFF_LOOP_BYTES  # an unknown field, ignored: makes a body large, changes nothing else


def _bodies() -> list[tuple[str, str, str]]:
    """(path, body with `{pad}` where the padding goes, content type)."""
    app_json = "application/json"
    return [
        ("/v1/completions", '{"pad": "{pad}", "prompt": [1, 2, -1]}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": [1, true]}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": [[1], "a"]}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "temperature": -1}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "max_tokens": "10"}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "seed": 1e400}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "seed": 99999999999999999999}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "user": "\\ud800"}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "use_beam_search": true}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "stop_token_ids": [5, -2]}', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": [1, 2,]}', app_json),  # not JSON
        ("/v1/completions", '{"pad": "{pad}", "prompt": [' + "[" * 5000 + "]" * 5000 + "]}", app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi"} trailing', app_json),
        ("/v1/completions", '{"pad": "{pad}", "max_tokens": 1}', app_json),
        ("/v1/completions", '["{pad}", 1, 2]', app_json),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi"}', "text/plain"),
        ("/v1/completions", '{"pad": "{pad}", "prompt": "hi", "n": 0}', "application/json; charset=utf-8"),
        ("/v1/chat/completions", '{"pad": "{pad}", "messages": []}', app_json),
        ("/v1/chat/completions", '{"pad": "{pad}", "messages": [{"content": "hi"}]}', app_json),
        ("/v1/chat/completions", '{"pad": "{pad}", "messages": [{"role": "user", "content": 5}]}', app_json),
        ("/tokenize", '{"pad": "{pad}", "prompt": 5}', app_json),
        ("/tokenize", '{"pad": "{pad}", "prompt": "hello there"}', app_json),
        ("/tokenize", '{"pad": "{pad}", "messages": [{"role": "user", "content": "hi"}]}', app_json),
        ("/detokenize", '{"pad": "{pad}", "tokens": [1, 2, -1]}', app_json),
        ("/detokenize", '{"pad": "{pad}", "tokens": [1, 2, 3]}', app_json),
        ("/detokenize", '{"pad": "{pad}", "tokens": [1, 2, 999999]}', app_json),
    ]  # fmt: skip


@pytest.mark.parametrize("path,template,content_type", _bodies())
def test_a_large_body_is_answered_as_the_same_body_small(server, path, template, content_type):
    def ask(pad: str) -> httpx.Response:
        body = template.replace("{pad}", pad).encode()
        headers = {"content-type": content_type}
        return httpx.post(server.url + path, content=body, headers=headers, timeout=60)

    small, large = ask(""), ask(PAD)
    assert len(template) < OFF_LOOP_BYTES <= len(template) + len(PAD)
    assert (large.status_code, large.content) == (small.status_code, small.content)


def test_the_document_still_describes_each_body(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for path, model in [
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body == {
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
            "required": True,
        }
        assert doc["components"]["schemas"][model]["properties"]
