"""The router's own Prometheus metrics (its own registry) and the debug per-chunk timing log.

Names use the `servelm_router:` prefix so they never collide with a replica's `servelm:` series
when both are scraped into one Prometheus.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelm.router.replicas import Replica

_DELAY_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "servelm_router:"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by replica and HTTP status.",
            ["replica", "status"],
            registry=r,
        )
        # Requests refused for want of a replica (replica="none") are the demand signal that
        # scales engines up from zero (deploy/helm: the ScaledObject); the series exists at 0
        # from the start so that the query has data before the first refusal.
        self.requests.labels("none", "503")
        self.decisions = Counter(
            p + "routing_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Requests retried on another replica before the first byte.",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            p + "ejections",
            "Replicas taken out of rotation by the circuit breaker.",
            ["replica"],
            registry=r,
        )
        self.rate_limited = Counter(
            p + "rate_limit_rejections",
            "Requests rejected with 429, by key and limit.",
            ["key", "limit"],
            registry=r,
        )
        self.stream_errors = Counter(
            p + "stream_errors",
            "Streams ended with an in-band error event.",
            ["replica"],
            registry=r,
        )
        self.response_owners = Counter(
            p + "response_owner_lookups",
            "Requests for a stored response (previous_response_id, GET, DELETE) by how its "
            "replica was found: known, found (by asking the replicas), missing, unavailable.",
            ["outcome"],
            registry=r,
        )
        self.forward_delay = Histogram(
            p + "stream_chunk_forward_seconds",
            "From receiving a stream chunk from a replica to handing it to the client.",
            buckets=_DELAY_BUCKETS,
            registry=r,
        )
        self.replica_up = Gauge(
            p + "replica_up", "1 when the replica takes new requests.", ["replica"], registry=r
        )
        self.in_flight = Gauge(
            p + "replica_in_flight", "Router requests open on the replica.", ["replica"], registry=r
        )
        self.load = Gauge(
            p + "replica_load",
            "Waiting + running as the router estimates it.",
            ["replica"],
            registry=r,
        )

    def render(self, replicas: Iterable[Replica]) -> bytes:
        for g in (self.replica_up, self.in_flight, self.load):
            g.clear()  # removed replicas disappear from the gauges
        for rep in replicas:
            self.replica_up.labels(rep.url).set(1 if rep.available else 0)
            self.in_flight.labels(rep.url).set(rep.in_flight)
            self.load.labels(rep.url).set(rep.load)
        return generate_latest(self.registry)


class ChunkTimings:
    """Wall-clock receive time of each chunk of the last `capacity` streams (debug mode only)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._streams: OrderedDict[str, list[float]] = OrderedDict()

    def start(self, request_id: str) -> list[float]:
        times: list[float] = []
        self._streams[request_id] = times
        while len(self._streams) > self.capacity:
            self._streams.popitem(last=False)
        return times

    def get(self, request_id: str) -> list[float] | None:
        return self._streams.get(request_id)
