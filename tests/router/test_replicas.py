"""The replica set, the replicas file, /metrics parsing and the circuit breaker (no processes)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from servelm.router.health import HealthChecker, parse_load
from servelm.router.metrics import RouterMetrics
from servelm.router.replicas import Lease, ReplicaSet, ReplicaState, parse_replicas_file

SERVELM_METRICS = """\
# TYPE servelm:num_requests_running gauge
servelm:num_requests_running{model_name="a"} 3.0
servelm:num_requests_running{model_name="b"} 1.0
# TYPE servelm:num_requests_waiting gauge
servelm:num_requests_waiting{model_name="a"} 2.0
# TYPE servelm:kv_cache_usage_perc gauge
servelm:kv_cache_usage_perc{model_name="a"} 0.25
"""
VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="x"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="x"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="x"} 0.5
"""


def test_parse_load_reads_servelm_and_vllm_names() -> None:
    assert parse_load(SERVELM_METRICS) == (2.0, 4.0, 0.25)
    assert parse_load(VLLM_METRICS) == (0.0, 4.0, 0.5)
    assert parse_load("# nothing here\n") is None


def test_candidates_follow_state_drain_and_models() -> None:
    rs = ReplicaSet()
    a, b = rs.add("http://a:1/v1/"), rs.add("http://b:1", weight=2)
    assert a.url == "http://a:1"
    assert rs.candidates("m") == []  # pending until a health check passes
    a.state = b.state = ReplicaState.HEALTHY
    a.models, b.models = {"m": {"id": "m"}}, {"n": {"id": "n"}}
    assert rs.candidates("m") == [a] and rs.candidates("n") == [b] and rs.candidates(None) == [a, b]
    assert rs.may_serve("n") and not rs.may_serve("zzz")
    assert [c["id"] for c in rs.model_cards()] == ["m", "n"]
    lease = Lease(a)
    rs.drain(a.url)
    assert rs.candidates("m") == [] and rs.get(a.url) is a  # draining: kept while a stream is open
    lease.release()
    rs.reap()
    assert rs.get(a.url) is None


def test_replicas_file_formats_and_sync() -> None:
    text = "# pool\nhttp://a:1 2.5\nhttp://b:1  # no weight\n"
    specs = parse_replicas_file(text)
    assert [(s.url, s.weight) for s in specs] == [("http://a:1", 2.5), ("http://b:1", 1.0)]
    js = parse_replicas_file('{"replicas": ["http://a:1", {"url": "http://c:1", "weight": 0.1}]}')
    assert [(s.url, s.weight) for s in js] == [("http://a:1", 1.0), ("http://c:1", 0.1)]
    rs = ReplicaSet()
    rs.add("http://static:1")
    rs.sync_file(specs)
    rs.sync_file(js)
    assert sorted(r.url for r in rs) == ["http://a:1", "http://c:1", "http://static:1"]
    assert rs.get("http://a:1").weight == 1.0


@pytest.mark.parametrize(
    "text, says",
    [
        ("http://a:1\nhttp://b:1 0\n", "line 2: weight must be > 0, got 0.0"),
        ("http://a:1 heavy\n", "line 1: weight must be a number, got 'heavy'"),
        ("http://a:1 1 2\n", "line 1: expected `URL [WEIGHT]`"),
        ("a:1\n", "line 1: replica URL must start with http://"),
        ('["http://a:1", {"url": "http://b:1", "weight": -1}]', "entry 2: weight must be > 0"),
        ('[{"weight": 2}]', "entry 1: a replica needs a URL string, got None"),
        ('{"replicas": [', "not valid JSON"),
    ],
)
def test_a_bad_replicas_file_names_its_line_before_anything_is_applied(text, says) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_replicas_file(text)


@pytest.fixture
def checker() -> HealthChecker:
    return HealthChecker(
        ReplicaSet(),
        httpx.AsyncClient(),
        RouterMetrics(),
        failure_threshold=2,
        cooldown_s=0.2,
        max_cooldown_s=1.0,
    )


def test_breaker_ejects_and_readmits_after_cooldown(checker: HealthChecker) -> None:
    r = checker.replicas.add("http://a:1")
    checker.report_success(r)
    assert r.state is ReplicaState.HEALTHY
    checker.report_failure(r, "timeout")
    assert r.state is ReplicaState.HEALTHY  # one soft failure is not enough
    checker.report_failure(r, "timeout")
    assert r.state is ReplicaState.EJECTED
    checker.report_success(r)
    assert r.state is ReplicaState.EJECTED  # still cooling down
    time.sleep(0.25)
    checker.report_success(r)
    assert r.state is ReplicaState.HEALTHY


def test_breaker_ejects_at_once_on_refusal_and_backs_off_when_flapping(
    checker: HealthChecker,
) -> None:
    r = checker.replicas.add("http://a:1")
    checker.report_success(r)
    checker.report_failure(r, "refused", definitive=True)
    assert r.state is ReplicaState.EJECTED and r.cooldown_s == pytest.approx(0.2)
    time.sleep(0.25)
    checker.report_success(r)
    checker.report_failure(r, "refused", definitive=True)  # right after re-admission: flapping
    assert r.cooldown_s == pytest.approx(0.4)


def test_probe_of_a_closed_port_keeps_a_new_replica_pending(checker: HealthChecker) -> None:
    r = checker.replicas.add("http://127.0.0.1:9")  # discard port: nothing listens

    async def probe() -> None:
        await checker.probe(r)
        await checker.client.aclose()

    asyncio.run(probe())
    assert r.state is ReplicaState.PENDING and "connect" in (r.last_error or "")


def test_a_slow_replica_does_not_delay_noticing_a_dead_one() -> None:
    # "slow" answers its probes after 2 s; "dead" answers, then refuses connections (killed).
    killed = False

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow":
            await asyncio.sleep(2.0)
        elif killed:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"data": []})

    async def main() -> float | None:
        nonlocal killed
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        checker = HealthChecker(ReplicaSet(), client, RouterMetrics(), interval_s=0.1)
        checker.replicas.add("http://slow:1")
        dead = checker.replicas.add("http://dead:1")
        loop = asyncio.create_task(checker.run())
        await asyncio.sleep(0.3)
        assert dead.state is ReplicaState.HEALTHY
        killed, t0 = True, time.monotonic()
        while dead.state is not ReplicaState.EJECTED and time.monotonic() - t0 < 3.0:
            await asyncio.sleep(0.02)
        loop.cancel()
        await client.aclose()
        return time.monotonic() - t0 if dead.state is ReplicaState.EJECTED else None

    ejected_after = asyncio.run(main())
    assert ejected_after is not None and ejected_after < 0.5  # the next interval, not the slow one


def keyed_replica(wanted: dict[str, str | None]):
    """A stand-in for `servelm serve --api-key`: /health and /metrics open, every other path
    401 without `wanted["key"]`; it refuses connections once `wanted["key"]` is None (killed)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if wanted["key"] is None:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=SERVELM_METRICS)
        if request.headers.get("authorization") != f"Bearer {wanted['key']}":
            body = {"error": {"message": "Invalid or missing API key.", "code": "invalid_api_key"}}
            return httpx.Response(401, json=body)
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})

    return handler


def test_a_replica_refusing_the_routers_key_stays_out_of_rotation() -> None:
    wanted: dict[str, str | None] = {"key": "sk-rep"}

    async def main() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(keyed_replica(wanted)))
        checker = HealthChecker(ReplicaSet(), client, RouterMetrics(), failure_threshold=3)
        keyless = checker.replicas.add("http://keyless:1")  # no --upstream-api-key
        wrong = checker.replicas.add("http://wrong:1", api_key="sk-wrong")
        right = checker.replicas.add("http://right:1", api_key="sk-rep")
        await checker.check_all()
        # /health and /metrics answered 200, /v1/models 401: not admitted, and it says why
        assert keyless.state is ReplicaState.PENDING and keyless.failures == 1
        assert "/v1/models answered 401" in keyless.last_error
        assert "sent none" in keyless.last_error and "--upstream-api-key" in keyless.last_error
        assert wrong.state is ReplicaState.PENDING
        assert "refuses the router's API key" in wrong.last_error
        assert right.state is ReplicaState.HEALTHY and right.models == {"m": {"id": "m"}}
        assert checker.replicas.candidates("m") == [right]  # traffic goes to the one that works
        wanted["key"] = "sk-new"  # restarted with another key: out at once, not after 3 probes
        await checker.probe(right)
        assert right.state is ReplicaState.EJECTED and "401" in right.last_error
        await client.aclose()

    asyncio.run(main())


def test_an_ejected_replica_shows_no_stale_load() -> None:
    wanted: dict[str, str | None] = {"key": "sk-rep"}

    async def main() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(keyed_replica(wanted)))
        checker = HealthChecker(ReplicaSet(), client, RouterMetrics(), upstream_api_key="sk-rep")
        r = checker.replicas.add("http://a:1")
        await checker.probe(r)
        seen = r.describe()
        assert (seen["state"], seen["running"], seen["load"]) == ("healthy", 4.0, 6.0)
        # one soft failure leaves it in rotation, with its load: a busy replica's stays counted
        checker.report_failure(r, "the replica failed mid-stream")
        assert r.describe()["running"] == 4.0
        wanted["key"] = None  # killed
        await checker.probe(r)
        gone = r.describe()
        assert gone["state"] == "ejected"
        assert (gone["waiting"], gone["running"], gone["kv_usage"]) == (None, None, None)
        assert gone["load"] == 0.0  # the router's own count: nothing open on it
        await client.aclose()

    asyncio.run(main())
