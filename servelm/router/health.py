"""Replica health: active probes (/health, /metrics, /v1/models) and the circuit breaker.

Breaker, per replica:

    PENDING --probe ok--> HEALTHY --refused / 503 / N soft failures--> EJECTED
                             ^                                           |
                             +--- probe ok, once the cool-down is over --+

A refused connection, an explicit 503 or a refused API key (401/403 on any probe) ejects at
once (the replica said so); timeouts and other soft errors eject after `failure_threshold`
in a row. The proxy reports what it sees too, so a dead replica leaves rotation on its first
refused request, not the next probe. A replica ejected again soon after re-admission gets
double the cool-down (up to a cap). A replica out of rotation shows no scraped load (unknown):
its last figures, a stream it was running when it died say, would be stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servelm.router.metrics import RouterMetrics
from servelm.router.replicas import Replica, ReplicaSet, ReplicaState
from servelm.server.access import PROBE_HEADER

logger = logging.getLogger("servelm.router")

_PREFIXES = ("servelm:", "vllm:")
_WAITING = ("num_requests_waiting",)
_RUNNING = ("num_requests_running",)
_KV = ("kv_cache_usage_perc", "gpu_cache_usage_perc")
_FLAP_WINDOW_S = 30.0
# /health and /metrics are open on servelm and vLLM but /v1/models wants the key: probing all
# three is what tells a replica that would answer every request with 401 from a healthy one.
_KEY_REFUSED = frozenset({401, 403})


def parse_load(text: str) -> tuple[float, float, float] | None:
    """(waiting, running, kv usage) summed over models from Prometheus text; None if absent."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIXES):
            continue
        short = family.name.split(":", 1)[1]
        values = [s.value for s in family.samples]
        if short in _WAITING or short in _RUNNING:
            key = "waiting" if short in _WAITING else "running"
            found[key] = found.get(key, 0.0) + sum(values)
        elif short in _KV and values:
            found["kv"] = max(found.get("kv", 0.0), *values)
    if "waiting" not in found or "running" not in found:
        return None
    return found["waiting"], found["running"], found.get("kv", 0.0)


def auth_headers(replica: Replica, default_key: str | None) -> dict[str, str]:
    key = replica.api_key or default_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_refused(path: str, status: int, headers: dict[str, str]) -> str:
    """The last_error for a probe the replica refused for want of the right API key."""
    why = "refuses the router's API key" if headers else "wants an API key and the router sent none"
    return (
        f"{path} answered {status}: the replica {why}; "
        "check --upstream-api-key (or the replica's api_key)"
    )


class HealthChecker:
    def __init__(
        self,
        replicas: ReplicaSet,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        failure_threshold: int = 2,
        cooldown_s: float = 2.0,
        max_cooldown_s: float = 30.0,
        upstream_api_key: str | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.client = client
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.upstream_api_key = upstream_api_key
        self.on_tick = on_tick

    async def run(self) -> None:
        """Probe every replica each interval, each on its own: a replica slow to answer (a
        busy one can take the whole timeout, three requests in a row) delays its own next
        probe, not that of a dead one beside it."""
        probing: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                if self.on_tick is not None:
                    try:
                        self.on_tick()
                    except ValueError as exc:  # a bad file: what the last good one said stays
                        logger.error("%s; kept the configuration in use", exc)
                    except Exception:  # a bad config file must not stop health checks
                        logger.exception("reloading configuration failed")
                for r in self.replicas:
                    task = probing.get(r.url)
                    if task is None or task.done():
                        probing[r.url] = asyncio.create_task(self.probe(r))
                for url in [u for u in probing if self.replicas.get(u) is None]:
                    probing.pop(url).cancel()  # removed from the pool
                self.replicas.reap()
                await asyncio.sleep(self.interval_s)
        finally:  # stopped (the router shutting down): no probe outlives the loop
            for task in probing.values():
                task.cancel()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))
        self.replicas.reap()

    async def probe(self, r: Replica) -> None:
        headers = auth_headers(r, self.upstream_api_key)
        sent = {**headers, PROBE_HEADER.decode(): "1"}  # (kept out of the replica's log and counts)
        try:
            resp = await self.client.get(r.url + "/health", headers=sent, timeout=self.timeout_s)
        except httpx.ConnectError as exc:
            return self.report_failure(r, f"connect failed: {exc}", definitive=True)
        except httpx.HTTPError as exc:
            return self.report_failure(r, f"health check failed: {type(exc).__name__}: {exc}")
        if resp.status_code in _KEY_REFUSED:
            reason = key_refused("/health", resp.status_code, headers)
            return self.report_failure(r, reason, definitive=True)
        if resp.status_code != 200:
            return self.report_failure(
                r, f"/health answered {resp.status_code}", definitive=resp.status_code == 503
            )
        metrics, models = await asyncio.gather(
            self._get(r, "/metrics", sent), self._get(r, "/v1/models", sent)
        )
        for path, answer in (("/metrics", metrics), ("/v1/models", models)):
            if answer is not None and answer.status_code in _KEY_REFUSED:
                reason = key_refused(path, answer.status_code, headers)
                return self.report_failure(r, reason, definitive=True)
        load = None
        if metrics is not None and metrics.status_code == 200:
            try:
                load = parse_load(metrics.text)
            except ValueError:
                logger.warning("unparsable /metrics from %s", r.url)
        if load is not None:
            r.on_scrape(*load)
        else:
            r.forget_load()
        if models is not None and models.status_code == 200:
            r.models = _model_cards(models.json())
        self.report_success(r)

    async def _get(self, r: Replica, path: str, headers: dict[str, str]) -> httpx.Response | None:
        """The answer whatever its status (None when the request failed): the caller needs
        to tell a refused key (401/403) from a missing endpoint."""
        try:
            return await self.client.get(r.url + path, headers=headers, timeout=self.timeout_s)
        except httpx.HTTPError:
            return None

    def report_failure(self, r: Replica, reason: str, definitive: bool = False) -> None:
        r.failures += 1
        r.last_error = reason
        if r.state is not ReplicaState.HEALTHY:
            r.forget_load()  # pending or already ejected: stays out, with no stale load
            return
        if definitive or r.failures >= self.failure_threshold:
            now = time.monotonic()
            flapping = r.cooldown_s > 0 and now - r.admitted_at < _FLAP_WINDOW_S
            r.cooldown_s = (
                min(2 * r.cooldown_s, self.max_cooldown_s) if flapping else self.cooldown_s
            )
            r.ejected_until = now + r.cooldown_s
            r.state = ReplicaState.EJECTED
            r.forget_load()  # its last scrape (a stream it was running, say) is no longer true
            self.metrics.ejections.labels(r.url).inc()
            logger.warning("ejected %s for %.1f s: %s", r.url, r.cooldown_s, reason)

    def report_success(self, r: Replica) -> None:
        r.failures = 0
        if r.state is ReplicaState.HEALTHY or time.monotonic() < r.ejected_until:
            return
        if r.state is ReplicaState.EJECTED:
            logger.info("re-admitted %s", r.url)
        r.state = ReplicaState.HEALTHY
        r.admitted_at = time.monotonic()
        r.last_error = None


def _model_cards(body: Any) -> dict[str, dict[str, Any]] | None:
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    return {str(m["id"]): m for m in data if isinstance(m, dict) and "id" in m}
