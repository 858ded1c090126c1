"""Request ids and the access log: each client request gets an id (its own `X-Request-Id`, or
a new one), sent back in the answer, and one log line when its answer is complete; probes,
scrapes and the dashboard stay out of the log and out of `http_requests_total`."""

from __future__ import annotations

import asyncio
import http.client
import re
import time

import httpx
import pytest

from servelm.server.access import AccessMiddleware
from servelm.server.metrics import ServerMetrics

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def log_lines(read_log, request_id: str, timeout: float = 10.0) -> list[str]:
    """The lines of the log `read_log()` returns for `request_id`, once there are any (a line
    is written just after its answer is sent) or `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        said = [line for line in read_log().splitlines() if f"request_id={request_id}" in line]
        if said or time.monotonic() > deadline:
            return said
        time.sleep(0.05)


def test_the_clients_request_id_comes_back_and_names_the_log_line(server):
    r = httpx.post(server.base_url + "/chat/completions", json=CHAT, timeout=60,
                   headers={"X-Request-Id": "trace-42"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    [line] = log_lines(server.log, "trace-42")
    assert '"POST /v1/chat/completions" 200' in line and f"id={r.json()['id']}" in line
    # a stream's line is written when its answer is complete
    stream = {**CHAT, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=stream, timeout=60,
                      headers={"X-Request-Id": "trace-43"}) as s:  # fmt: skip
        assert s.headers["x-request-id"] == "trace-43"
        assert "data: [DONE]" in list(s.iter_lines())
    [line] = log_lines(server.log, "trace-43")
    assert '"POST /v1/chat/completions" 200' in line and " id=chatcmpl-" in line


def test_without_a_usable_id_the_server_makes_one_and_errors_get_one_too(server):
    for sent in ({}, {"X-Request-Id": "two words"}, {"X-Request-Id": "x" * 200}):
        r = httpx.post(server.base_url + "/completions", json={"model": "nope", "prompt": "a"},
                       headers=sent, timeout=60)  # fmt: skip
        assert r.status_code == 404
        made = r.headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", made)
        [line] = log_lines(server.log, made)
        assert '"POST /v1/completions" 404' in line


def test_probes_scrapes_and_the_dashboard_are_not_logged_or_counted(server):
    before = server.metrics()
    for path in ("/health", "/metrics", "/dashboard", "/dashboard/static/dashboard.js"):
        r = httpx.get(server.url + path, headers={"X-Request-Id": "quiet-1"}, timeout=30)
        assert r.status_code == 200 and "x-request-id" not in r.headers
    after = server.metrics()
    counted = [k for k in after if k.startswith("servelm:http_requests_total")]
    assert [after[k] - before.get(k, 0) for k in counted] == [0] * len(counted)
    # a request after them is logged, and by then they would be too
    httpx.get(server.base_url + "/models", headers={"X-Request-Id": "loud-1"}, timeout=30)
    assert len(log_lines(server.log, "loud-1")) == 1
    assert log_lines(server.log, "quiet-1", timeout=0) == []


def test_an_unhandled_exception_counts_as_500():
    metrics = ServerMetrics("m", 16, 8)

    async def broken(scope, receive, send):
        raise RuntimeError("bug")

    app = AccessMiddleware(broken, metrics.on_http_status)
    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
    with pytest.raises(RuntimeError):
        asyncio.run(app(scope, None, None))
    assert metrics.http_requests.labels("m", "500")._value.get() == 1


def test_an_idle_keep_alive_connection_outlives_the_clients_own_expiry(server):
    """The server keeps an idle connection longer than clients do (httpx: 5 s), so a client
    never sends a request on a connection the server is closing at that moment."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for pause in (0, 6):
            time.sleep(pause)
            conn.request("GET", "/v1/models")  # on the same connection (http.client reuses it)
            reply = conn.getresponse()
            assert reply.status == 200 and b'"object":"list"' in reply.read()
            sock = conn.sock
            assert sock is not None  # still open: the next request goes on it
    finally:
        conn.close()


def test_a_routers_probe_is_not_a_clients_request(server):
    """`servelm route` probes each replica's /v1/models every second: left out as /health is."""
    before = server.metrics()
    probe = {"X-Servelm-Probe": "1", "X-Request-Id": "probe-1"}
    assert httpx.get(server.base_url + "/models", headers=probe, timeout=30).status_code == 200
    after = server.metrics()
    total = "servelm:http_requests_total"
    assert after.get(total, 0) == before.get(total, 0)
    httpx.get(server.base_url + "/models", headers={"X-Request-Id": "client-1"}, timeout=30)
    assert len(log_lines(server.log, "client-1")) == 1
    assert log_lines(server.log, "probe-1", timeout=0) == []


def test_a_path_cannot_write_a_line_of_its_own(server):
    # "%0A" in a URL is a newline in the decoded path: logged as it came, any client (no key
    # needed for a 404) could forge a whole access line
    forged = '/x%0A1.2.3.4 "POST /v1/chat/completions" 200 0.1 s request_id=FORGED'
    r = httpx.get(server.url + forged, headers={"X-Request-Id": "forger"}, timeout=30)
    assert r.status_code == 404
    [line] = log_lines(server.log, "forger")
    assert "/x%0A1.2.3.4" in line
    assert not any(line.startswith('1.2.3.4 "POST') for line in server.log().splitlines()), (
        "the path started a line of its own"
    )
