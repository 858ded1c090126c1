"""A body over --max-request-bytes gets an OpenAI-shaped 413 before it is parsed (issue #32),
whether it says its length or comes in chunks, and the server goes on serving."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.live_server import LiveServer


@pytest.fixture(scope="module")
def small_limit(tiny_model_dir):
    srv = LiveServer(tiny_model_dir, "--kv-cache-memory", "8MiB", "--max-request-bytes", "64KiB")
    yield srv
    srv.stop()


def assert_413(reply: httpx.Response) -> None:
    assert reply.status_code == 413, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "65536 bytes" in error["message"]


def test_a_body_with_its_length_over_the_limit_is_413(small_limit):
    prompt = "word " * 30_000  # 150 kB
    reply = httpx.post(
        small_limit.base_url + "/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30
    )
    assert_413(reply)


def test_a_chunked_body_over_the_limit_is_413(small_limit):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(200):
            yield b"word " * 200  # 1 kB each
        yield b'", "max_tokens": 1}'

    reply = httpx.post(
        small_limit.base_url + "/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_413(reply)


@pytest.mark.parametrize("over", [1, 30, 5000])
def test_a_chunked_body_over_the_limit_in_its_last_part_is_413_at_once(small_limit, over):
    # nothing is left to read after that part: the 413 waited for more until the client left
    def chunks():
        yield b'{"prompt": "' + b"w" * (64 * 1024 - 12 - 19 + over) + b'", "max_tokens": 1}'

    for _ in range(4):
        reply = httpx.post(
            small_limit.base_url + "/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
            timeout=5,
        )
        assert_413(reply)


def test_an_asyncio_client_still_sending_gets_its_413(small_limit):
    # AsyncOpenAI (httpx on asyncio) writes the whole body before it reads: the 413 reaches it
    # only if the server reads the body it refuses, instead of closing the socket on it.
    async def main():
        client = openai.AsyncOpenAI(base_url=small_limit.base_url, api_key="x", max_retries=0)
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model="tiny", prompt="word " * 300_000)
            assert info.value.status_code == 413
            assert info.value.body["code"] == "body_too_large"

    asyncio.run(main())


def test_under_the_limit_it_serves(small_limit):
    reply = httpx.post(
        small_limit.base_url + "/completions",
        json={"prompt": "word " * 100, "max_tokens": 2},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_model_dir):
    # under the body limit, but more characters than the context holds tokens times the most
    # characters one token stands for: refused from its length ("at least"), not tokenized
    srv = LiveServer(tiny_model_dir, "--kv-cache-memory", "8MiB", "--max-model-len", "256")
    try:
        from servelm.text.tokenizer import TextTokenizer

        longest = TextTokenizer(tiny_model_dir).longest_token_chars
        prompt = "x" * (256 * longest)
        for path, body in [
            ("/completions", {"prompt": prompt, "max_tokens": 1}),
            ("/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
        ]:
            reply = httpx.post(srv.base_url + path, json=body, timeout=30)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "context_length_exceeded" and "at least 256" in error["message"]
        ok = httpx.post(srv.base_url + "/completions", json={"prompt": "x y", "max_tokens": 1})
        assert ok.status_code == 200
    finally:
        srv.stop()
