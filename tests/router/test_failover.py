"""Failures: retry before the first byte, 503 when all are down, a replica killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai

from servelm.router.app import Router, build_app
from servelm.router.config import RouterConfig
from servelm.router.replicas import ReplicaState
from tests.router.conftest import MODEL, Proc, admin_replicas, free_port, router, wait_for

STREAMS = 16
RUNNING = "servelm:num_requests_running{"
STREAM_TOKENS = 2000  # long enough that no stream can finish before the kill


def in_process_router(urls: list[str]) -> Router:
    """A router without its health loop; every replica marked healthy, as if just checked."""
    r = Router(RouterConfig(replicas=urls, policy="round-robin"))
    for rep in r.replicas:
        rep.state, rep.models = ReplicaState.HEALTHY, {MODEL: {"id": MODEL}}
    return r


async def ask(router: Router, stream: bool = False) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(router))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
        return await client.post("/v1/completions", json=body)


def test_refused_replica_is_retried_before_the_first_byte(cluster: list[Proc]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for stream in (False, True):
        router = in_process_router([dead, cluster[0].url])  # round-robin tries the dead one first
        resp = asyncio.run(ask(router, stream))
        assert resp.status_code == 200
        if stream:
            assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text
        else:
            assert resp.json()["usage"]["completion_tokens"] == 3
        assert router.replicas.get(dead).state is ReplicaState.EJECTED  # refused: out at once
        retries = router.metrics.registry.get_sample_value(
            "servelm_router:retries_total", {"reason": "connect"}
        )
        assert retries == 1


def test_all_replicas_down_is_503_with_retry_after() -> None:
    router = in_process_router(
        [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    )
    resp = asyncio.run(ask(router))
    assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    resp = asyncio.run(ask(router))  # now both are ejected: answered without trying
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_replica"


async def stream_one(
    client: openai.AsyncOpenAI, routed: dict[int, str], started: set[int], i: int
) -> tuple[str, str, str]:
    """One long stream; (replica, "ok" | "error", finish reason or error message). `routed`
    learns its replica when the response starts, `started` when its first text arrives."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"stream {i}"}],
        max_tokens=STREAM_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    replica = routed[i] = raw.headers["x-servelm-replica"]
    finish = ""
    try:
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                started.add(i)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    except openai.APIError as exc:  # the in-band error event
        return replica, "error", str(exc)
    return replica, "ok", finish


async def kill_during_streams(r: Proc, victim: Proc) -> dict:
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=120)
    routed: dict[int, str] = {}
    started: set[int] = set()
    streams = [asyncio.create_task(stream_one(client, routed, started, i)) for i in range(STREAMS)]

    def victims_streaming() -> bool:
        """The victim generating all five of its streams (round-robin: 16 = 6 + 5 + 5), as
        its own /metrics says: kill now. What this client has parsed lags the servers (one
        event loop reads 16 streams' backlog): waiting for the victim's text to arrive here
        let its 2,000-token streams finish first on a quiet machine (one CI run)."""
        metrics = httpx.get(victim.url + "/metrics", timeout=5).text
        running = [ln for ln in metrics.splitlines() if ln.startswith(RUNNING)]
        return bool(running) and float(running[0].rsplit(" ", 1)[1]) >= 5

    while not victims_streaming():
        await asyncio.sleep(0.02)
        assert not any(t.done() for t in streams), "a stream ended before the kill"
    victim.kill()
    killed_at = time.monotonic()
    ejected: list[float] = []

    def watch_ejection() -> None:
        # On a thread of its own: this event loop is busy parsing 16 streams' backlog, and a
        # poll queued behind it saw an ejection the router had logged at the kill 3-6 s late.
        with httpx.Client(headers={"Authorization": "Bearer admin-secret"}) as admin:
            while time.monotonic() - killed_at < 10:
                states = admin.get(r.url + "/admin/replicas").json()["replicas"]
                if any(x["url"] == victim.url and x["state"] == "ejected" for x in states):
                    ejected.append(time.monotonic() - killed_at)
                    return
                time.sleep(0.1)

    watcher = threading.Thread(target=watch_ejection, daemon=True)
    watcher.start()
    new_ok = 0
    for i in range(10):  # new requests keep succeeding
        done = await client.completions.create(model=MODEL, prompt=f"new {i}", max_tokens=2)
        new_ok += done.choices[0].finish_reason is not None
    await asyncio.to_thread(watcher.join)
    ejected_after = ejected[0] if ejected else None
    victim.start()  # restart on the same port while the other streams finish
    results = await asyncio.wait_for(asyncio.gather(*streams), timeout=180)  # never a hang
    print(json.dumps({"streams_done_after_kill_s": round(time.monotonic() - killed_at, 2)}))
    return {"results": results, "new_ok": new_ok, "ejected_after": ejected_after}


def test_killed_replica_mid_stream(cluster: list[Proc], log_dir: Path) -> None:
    victim = cluster[2]
    with router([p.url for p in cluster], "round-robin", log_dir, "--eject-cooldown", "2") as r:
        try:
            out = asyncio.run(kill_during_streams(r, victim))
            on_victim = [x for x in out["results"] if x[0] == victim.url]
            on_others = [x for x in out["results"] if x[0] != victim.url]
            assert len(on_victim) == 5 and len(on_others) == 11  # round-robin: 6/5/5
            assert all(status == "error" for _, status, _ in on_victim), on_victim
            assert all((status, why) == ("ok", "length") for _, status, why in on_others), on_others
            assert out["new_ok"] == 10
            assert out["ejected_after"] is not None and out["ejected_after"] < 5.0
            print(json.dumps({"ejected_after_s": round(out["ejected_after"], 2)}))
        finally:
            t0 = time.monotonic()
            if victim.popen is None or victim.popen.poll() is not None:
                victim.start()
            victim.wait_ready()
            print(json.dumps({"restart_ready_after_streams_s": round(time.monotonic() - t0, 2)}))
        readmit = wait_for(
            lambda: all(x["state"] == "healthy" for x in admin_replicas(r.url)), 20, "re-admission"
        )
        print(json.dumps({"readmitted_after_ready_s": round(readmit, 2)}))
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0)
        picks = [
            client.completions.with_raw_response.create(
                model=MODEL, prompt="back", max_tokens=2
            ).headers["x-servelm-replica"]
            for _ in range(6)
        ]
        assert victim.url in picks


def test_a_whole_answer_whose_client_leaves_is_counted(cluster: list[Proc]) -> None:
    # (a stream the client leaves is counted `client_closed`; a whole answer was in no series)
    url = cluster[0].url
    router = in_process_router([url])

    async def leave_early() -> None:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": STREAM_TOKENS,
                    "ignore_eos": True}  # fmt: skip
            try:
                await asyncio.wait_for(client.post("/v1/completions", json=body), 1.0)
            except TimeoutError:
                pass

    asyncio.run(leave_early())
    counted = router.metrics.registry.get_sample_value(
        "servelm_router:requests_total", {"replica": url, "status": "client_closed"}
    )
    assert counted == 1
