"""Routing policies: from the replicas that may take a request, pick one (one class per policy).

Every policy honours replica weights (a canary at weight 0.1 next to one at 1.0 gets about a
tenth of the traffic): round-robin by smooth weighted rotation, least-loaded by load/weight
with weighted random tie-breaks, prefix-aware through the placements it makes.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from servelm.router.prefix import block_hashes, prompt_text
from servelm.router.replicas import Replica


@dataclass
class RouteRequest:
    model: str | None
    body: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # which API the body is for (prefix.prompt_text reads it by its path)


@dataclass
class Decision:
    replica: Replica
    reason: str  # for the routing_decisions metric: round_robin, least_loaded, prefix_hit, ...


class RoutingPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Decision:
        """Pick one of `candidates` (never empty; every one available and serving the model)."""


class RoundRobin(RoutingPolicy):
    """Smooth weighted round-robin: each replica gains its weight per pick, the leader pays the
    total. Equal weights give plain rotation; weights 1 and 0.1 give 10:1, evenly interleaved."""

    name = "round-robin"

    def __init__(self) -> None:
        self._credit: dict[str, float] = {}

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Decision:
        total = 0.0
        for r in candidates:
            self._credit[r.url] = self._credit.get(r.url, 0.0) + r.weight
            total += r.weight
        best = max(candidates, key=lambda r: self._credit[r.url])
        self._credit[best.url] -= total
        if len(self._credit) > 4 * len(candidates) + 16:  # forget replicas long gone
            self._credit = {r.url: self._credit[r.url] for r in candidates}
        return Decision(best, "round_robin")


def score(r: Replica) -> float:
    return r.load / r.weight


class LeastLoaded(RoutingPolicy):
    """Fewest requests waiting + running (scraped from the replica's /metrics, plus what the
    router sent since the scrape; the router's own in-flight count for replicas without
    metrics), per unit of weight. Ties: lower KV usage, then weighted random."""

    name = "least-loaded"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Decision:
        low = min(score(r) for r in candidates)
        tied = [r for r in candidates if score(r) <= low + 1e-9]
        if len(tied) > 1:
            kv = min(r.kv_usage for r in tied)
            tied = [r for r in tied if r.kv_usage <= kv + 0.01]
        pick = tied[0] if len(tied) == 1 else self._rng.choices(tied, [r.weight for r in tied])[0]
        return Decision(pick, "least_loaded")


class PrefixAware(RoutingPolicy):
    """Requests sharing a prompt prefix go to the replica that served that prefix last.

    A table maps each prefix block hash (see prefix.py) to the replica it was last sent to
    (LRU, `table_size` entries). A request follows its longest prefix found in the table; an
    unseen prefix goes to the least-loaded replica, which spreads distinct prefixes by load.
    When the affine replica is overloaded (more than `imbalance_abs` requests above the least
    loaded, and `imbalance_rel` times as many), the request goes to the least-loaded one and
    the prefix follows it there: a hot prefix spills over instead of swamping one replica.
    """

    name = "prefix-aware"

    def __init__(
        self,
        block_chars: int = 128,
        max_blocks: int = 64,
        table_size: int = 200_000,
        imbalance_abs: float = 4.0,
        imbalance_rel: float = 1.5,
        seed: int = 0,
    ) -> None:
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.table_size = table_size
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.fallback = LeastLoaded(seed)
        self._table: OrderedDict[bytes, str] = OrderedDict()

    def choose(self, candidates: Sequence[Replica], req: RouteRequest) -> Decision:
        # a salted prompt (cache_salt) shares KV only with prompts of the same salt
        salt = req.body.get("cache_salt")
        seed = f"{req.model or ''}\0{salt}" if isinstance(salt, str) else req.model or ""
        text = prompt_text(req.body, req.path)
        hashes = block_hashes(text, self.block_chars, self.max_blocks, seed)
        least = self.fallback.choose(candidates, req).replica
        affine = self._longest_match(hashes, {r.url: r for r in candidates})
        if affine is None:
            decision = Decision(least, "prefix_miss" if hashes else "prefix_short")
        elif self._overloaded(affine, least):
            decision = Decision(least, "prefix_overloaded")
        else:
            decision = Decision(affine, "prefix_hit")
        self._remember(hashes, decision.replica.url)
        return decision

    def _longest_match(self, hashes: list[bytes], by_url: dict[str, Replica]) -> Replica | None:
        match = None
        for h in hashes:  # chained hashes: once one is missing, no longer prefix can be present
            url = self._table.get(h)
            if url is None:
                break
            match = by_url.get(url, match)
        return match

    def _overloaded(self, affine: Replica, least: Replica) -> bool:
        a, b = score(affine), score(least)
        return a - b > self.imbalance_abs and a > self.imbalance_rel * b

    def _remember(self, hashes: list[bytes], url: str) -> None:
        for h in reversed(hashes):  # deepest first, so eviction drops long tails before roots
            self._table[h] = url
            self._table.move_to_end(h)
        while len(self._table) > self.table_size:
            self._table.popitem(last=False)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PrefixAware)
}
