"""The router's HTTP app: the OpenAI routes it proxies, /v1/models, probes, metrics, admin API.

Per request: API key and rate limits (ratelimit.py) -> model known? -> proxy.py picks a
replica with the policy and relays the answer -> the usage corrects the token charge. A
request about a stored response (a continuation, GET / DELETE /v1/responses/{id}) goes to the
replica holding it instead (affinity.py).
Background: the health checker, which also re-reads the replicas and keys files when they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from servelm.router.affinity import ResponseOwners, response_path
from servelm.router.config import FileWatcher, RouterConfig
from servelm.router.health import HealthChecker
from servelm.router.metrics import ChunkTimings, RouterMetrics
from servelm.router.policies import POLICIES, LeastLoaded, PrefixAware, RoundRobin, RoutingPolicy
from servelm.router.prefix import RESPONSES, estimate_prompt_tokens
from servelm.router.proxy import Proxy
from servelm.router.ratelimit import Admission, ApiKey, RateLimited, RateLimiter
from servelm.router.replicas import ReplicaSet, normalize_url, parse_replicas_file
from servelm.server.access import AccessMiddleware
from servelm.server.body_limit import BodyLimitMiddleware
from servelm.server.errors import APIError, error_response, http_error

logger = logging.getLogger("servelm.router")

PROXIED = (
    "/v1/chat/completions",
    "/v1/completions",
    RESPONSES,
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)


def build_policy(config: RouterConfig) -> RoutingPolicy:
    if config.policy == RoundRobin.name:
        return RoundRobin()
    if config.policy == LeastLoaded.name:
        return LeastLoaded(config.seed)
    if config.policy == PrefixAware.name:
        return PrefixAware(
            config.prefix_block_chars,
            config.prefix_max_blocks,
            config.prefix_table_size,
            config.imbalance_abs,
            config.imbalance_rel,
            config.seed,
        )
    raise ValueError(f"unknown policy {config.policy!r}; choose from {sorted(POLICIES)}")


class Router:
    """Everything one router process holds; the routes below are thin wrappers over it."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = ReplicaSet()
        self.weights = {normalize_url(u): w for u, w in config.weights.items()}
        for url in config.replicas:
            self.replicas.add(url, self.weights.get(normalize_url(url), 1.0))
        self.metrics = RouterMetrics()
        self.limiter = RateLimiter()
        self.policy = build_policy(config)
        self.timings = ChunkTimings() if config.debug else None
        self._replicas_file = FileWatcher(config.replicas_file) if config.replicas_file else None
        self._keys_file = FileWatcher(config.api_keys_file) if config.api_keys_file else None
        self.reload_files(initial=True)  # a missing or bad file fails at start-up, not later
        timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=30.0, pool=None)
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0
        )
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.health = HealthChecker(
            self.replicas,
            self.client,
            self.metrics,
            config.health_interval_s,
            config.health_timeout_s,
            config.failure_threshold,
            config.eject_cooldown_s,
            config.max_eject_cooldown_s,
            config.upstream_api_key,
            on_tick=self.reload_files,
        )
        self.owners = ResponseOwners(
            self.replicas,
            self.client,
            self.metrics,
            config.responses_table_size,
            config.health_timeout_s,
            config.upstream_api_key,
        )
        self.proxy = Proxy(
            self.replicas,
            self.policy,
            self.health,
            self.metrics,
            self.client,
            config.upstream_api_key,
            config.max_waiting_per_replica,
            self.timings,
        )

    def reload_files(self, initial: bool = False) -> None:
        """Re-read the replicas and keys files if they changed (always on the first call)."""
        replicas_file, keys_file = self._replicas_file, self._keys_file
        if replicas_file is not None and (replicas_file.changed() or initial):
            try:
                specs = parse_replicas_file(replicas_file.path.read_text())
            except ValueError as exc:
                raise ValueError(f"replicas file {replicas_file.path}: {exc}") from None
            for s in specs:
                s.weight = self.weights.get(normalize_url(s.url), s.weight)
            self.replicas.sync_file(specs)
            logger.info("replicas file: %d replicas", len(specs))
        if keys_file is not None and (keys_file.changed() or initial):
            self.limiter.load_file(keys_file.path)
            logger.info("API keys file loaded")

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        await self.health.check_all()  # first picture of the replicas before taking traffic
        task = asyncio.create_task(self.health.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.client.aclose()

    async def proxied(self, request: Request) -> Response:
        try:
            return await self._proxied(request)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    async def _proxied(self, request: Request) -> Response:
        path = request.url.path
        admission: Admission | None = None
        key = self._authenticate(request) if self.limiter.enabled else None
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "Request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise APIError(400, "Request body must be a JSON object.")
        model = body.get("model")
        if isinstance(model, str) and not self.replicas.may_serve(model):
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        if key is not None:
            admission = self._admit(key, self.limiter.estimate_tokens(path, body))

        def on_usage(total: int | None, output_seen: int) -> None:
            if admission is not None:
                seen = estimate_prompt_tokens(body, path) + output_seen if output_seen else 0
                self.limiter.settle(admission, total, seen)

        async def answer() -> Response:
            pinned = None
            previous = body.get("previous_response_id") if path == RESPONSES else None
            if isinstance(previous, str):
                try:
                    pinned = await self.owners.owner(previous, "previous_response_id")
                except APIError:
                    on_usage(0, 0)  # refused: no tokens used
                    raise
            return await self.proxy.forward(
                path,
                body,
                self._forwarded_headers(request),
                admission.headers if admission else {},
                on_usage,
                want_usage=admission is not None,
                pinned=pinned,
                on_answer=self.owners.learn if path == RESPONSES else None,
            )

        return await unless_disconnected(request, answer())

    async def stored_response(self, request: Request) -> Response:
        """GET / DELETE /v1/responses/{id} (and GET of its input_items), from the replica
        holding it."""
        try:
            key = self._authenticate(request) if self.limiter.enabled else None
            admission = self._admit(key, 0) if key is not None else None  # generates nothing
            response_id = request.path_params["response_id"]

            items = request.url.path.endswith("/input_items")
            path = response_path(response_id) + ("/input_items" if items else "")
            if request.url.query:
                path += "?" + request.url.query

            async def answer() -> Response:
                replica = await self.owners.owner(response_id)
                response = await self.proxy.send_to(
                    replica,
                    request.method,
                    path,
                    self._forwarded_headers(request),
                    admission.headers if admission else {},
                )
                # deleted, or aged out of the replica's store: nowhere to send it now (a 404
                # of its input items may be a page's `after` the replica does not know)
                if not items and (
                    response.status_code == 404
                    or (request.method == "DELETE" and response.status_code == 200)
                ):
                    self.owners.forget(response_id)
                return response

            return await unless_disconnected(request, answer())
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    def _admit(self, key: ApiKey, tokens: int) -> Admission:
        try:
            return self.limiter.admit(key, tokens)
        except RateLimited as exc:
            self.metrics.rate_limited.labels(exc.key.name, exc.limit).inc()
            raise APIError(429, exc.message, None, "rate_limit_exceeded", exc.headers) from None

    @staticmethod
    def _forwarded_headers(request: Request) -> dict[str, str]:
        headers = dict(request.headers)
        if request.client is not None:
            headers["x-forwarded-for"] = request.client.host
        return headers

    def _authenticate(self, request: Request) -> ApiKey:
        key = self.limiter.authenticate(request.headers.get("authorization"))
        if key is None:
            raise APIError(
                401,
                "Invalid or missing API key.",
                None,
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        return key

    def _refused(self, request: Request) -> Response | None:
        """The 401 for a request without a valid key, when keys are required; else None."""
        if self.limiter.enabled:
            try:
                self._authenticate(request)
            except APIError as exc:
                return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)
        return None

    async def models(self, request: Request) -> Response:
        refused = self._refused(request)
        return refused or JSONResponse({"object": "list", "data": self.replicas.model_cards()})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: that model's card from an available replica, else 404."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        name = request.path_params["model"]
        for card in self.replicas.model_cards():
            if card.get("id") == name:
                return JSONResponse(card)
        return error_response(
            404, f"The model `{name}` does not exist.", "model", "model_not_found"
        )

    async def health_route(self, _: Request) -> Response:
        if any(r.available for r in self.replicas):
            return Response(status_code=200)
        return error_response(503, "No replica is available.", headers={"Retry-After": "2"})

    async def metrics_route(self, _: Request) -> Response:
        return Response(self.metrics.render(self.replicas), media_type=CONTENT_TYPE_LATEST)


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Await `work`, cancelling it if the client hangs up first (a non-stream answer or a
    queued stream can take minutes; closing the upstream connection aborts it on the replica).
    The watch ends before a response is returned: a stream watches on its own from then on."""

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; the status is for the logs
    return task.result()


def build_app(router: Router) -> Starlette:
    from servelm.router.admin import admin_routes
    from servelm.router.dashboard import RouterDashboard, dashboard_routes

    board = RouterDashboard(router)
    routes = [Route(p, router.proxied, methods=["POST"]) for p in PROXIED]
    routes += [
        Route(RESPONSES + "/{response_id}", router.stored_response, methods=["GET", "DELETE"]),
        Route(RESPONSES + "/{response_id}/input_items", router.stored_response, methods=["GET"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/v1/models/{model:path}", router.model, methods=["GET"]),
        Route("/health", router.health_route, methods=["GET"]),
        Route("/metrics", router.metrics_route, methods=["GET"]),
        *admin_routes(router),
        *dashboard_routes(router, board),
    ]
    middleware = [
        # each request's id (the client's X-Request-Id or a new one) goes on to the replica and
        # into the router's log line and the replica's
        Middleware(AccessMiddleware),
        # a body over the limit is refused before it is read, as by servelm serve
        Middleware(BodyLimitMiddleware, limit=router.config.max_request_bytes),
    ]
    app = Starlette(
        routes=routes,
        lifespan=router.lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: http_error},
    )
    app.state.router = router
    app.state.dashboard = board  # (closed when the router starts to drain)
    return app
