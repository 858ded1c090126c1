"""The admin API: list, add, remove and drain replicas at run time (behind the admin key).

GET    /admin/replicas                       every replica with its state and load
POST   /admin/replicas {"url", "weight"?, "api_key"?}   add (or re-weight / un-drain) one
DELETE /admin/replicas?url=URL               forget it now (open streams still finish)
POST   /admin/replicas/drain?url=URL         no new requests; leaves when its streams end
GET    /admin/timings?request_id=ID          per-chunk receive times (--debug only)
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from servelm.server.errors import APIError, error_response

if TYPE_CHECKING:
    from servelm.router.app import Router

Handler = Callable[[Request], Awaitable[Response]]


def check_admin(router: Router, request: Request) -> None:
    """Admin routes need `Authorization: Bearer <admin key>`; without --admin-key they are off."""
    admin_key = router.config.admin_key
    if not admin_key:
        raise APIError(403, "The admin API is disabled; start the router with --admin-key.")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), admin_key.encode()
    ):
        raise APIError(401, "Invalid or missing admin key.", None, "invalid_api_key")


def admin_routes(router: Router) -> list[Route]:
    def guarded(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                check_admin(router, request)
                return await handler(request)
            except APIError as exc:
                return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)
            except ValueError as exc:
                return error_response(400, str(exc))

        return wrapped

    def url_param(request: Request) -> str:
        url = request.query_params.get("url")
        if not url:
            raise APIError(400, "give the replica as ?url=...", "url")
        return url

    async def list_replicas(_: Request) -> Response:
        return JSONResponse(
            {"policy": router.policy.name, "replicas": [r.describe() for r in router.replicas]}
        )

    async def add_replica(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise APIError(400, "Request body is not valid JSON.") from None
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise APIError(400, 'give {"url": ..., "weight": ...}', "url")
        replica = router.replicas.add(
            body["url"], float(body.get("weight", 1.0)), body.get("api_key"), source="admin"
        )
        await router.health.probe(replica)  # admitted right away when it is up
        return JSONResponse(replica.describe(), status_code=201)

    async def remove_replica(request: Request) -> Response:
        replica = router.replicas.remove(url_param(request))
        if replica is None:
            raise APIError(404, "no such replica", "url")
        return JSONResponse(replica.describe())

    async def drain_replica(request: Request) -> Response:
        replica = router.replicas.drain(url_param(request))
        if replica is None:
            raise APIError(404, "no such replica", "url")
        return JSONResponse(replica.describe(), status_code=202)

    async def timings(request: Request) -> Response:
        if router.timings is None:
            raise APIError(404, "chunk timings are recorded only with --debug")
        times = router.timings.get(request.query_params.get("request_id", ""))
        if times is None:
            raise APIError(404, "no stream with that request id", "request_id")
        return JSONResponse({"chunk_receive_times": times})

    return [
        Route("/admin/replicas", guarded(list_replicas), methods=["GET"]),
        Route("/admin/replicas", guarded(add_replica), methods=["POST"]),
        Route("/admin/replicas", guarded(remove_replica), methods=["DELETE"]),
        Route("/admin/replicas/drain", guarded(drain_replica), methods=["POST"]),
        Route("/admin/timings", guarded(timings), methods=["GET"]),
    ]
