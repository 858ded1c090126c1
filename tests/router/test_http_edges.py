"""The router's HTTP edges: request bodies over the limit, unknown paths and wrong methods."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from servelm.router.config import RouterConfig
from servelm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.router.conftest import Proc, router

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def edge(log_dir: Path) -> Iterator[Proc]:
    """A router with no replica: what these tests send is answered before one is needed."""
    with router([], "round-robin", log_dir, "--max-request-bytes", "64KiB") as r:
        yield r


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:200]
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_the_default_body_limit_is_servelm_serves() -> None:
    assert RouterConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES


def test_a_body_over_the_limit_is_413_before_it_is_read(edge: Proc) -> None:
    big = json.dumps({"prompt": "a" * LIMIT, "max_tokens": 1}).encode()
    with httpx.Client(base_url=edge.url, timeout=30) as http:
        # said up front (Content-Length)
        error = assert_openai_error(http.post("/v1/completions", content=big), 413)
        assert error["code"] == "body_too_large" and str(LIMIT) in error["message"]

        # sent in chunks, without a length: cut off once past the limit, before its end
        bigger = json.dumps({"prompt": "a" * 2 * LIMIT}).encode()

        def chunks() -> Iterator[bytes]:
            for i in range(0, len(bigger), 4096):
                yield bigger[i : i + 4096]

        resp = http.post("/v1/chat/completions", content=chunks())
        assert assert_openai_error(resp, 413)["code"] == "body_too_large"
        # under the limit a body is read and passed on (here to no replica: 503)
        small = http.post("/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 1})
        assert assert_openai_error(small, 503)["code"] == "no_replica"


def test_unknown_paths_and_wrong_methods_are_openai_errors(edge: Proc) -> None:
    with httpx.Client(base_url=edge.url, timeout=30) as http:
        error = assert_openai_error(http.get("/nope"), 404)
        assert error["type"] == "not_found_error"
        wrong = http.get("/v1/completions")
        assert_openai_error(wrong, 405)
        assert wrong.headers["allow"] == "POST"
