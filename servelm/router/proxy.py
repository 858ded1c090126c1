"""Forwarding one request: pick a replica, send, retry once before the first byte, relay the answer.

Before the client has seen a byte, a replica that refuses, drops the connection or answers
502/503/504 costs one retry on another replica. For a stream, "before the first byte" lasts
until the replica's first SSE event, so a replica that dies while queueing is retried too.
After that, a failure becomes an in-band `data: {"error": ...}` event then `data: [DONE]`:
the client always gets an ending, never a hang (a Responses stream: `response.failed`). No read
timeout: a long answer is never cut. A request pinned to the replica holding its previous
response (affinity.py) is not retried elsewhere: no other replica can answer it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from starlette.responses import Response

from servelm.router.health import HealthChecker, auth_headers
from servelm.router.metrics import ChunkTimings, RouterMetrics
from servelm.router.policies import RouteRequest, RoutingPolicy
from servelm.router.prefix import RESPONSES
from servelm.router.replicas import Lease, Replica, ReplicaSet
from servelm.router.streaming import (
    RelayResponse,
    StreamState,
    opening_response,
    relay,
    sse_events,
    usage_total,
)
from servelm.server.errors import APIError

logger = logging.getLogger("servelm.router")

RETRY_STATUSES = frozenset({502, 503, 504})
# Hop-by-hop and recomputed headers never pass through; authorization is the router's to set.
_DROP_REQUEST = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "content-length",
        "accept-encoding",
        "authorization",
    }
)
_DROP_RESPONSE = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "date",
        "server",
    }
)

# (the answer's usage total or None, output tokens seen streaming: a floor when usage is None)
UsageCallback = Callable[[int | None, int], None]
# (the replica, a 200 answer's body or the response a Responses stream opens with)
AnswerCallback = Callable[[Replica, dict[str, Any]], None]


class Proxy:
    def __init__(
        self,
        replicas: ReplicaSet,
        policy: RoutingPolicy,
        health: HealthChecker,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        upstream_api_key: str | None = None,
        max_waiting: int | None = None,
        timings: ChunkTimings | None = None,
    ) -> None:
        self.replicas = replicas
        self.policy = policy
        self.health = health
        self.metrics = metrics
        self.client = client
        self.upstream_api_key = upstream_api_key
        self.max_waiting = max_waiting
        self.timings = timings  # debug mode: per-chunk receive times, x-servelm-replica header

    async def forward(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        extra_headers: dict[str, str],
        on_usage: UsageCallback,
        want_usage: bool = False,
        pinned: Replica | None = None,
        on_answer: AnswerCallback | None = None,
    ) -> Response:
        """Answer `body` (already parsed) from a replica (`pinned`: from that one only); raise
        APIError when none can."""
        request_id = headers.get("x-request-id") or f"route-{uuid.uuid4().hex[:24]}"
        stream = bool(body.get("stream"))
        strip_usage = False
        # (a Responses stream always ends with its usage, and has no stream_options)
        if stream and want_usage and path != RESPONSES:  # ask for the usage the limiter needs ...
            options = (
                body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            )
            if not options.get("include_usage"):
                body = {**body, "stream_options": {**options, "include_usage": True}}
                strip_usage = True  # ... and keep it from a client that did not ask for it
        content = json.dumps(body).encode()
        model = body.get("model") if isinstance(body.get("model"), str) else None
        tried: set[str] = set()
        failure: APIError | None = None
        for attempt in range(2):
            replica = self._pick(path, model, body, tried, pinned)
            if replica is None:
                break
            retry = attempt == 0 and pinned is None  # another replica may answer if this fails
            tried.add(replica.url)
            lease = Lease(replica)
            upstream: httpx.Response | None = None
            handed_over = False  # a stream's lease and upstream belong to its relay from then on
            try:
                upstream = await self._send(replica, path, content, headers, request_id)
                if upstream.status_code in RETRY_STATUSES and retry:
                    self.metrics.retries.labels(f"status_{upstream.status_code}").inc()
                    failure = APIError(
                        upstream.status_code,
                        f"replica {replica.url} answered {upstream.status_code}",
                        headers={"Retry-After": "1"},
                    )
                    continue
                out_headers = self._out_headers(replica, upstream, extra_headers, request_id)
                if stream and upstream.status_code == 200:
                    response = await self._stream(
                        replica,
                        lease,
                        upstream,
                        out_headers,
                        request_id,
                        on_usage,
                        strip_usage,
                        want_usage,
                        path == RESPONSES,
                        on_answer,
                    )
                    handed_over = True
                    return response
                return await self._whole(replica, lease, upstream, out_headers, on_usage, on_answer)
            except httpx.HTTPError as exc:  # nothing sent to the client yet: retry
                failure = self._transport_failure(replica, exc, retry)
            except asyncio.CancelledError:  # the client went away while we waited: counted,
                # as a stream it leaves is (`client_closed`), then let go
                self.metrics.requests.labels(replica.url, "client_closed").inc()
                raise
            finally:  # also on cancellation
                if not handed_over:
                    lease.release()
                    if upstream is not None:
                        await upstream.aclose()
        on_usage(0, 0)  # nothing was generated: give the tokens back
        self.replicas.reap()
        self.metrics.requests.labels("none", str(failure.status if failure else 503)).inc()
        if failure is None:
            if pinned is not None:  # (checked available just before: so it is saturated)
                raise APIError(
                    503,
                    f"The replica holding the previous response ({pinned.url}) is saturated; "
                    "retry later.",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                )
            if self.replicas.candidates(model):
                raise APIError(
                    503,
                    "Every replica is saturated; retry later.",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                )
            raise APIError(
                503,
                f"No replica is available{f' for model {model}' if model else ''}; retry later.",
                code="no_replica",
                headers={"Retry-After": "2"},
            )
        raise failure

    def _pick(
        self,
        path: str,
        model: str | None,
        body: dict[str, Any],
        tried: set[str],
        pinned: Replica | None,
    ) -> Replica | None:
        if pinned is not None:
            candidates = [pinned] if pinned.available else []
        else:
            candidates = self.replicas.candidates(model)
        candidates = [r for r in candidates if r.url not in tried]
        if self.max_waiting is not None:
            candidates = [
                r for r in candidates if r.waiting is None or r.waiting < self.max_waiting
            ]
        if not candidates:
            return None
        if pinned is not None:
            self.metrics.decisions.labels(self.policy.name, "response_affinity").inc()
            return pinned
        decision = self.policy.choose(candidates, RouteRequest(model, body, path))
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        return decision.replica

    async def send_to(
        self,
        replica: Replica,
        method: str,
        path: str,
        headers: dict[str, str],
        extra_headers: dict[str, str],
    ) -> Response:
        """A request without a body (GET or DELETE of a stored response) to the one replica
        that can answer it; APIError 503 when it fails (no other replica to try)."""
        request_id = headers.get("x-request-id") or f"route-{uuid.uuid4().hex[:24]}"
        lease = Lease(replica)
        upstream: httpx.Response | None = None
        try:
            upstream = await self._send(replica, path, None, headers, request_id, method)
            out_headers = self._out_headers(replica, upstream, extra_headers, request_id)
            return await self._whole(replica, lease, upstream, out_headers, lambda *_: None)
        except httpx.HTTPError as exc:
            self.metrics.requests.labels(replica.url, "503").inc()
            raise self._transport_failure(replica, exc, retry=False) from None
        finally:
            lease.release()
            if upstream is not None:
                await upstream.aclose()

    async def _send(
        self,
        replica: Replica,
        path: str,
        content: bytes | None,
        headers: dict[str, str],
        request_id: str,
        method: str = "POST",
    ) -> httpx.Response:
        out = {k: v for k, v in headers.items() if k.lower() not in _DROP_REQUEST}
        out.update(auth_headers(replica, self.upstream_api_key))
        out["x-request-id"] = request_id
        out["accept-encoding"] = "identity"  # pass bytes through as they come, no re-encoding
        if content is not None:
            out["content-type"] = "application/json"
        request = self.client.build_request(
            method, replica.url + path, content=content, headers=out
        )
        return await self.client.send(request, stream=True)

    def _out_headers(
        self,
        replica: Replica,
        upstream: httpx.Response,
        extra_headers: dict[str, str],
        request_id: str,
    ) -> dict[str, str]:
        out = {**_response_headers(upstream), **extra_headers, "x-request-id": request_id}
        if self.timings is not None:
            out["x-servelm-replica"] = replica.url
        return out

    def _transport_failure(self, replica: Replica, exc: httpx.HTTPError, retry: bool) -> APIError:
        refused = isinstance(exc, httpx.ConnectError)
        self.health.report_failure(replica, f"{type(exc).__name__}: {exc}", definitive=refused)
        if retry:
            self.metrics.retries.labels("connect" if refused else "transport").inc()
        logger.warning(
            "replica %s failed before the first byte: %s: %s", replica.url, type(exc).__name__, exc
        )
        return APIError(
            503,
            f"The replica failed ({type(exc).__name__}); retry later.",
            code="replica_failed",
            headers={"Retry-After": "1"},
        )

    async def _whole(
        self,
        replica: Replica,
        lease: Lease,
        upstream: httpx.Response,
        headers: dict[str, str],
        on_usage: UsageCallback,
        on_answer: AnswerCallback | None = None,
    ) -> Response:
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
        lease.release()
        self.replicas.reap()
        self.metrics.requests.labels(replica.url, str(upstream.status_code)).inc()
        if upstream.status_code != 200:
            on_usage(0, 0)
            return Response(content, upstream.status_code, headers)
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        on_usage(usage_total(answer), 0)
        if on_answer is not None and isinstance(answer, dict):
            on_answer(replica, answer)
        return Response(content, upstream.status_code, headers)

    async def _stream(
        self,
        replica: Replica,
        lease: Lease,
        upstream: httpx.Response,
        headers: dict[str, str],
        request_id: str,
        on_usage: UsageCallback,
        strip_usage: bool,
        count_output: bool,
        typed: bool,
        on_answer: AnswerCallback | None,
    ) -> Response:
        events = sse_events(upstream.aiter_raw())
        try:  # an error here is still before the first byte: the caller retries
            first = await events.__anext__()
        except StopAsyncIteration:
            raise httpx.RemoteProtocolError("the stream ended before its first event") from None
        head = opening_response(first) if typed else None
        if on_answer is not None and head is not None:
            on_answer(replica, head)
        times = self.timings.start(request_id) if self.timings is not None else None

        def finish(state: StreamState) -> None:
            self.replicas.reap()
            self.metrics.requests.labels(replica.url, state.outcome).inc()
            if state.error is not None:
                self.metrics.stream_errors.labels(replica.url).inc()
                self.health.report_failure(replica, state.error)
            on_usage(state.usage_total, state.output_seen)

        state = StreamState(
            replica, lease, upstream, strip_usage, finish, times, count_output, typed, head
        )
        return RelayResponse(
            relay(first, events, state, self.metrics.forward_delay), state, headers
        )


def _response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
