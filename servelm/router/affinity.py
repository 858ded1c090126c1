"""Response affinity: which replica holds each stored Responses API answer.

A replica keeps the responses it made in its own memory (`store`, true by default), so a
continuation (`previous_response_id`) and `GET` / `DELETE /v1/responses/{id}` can only be
answered by the replica that made the response: any other answers 404, or would continue
without the conversation. The router learns id -> replica from the answers it relays (a
body's `id`, the `response.id` a stream opens with) in a bounded table, least recently used
dropped first. An id it does not know (the router restarted, the table dropped it, another
router made it) it asks the available replicas about, all at once, and the first to hold it
wins. A known owner out of rotation is a 503 saying so: another replica would 404, or worse,
answer without the conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

import httpx

from servelm.router.health import auth_headers
from servelm.router.metrics import RouterMetrics
from servelm.router.prefix import RESPONSES
from servelm.router.replicas import Replica, ReplicaSet
from servelm.server.errors import APIError


def response_path(response_id: str) -> str:
    """Where a replica answers for a stored response (the id quoted: it came from a client)."""
    return f"{RESPONSES}/{quote(response_id, safe='')}"


class ResponseOwners:
    def __init__(
        self,
        replicas: ReplicaSet,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        capacity: int,
        timeout_s: float,
        upstream_api_key: str | None = None,
    ) -> None:
        self.replicas = replicas
        self.client = client
        self.metrics = metrics
        self.capacity = capacity
        self.timeout_s = timeout_s  # per replica asked: the health probe's
        self.upstream_api_key = upstream_api_key
        self._owner: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    def __len__(self) -> int:
        return len(self._owner)

    def learn(self, replica: Replica, response: dict[str, Any]) -> None:
        """Remember where `response` (a body, or the one a stream opens with) is stored; one
        made with `store: false` is stored nowhere."""
        response_id = response.get("id")
        if isinstance(response_id, str) and response.get("store") is not False:
            self._remember(response_id, replica.url)

    def forget(self, response_id: str) -> None:
        self._owner.pop(response_id, None)

    async def owner(self, response_id: str, param: str | None = None) -> Replica:
        """The available replica holding `response_id`; APIError 503 when it is known and out
        of rotation, 404 (naming `param`) when no replica asked has it."""
        url = self._owner.get(response_id)
        replica = self.replicas.get(url) if url is not None else None
        if replica is not None and replica.available:
            self._owner.move_to_end(response_id)
            self.metrics.response_owners.labels("known").inc()
            return replica
        if replica is not None:
            self.metrics.response_owners.labels("unavailable").inc()
            raise APIError(
                503,
                f"The replica holding response '{response_id}' ({replica.url}) is unavailable; "
                "retry later.",
                param,
                "replica_unavailable",
                {"Retry-After": "2"},
            )
        # unknown, or its replica left the pool (and what it held with it): ask
        self.forget(response_id)
        asked = [r for r in self.replicas if r.available]
        replica = await self._ask(asked, response_id)
        if replica is None:
            self.metrics.response_owners.labels("missing").inc()
            unasked = len(self.replicas) - len(asked)
            note = f" ({unasked} unavailable replicas not asked)" if unasked else ""
            message = f"Response with id '{response_id}' not found on any replica{note}."
            raise APIError(404, message, param, "response_not_found")
        self.metrics.response_owners.labels("found").inc()
        self._remember(response_id, replica.url)
        return replica

    async def _ask(self, replicas: list[Replica], response_id: str) -> Replica | None:
        tasks = [asyncio.ensure_future(self._holds(r, response_id)) for r in replicas]
        try:
            for done in asyncio.as_completed(tasks):
                replica = await done
                if replica is not None:
                    return replica
            return None
        finally:  # the first to answer yes wins: the others are not waited for
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _holds(self, replica: Replica, response_id: str) -> Replica | None:
        headers = auth_headers(replica, self.upstream_api_key)
        url = replica.url + response_path(response_id)
        with contextlib.suppress(httpx.HTTPError):  # a replica that cannot say does not hold it
            resp = await self.client.get(url, headers=headers, timeout=self.timeout_s)
            if resp.status_code == 200:
                return replica
        return None

    def _remember(self, response_id: str, url: str) -> None:
        self._owner[response_id] = url
        self._owner.move_to_end(response_id)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
