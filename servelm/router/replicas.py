"""The replica set: each backend's address, weight, models, load and admission state.

Invariants: a replica takes new requests only when `available` (healthy and not draining);
`in_flight` counts the router's open requests on it and only leases change it; a draining
replica leaves the set once `in_flight` reaches zero. Single-threaded (one event loop).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class ReplicaState(str, enum.Enum):
    PENDING = "pending"  # added, not yet seen healthy
    HEALTHY = "healthy"
    EJECTED = "ejected"  # failed; out of rotation until healthy again after a cool-down


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
    return url


@dataclass(eq=False)
class Replica:
    url: str
    weight: float = 1.0
    api_key: str | None = None
    source: str = "static"  # static (flags) | file (replicas file) | admin (admin API)
    state: ReplicaState = ReplicaState.PENDING
    draining: bool = False
    models: dict[str, dict[str, Any]] | None = None  # id -> model card; None = not known yet
    # load as the replica reports it in /metrics (None = no metrics, or out of rotation)
    waiting: float | None = None
    running: float | None = None
    kv_usage: float = 0.0
    in_flight: int = 0
    fresh: int = 0  # dispatched since the last scrape (not in the scraped numbers yet)
    scrape_epoch: int = 0
    # circuit breaker bookkeeping (health.py owns the transitions)
    failures: int = 0
    ejected_until: float = 0.0
    cooldown_s: float = 0.0
    admitted_at: float = 0.0
    last_error: str | None = None

    @property
    def available(self) -> bool:
        return self.state is ReplicaState.HEALTHY and not self.draining

    @property
    def load(self) -> float:
        """Requests queued or running on it: scraped numbers plus what the router sent since."""
        if self.waiting is None or self.running is None:
            return float(self.in_flight)
        return self.waiting + self.running + self.fresh

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def on_scrape(self, waiting: float, running: float, kv_usage: float) -> None:
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self.fresh = 0
        self.scrape_epoch += 1

    def forget_load(self) -> None:
        """No current scrape (no metrics, or out of rotation): the load is unknown, not the
        last figures seen; `load` falls back to the router's own in-flight count."""
        self.waiting = self.running = None
        self.kv_usage = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "weight": self.weight,
            "source": self.source,
            "state": self.state.value,
            "draining": self.draining,
            "models": sorted(self.models or ()),
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": self.kv_usage if self.running is not None else None,  # None: unknown
            "load": self.load,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class Lease:
    """One request's hold on a replica; `release` is idempotent."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._epoch = replica.scrape_epoch
        self._held = True
        replica.in_flight += 1
        replica.fresh += 1

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        r = self.replica
        r.in_flight -= 1
        if r.scrape_epoch == self._epoch:  # not yet folded into a scrape: undo our own count
            r.fresh = max(0, r.fresh - 1)


@dataclass
class ReplicaSpec:
    url: str
    weight: float = 1.0
    api_key: str | None = None


class ReplicaSet:
    def __init__(self) -> None:
        self._by_url: dict[str, Replica] = {}

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    def get(self, url: str) -> Replica | None:
        return self._by_url.get(normalize_url(url))

    def add(
        self, url: str, weight: float = 1.0, api_key: str | None = None, source: str = "static"
    ) -> Replica:
        """Add a replica (pending until a health check passes), or update and un-drain one."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        url = normalize_url(url)
        r = self._by_url.get(url)
        if r is None:
            r = self._by_url[url] = Replica(url, weight, api_key, source)
        else:
            r.weight, r.draining = weight, False
            r.api_key = api_key or r.api_key
        return r

    def remove(self, url: str) -> Replica | None:
        """Forget a replica now; its open streams still finish (they hold the object)."""
        return self._by_url.pop(normalize_url(url), None)

    def drain(self, url: str) -> Replica | None:
        r = self.get(url)
        if r is not None:
            r.draining = True
            self.reap()
        return r

    def reap(self) -> None:
        for r in self:
            if r.draining and r.in_flight == 0:
                self._by_url.pop(r.url, None)

    def candidates(self, model: str | None) -> list[Replica]:
        return [r for r in self if r.available and r.serves(model)]

    def may_serve(self, model: str) -> bool:
        """False only when replicas are known and none of them (up or not) lists `model`."""
        reps = list(self)
        return not reps or any(r.models is None or model in r.models for r in reps)

    def model_cards(self) -> list[dict[str, Any]]:
        """Union of the available replicas' /v1/models, first card per id."""
        cards: dict[str, dict[str, Any]] = {}
        for r in self:
            if r.available:
                for name, card in (r.models or {}).items():
                    cards.setdefault(name, card)
        return [cards[k] for k in sorted(cards)]

    def sync_file(self, specs: list[ReplicaSpec]) -> None:
        """Make the file-sourced replicas match `specs`: add new ones, drain the ones gone."""
        wanted = {normalize_url(s.url): s for s in specs}
        for r in self:
            if r.source == "file" and r.url not in wanted:
                r.draining = True
        for url, s in wanted.items():
            existing = self._by_url.get(url)
            if existing is None or existing.source == "file":
                self.add(url, s.weight, s.api_key, source="file")
        self.reap()


def parse_replicas_file(text: str) -> list[ReplicaSpec]:
    """JSON (a list of URLs or {"url", "weight", "api_key"} objects, bare or under "replicas"),
    or plain lines `URL [WEIGHT]` with `#` comments. Every entry is checked here, before any is
    applied: a file with one bad entry changes nothing (a reload drained the replicas missing
    from it, then failed on the bad weight). ValueError names the line or the entry."""
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        items = data.get("replicas", []) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError("expected a list of replicas")
        entries = [
            (f"entry {i}", item if isinstance(item, dict) else {"url": item})
            for i, item in enumerate(items, 1)
        ]
    else:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            parts = line.split("#", 1)[0].split()
            if len(parts) > 2:
                raise ValueError(f"line {number}: expected `URL [WEIGHT]`, got {line.strip()!r}")
            if parts:
                weight = parts[1] if len(parts) > 1 else 1.0
                entries.append((f"line {number}", {"url": parts[0], "weight": weight}))
    return [_checked_spec(where, entry) for where, entry in entries]


def _checked_spec(where: str, entry: dict) -> ReplicaSpec:
    url, weight, key = entry.get("url"), entry.get("weight", 1.0), entry.get("api_key")
    try:
        if not isinstance(url, str):
            raise ValueError(f"a replica needs a URL string, got {url!r}")
        normalize_url(url)
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"weight must be a number, got {weight!r}") from None
        if not weight > 0:  # (0 would never be picked: drain or remove the replica instead)
            raise ValueError(f"weight must be > 0, got {weight}")
        if key is not None and not isinstance(key, str):
            raise ValueError("api_key must be a string")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ReplicaSpec(url, weight, key)
