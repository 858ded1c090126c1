"""A signal drains in-flight requests, however it is sent (issue #32).

Ctrl-C, SIGTERM to the server's pid, and SIGTERM or SIGINT to its whole process group (a
terminal, `kill -TERM -PGID`, systemd's control-group kill, which reach the engine process too)
each let four streams in flight finish with their finish_reason, refuse new connections, and
end with exit 0, no traceback and no process of the server left. A second signal during the
drain stops at once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.live_server import LiveServer, engine_child

STREAMS = 4


def stream(url: str, max_tokens: int, started: threading.Event, result: dict) -> None:
    """One streamed completion; `result` gets its finish_reason (None: cut) and its tokens
    (from the usage chunk)."""
    body = {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result["finish_reason"], result["chunks"] = None, 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    result["chunks"] += 1
                    started.set()
                    result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)


def start_streams(server: LiveServer, max_tokens: int) -> tuple[list[threading.Thread], list]:
    results, threads = [], []
    for _ in range(STREAMS):
        started, result = threading.Event(), {}
        t = threading.Thread(target=stream, args=(server.url, max_tokens, started, result))
        t.start()
        assert started.wait(60), "no token arrived"
        threads.append(t)
        results.append(result)
    return threads, results


def group_gone(pgid: int, timeout: float = 10) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    "sig,group",
    [
        (signal.SIGTERM, False),
        (signal.SIGINT, False),
        (signal.SIGTERM, True),
        (signal.SIGINT, True),
    ],
    ids=["sigterm-pid", "ctrl-c-pid", "sigterm-group", "ctrl-c-group"],
)
def test_a_signal_drains_the_streams_and_exits_zero(default_model_dir, sig, group):
    server = LiveServer(
        default_model_dir,
        "--served-model-name",
        "default",
        "--shutdown-timeout",
        "300",
        new_session=True,
    )
    try:
        # short answers: on a loaded machine the drain still ends well inside its timeout
        threads, results = start_streams(server, max_tokens=48)
        (os.killpg if group else os.kill)(server.proc.pid, sig)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new connections while draining
            httpx.get(server.url + "/health", timeout=5)
        for t in threads:
            t.join(300)
        assert server.proc.wait(300) == 0
        assert [r["finish_reason"] for r in results] == ["length"] * STREAMS, results
        assert all(r.get("tokens") == 48 for r in results), results
        assert "Traceback" not in server.log(), server.log()
        assert group_gone(server.proc.pid), "a process of the server was left behind"
    finally:
        server.stop(signal.SIGKILL)


def test_a_second_signal_stops_at_once(default_model_dir):
    server = LiveServer(
        default_model_dir,
        "--served-model-name",
        "default",
        "--shutdown-timeout",
        "120",
        new_session=True,
    )
    try:
        threads, results = start_streams(server, max_tokens=4000)  # minutes of decoding
        os.killpg(server.proc.pid, signal.SIGTERM)
        time.sleep(1)
        t0 = time.time()
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.time() - t0 < 15
        for t in threads:
            t.join(30)
        assert all(r["finish_reason"] is None for r in results), results  # cut, not finished
        assert group_gone(server.proc.pid), "a process of the server was left behind"
        assert "Traceback" not in server.log(), server.log()  # cancelled as asked: no errors
    finally:
        server.stop(signal.SIGKILL)


def test_streams_left_at_the_timeout_end_with_a_503_and_done(default_model_dir):
    # --shutdown-timeout ends what is still running: each stream hears why, in-band, and ends
    # with [DONE] (uvicorn alone would cut them mid-chunk, with a traceback each)
    server = LiveServer(
        default_model_dir,
        "--served-model-name",
        "default",
        "--shutdown-timeout",
        "3",
        new_session=True,
    )
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def last_events(started: threading.Event, out: list) -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    started.set()

    try:
        events: list[list[str]] = [[] for _ in range(2)]
        threads = []
        for out in events:
            started = threading.Event()
            threads.append(threading.Thread(target=last_events, args=(started, out)))
            threads[-1].start()
            assert started.wait(60), "no token arrived"
        t0 = time.time()
        os.killpg(server.proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 0 and time.time() - t0 < 10
        for out in events:
            assert out[-1] == "[DONE]", out[-3:]
            error = json.loads(out[-2])["error"]
            assert (
                "shutting down" in error["message"] and "--shutdown-timeout 3" in error["message"]
            )
        assert "Traceback" not in server.log(), server.log()
        assert group_gone(server.proc.pid), "a process of the server was left behind"
    finally:
        server.stop(signal.SIGKILL)


def feed_open_through_a_signal(url: str, pid: int) -> float:
    """Opens the dashboard's feed, sends SIGTERM to `pid` once the first event is in, and
    returns how long the feed then stayed open (seconds)."""
    with httpx.stream("GET", url + "/dashboard/feed", timeout=60) as feed:
        lines = feed.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        for _ in lines:  # until the server ends the stream
            pass
    return time.monotonic() - signalled


def test_an_open_dashboard_does_not_hold_up_the_drain(tiny_model_dir):
    from servelm.server.dashboard import STREAM_SECONDS

    server = LiveServer(tiny_model_dir, new_session=True)
    try:
        assert feed_open_through_a_signal(server.url, server.proc.pid) < STREAM_SECONDS / 3
        assert server.proc.wait(STREAM_SECONDS / 2) == 0
    finally:
        server.stop(signal.SIGKILL)


def test_a_signal_while_the_model_loads_stops_the_server_and_its_engine(default_model_dir):
    """SIGTERM to the pid before the port opens (a pod deleted while it loads; as PID 1 an
    unhandled SIGTERM is dropped and the pod came up anyway): exit 0, the engine stopped."""
    server = LiveServer(default_model_dir, wait=False, new_session=True)
    try:
        deadline = time.time() + 60
        while engine_child(server.proc.pid) is None:  # the engine process is loading
            assert time.time() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()
        assert "stopped while the model was loading" in server.log()
        assert "Traceback" not in server.log(), server.log()
        assert group_gone(server.proc.pid), "the engine process was left behind"
    finally:
        server.stop(signal.SIGKILL)


def test_a_second_signal_after_the_drain_lets_the_server_finish_stopping(tiny_model_dir):
    """The port is closed but the server still stops its engine and removes its IPC folder:
    a second Ctrl-C then (a person pressing it twice) killed it halfway through that."""
    server = LiveServer(tiny_model_dir, new_session=True)
    try:
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.time() + 30
        while True:  # until the port is closed: serving is over
            try:
                httpx.get(server.url + "/health", timeout=1)
            except httpx.HTTPError:
                break
            assert time.time() < deadline
            time.sleep(0.02)
        os.kill(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(30) == 0, server.log()
        assert "Traceback" not in server.log(), server.log()
    finally:
        server.stop(signal.SIGKILL)
