"""A client that goes away mid-stream: its request is aborted and its KV blocks return at once."""

import time
from contextlib import contextmanager

import httpx
import pytest

from tests.live_server import LiveServer


@pytest.fixture(scope="module")
def long_server(tiny_model_dir):
    # A long context keeps a request busy for seconds even on a model this small.
    srv = LiveServer(tiny_model_dir, "--kv-cache-memory", "16MiB")
    yield srv
    srv.stop()


def wait_for(cond, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@contextmanager
def mid_stream(server, body):
    """A stream three chunks in, for the block's duration; leaving it drops the connection."""
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as r:
        # Keep the line iterator alive: leaving it (break) would close the connection early.
        lines = r.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: {")
        yield


def test_disconnect_mid_stream_frees_blocks(long_server):
    server = long_server
    idle_usage = server.metrics()["servelm:kv_cache_usage_perc"]
    body = {"prompt": [7] * 200, "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with mid_stream(server, body):
        running = server.metrics()
        assert running["servelm:num_requests_running"] >= 1
        assert running["servelm:kv_cache_usage_perc"] > idle_usage
    t0 = time.time()
    assert wait_for(lambda: server.metrics()["servelm:num_requests_running"] == 0, 1.0)
    assert wait_for(lambda: server.metrics()["servelm:kv_cache_usage_perc"] == idle_usage, 1.0)
    assert time.time() - t0 < 1.0


def test_disconnect_non_streaming_aborts(long_server):
    server = long_server
    body = {"prompt": [9] * 100, "max_tokens": 3500, "ignore_eos": True}
    try:
        httpx.post(server.base_url + "/completions", json=body, timeout=0.5)
    except httpx.ReadTimeout:
        pass
    assert wait_for(lambda: server.metrics()["servelm:num_requests_running"] == 0, 1.5)


def test_a_request_whose_client_went_away_is_counted_as_aborted(long_server):
    # Served until the client left: its prompt, its end-to-end time and an `abort` end count
    # like any other request's (operators' throughput and latency panels would miss it).
    server = long_server
    aborted = "servelm:request_success_total{finished_reason=abort}"
    before = server.metrics()
    assert aborted in before  # present at zero from the start: rate() sees its first one
    body = {"prompt": [5] * 150, "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with mid_stream(server, body):
        pass

    def counted() -> bool:
        return server.metrics()[aborted] == before[aborted] + 1

    assert wait_for(counted, 2.0)
    after = server.metrics()
    for name, grew in [
        ("servelm:prompt_tokens_total", 150),
        ("servelm:e2e_request_latency_seconds_count", 1),
        ("servelm:request_prompt_tokens_count", 1),
        ("servelm:request_decode_time_seconds_count", 1),
    ]:
        assert after[name] - before[name] == grew, name
