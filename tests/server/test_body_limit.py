"""A body over --max-request-bytes gets an OpenAI-shaped 413 before it is parsed (issue #32),
whether it says its length or comes in chunks, and the server goes on serving."""

from __future__ import annotations

import httpx
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
