"""`GET /dashboard` on the router: one panel per replica (each replica's own feed, relayed),
plus the router's view: replica states and loads, requests in flight, and policy decisions.

    /dashboard                 the same page as a server's (servelm/server/dashboard), router mode
    /dashboard/static/<file>   its assets
    /dashboard/feed            server-sent events: {"kind": "router", "policy", "replicas": [
                               {url, state, in_flight, waiting, running, kv_usage, load,
                                "feed": that replica's latest /dashboard/feed payload}], ...}

While a page is connected the router follows each replica's /dashboard/feed (with the upstream
key, as its health checks do) and keeps the latest event of each as bytes, spliced into its own
events without decoding them again; with no page connected it follows none. With API keys
(--api-keys-file) the page and the feed need one, like /v1/models.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from servelm.router.health import auth_headers
from servelm.router.policies import Decision, RouteRequest, RoutingPolicy
from servelm.router.replicas import Replica
from servelm.server.dashboard import (
    ASK_FOR_BASIC,
    FeedHub,
    basic_as_bearer,
    page,
    static_response,
)
from servelm.server.errors import error_response

if TYPE_CHECKING:
    from servelm.router.app import Router

PUBLISH_INTERVAL = 0.25  # at most 4 events a second, whatever the number of replicas
HEARTBEAT = 1.0
RECENT_DECISIONS = 40
_FEED_TIMEOUT = httpx.Timeout(connect=2.0, read=5.0, write=5.0, pool=None)  # replicas beat 1/s


class RecordingPolicy(RoutingPolicy):
    """The router's policy, unchanged, remembering its last decisions for the page."""

    def __init__(self, inner: RoutingPolicy, recent: deque) -> None:
        self.inner, self.recent = inner, recent
        self.name = inner.name

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Decision:
        decision = self.inner.choose(candidates, req)
        self.recent.append(
            {
                "time": round(time.time(), 3),
                "replica": decision.replica.url,
                "reason": decision.reason,
            }
        )
        return decision


class RouterDashboard(FeedHub):
    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        router.proxy.policy = RecordingPolicy(router.proxy.policy, self.recent)
        self.feeds: dict[str, bytes] = {}  # replica url -> its latest event's JSON
        self.errors: dict[str, str] = {}
        self.followers: dict[str, asyncio.Task] = {}
        self._fresh = 0  # replica events received (the publisher compares it)
        self._publisher: asyncio.Task | None = None

    def _start(self) -> None:
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())

    def _stop(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            self._publisher = None
        for task in self.followers.values():
            task.cancel()
        self.followers.clear()
        self.feeds.clear()

    async def _publish_loop(self) -> None:
        last = 0.0
        seen = -1
        while True:
            self._sync_followers()
            now = time.monotonic()
            if self._fresh != seen or now - last >= HEARTBEAT:
                seen, last = self._fresh, now
                self.publish()
            await asyncio.sleep(PUBLISH_INTERVAL)

    def _sync_followers(self) -> None:
        urls = {r.url for r in self.router.replicas}
        for url in list(self.followers):
            if url not in urls:
                self.followers.pop(url).cancel()
                self.feeds.pop(url, None)
        for r in self.router.replicas:
            if r.url not in self.followers:
                self.followers[r.url] = asyncio.get_running_loop().create_task(self._follow(r))

    async def _follow(self, replica: Replica) -> None:
        """Keep the latest event of one replica's feed. The replica ends each stream after a
        while (servelm.server.dashboard.STREAM_SECONDS): reconnect at once, keeping the last
        event; after a failure, drop it and retry in a second."""
        headers = auth_headers(replica, self.router.config.upstream_api_key)
        url = replica.url
        while True:
            failure = None
            try:
                async with self.router.client.stream(
                    "GET", url + "/dashboard/feed", headers=headers, timeout=_FEED_TIMEOUT
                ) as resp:
                    if resp.status_code != 200:
                        failure = f"HTTP {resp.status_code}"
                    else:
                        self.errors.pop(url, None)
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                self.feeds[url] = line[6:].encode()
                                self._fresh += 1
            except httpx.HTTPError as exc:
                failure = type(exc).__name__
            if failure is not None:
                self.errors[url] = failure
                self.feeds.pop(url, None)
                await asyncio.sleep(1.0)

    def publish(self) -> None:
        router = self.router
        decisions: dict[str, float] = {}
        for family in router.metrics.decisions.collect():
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("policy") == router.policy.name:
                    decisions[s.labels["reason"]] = s.value
        parts = []
        for r in router.replicas:
            d = r.describe()
            info = {k: d[k] for k in ("url", "state", "draining", "in_flight", "waiting",
                                      "running", "kv_usage", "load")}  # fmt: skip
            if r.url in self.errors:
                info["feed_error"] = self.errors[r.url]
            head = json.dumps(info)[:-1].encode()
            parts.append(head + b', "feed": ' + self.feeds.get(r.url, b"null") + b"}")
        head = {
            "kind": "router",
            "time": time.time(),
            "policy": router.policy.name,
            "decisions": decisions,
            "recent": list(self.recent),
            "requests_in_flight": sum(r.in_flight for r in router.replicas),
        }
        self._updated(
            json.dumps(head)[:-1].encode() + b', "replicas": [' + b",".join(parts) + b"]}"
        )


def dashboard_routes(router: Router, board: RouterDashboard) -> list[Route]:

    def refuse(request: Request) -> Response | None:
        """401 without a valid key when keys are required (Bearer, or Basic for a browser)."""
        if not router.limiter.enabled:
            return None
        raw = request.headers.get("authorization", "").encode("latin-1")
        header = basic_as_bearer(raw).decode("latin-1")
        if router.limiter.authenticate(header) is not None:
            return None
        refused = error_response(
            401,
            "Invalid or missing API key.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        # A second header, not "Bearer, Basic ..." in one: browsers read only a header's first
        # scheme, and offer their login box only for Basic.
        refused.raw_headers.append((b"www-authenticate", ASK_FOR_BASIC))
        return refused

    async def dashboard_page(request: Request) -> Response:
        refused = refuse(request)
        return refused or Response(page("router"), media_type="text/html; charset=utf-8")

    async def dashboard_static(request: Request) -> Response:
        refused = refuse(request)
        return refused or static_response(request.path_params["name"])

    async def dashboard_feed(request: Request) -> Response:
        return refuse(request) or board.response()

    return [
        Route("/dashboard", dashboard_page, methods=["GET"]),
        Route("/dashboard/static/{name}", dashboard_static, methods=["GET"]),
        Route("/dashboard/feed", dashboard_feed, methods=["GET"]),
    ]
