"""The discrete-event loop: replicas of the REAL engine core stepping on a virtual clock.

Each replica is an `EngineCore` (real scheduler, real KV manager) whose executor is a
`SimExecutor`, plus `free_at`, the virtual time its device is next free. Events are
arrivals (known up front) and steps. The loop repeatedly takes the earlier of

    the next arrival            -> route it to a replica; an idle replica wakes at that time
    the busy replica with the   -> step it: the step starts at free_at, lasts the executor's
    smallest free_at               priced time, and its tokens appear at the step's end

An arrival at exactly a step's start joins that step. Tokens a step samples are stamped with
the step's end, plus the profile's `frontend_latency_s` (the time outside the engine's steps
that a server adds): TTFT = first token - arrival, e2e = last token - arrival. With the
profile's `frontend_per_step_s` and `frontend_per_token_s`, each replica's API process is a
queue of its own: every step's message is handed to it at the step's end, and the step's
tokens reach their clients once it has handled the message (one per-step cost, one per-token
cost for each token), after whatever it had still to do; its busy time is reported as the
server's `process_cpu_seconds`. Routing sees each replica as of its latest step, whose results
count as done even while it is still running.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any

from servelm.engine.core import EngineCore
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.sim.config import Deployment
from servelm.sim.executor import SimExecutor
from servelm.sim.workload import SimRequest, offered_duration_s

TIMELINE_POINTS = 200  # samples of queue depth and KV usage per replica per level
_REQUEST_ID = attrgetter("request_id")
_FINISH_REASON = attrgetter("finish_reason")  # None, or a non-empty reason ("stop", "length")


class SimulationError(RuntimeError):
    """The engine stopped making progress (a bug, or a request that can never be scheduled)."""


class _Track:
    """What the simulator learns about one request as its tokens appear."""

    __slots__ = ("spec", "request", "replica", "first_s", "last_s", "itl", "error")

    def __init__(self, spec: SimRequest, request: Request, replica: int, itl: bool) -> None:
        self.spec = spec
        self.request = request  # the engine's own object: output count, cached tokens
        self.replica = replica
        self.first_s = math.nan
        self.last_s = math.nan
        self.itl: list[float] | None = [] if itl else None
        self.error: str | None = None  # the engine refused the request


@dataclass
class ReplicaReport:
    """One replica over one level: work done, peaks, and sampled gauges over time."""

    index: int
    steps: int = 0
    busy_s: float = 0.0
    requests: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    peak_waiting: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0
    api_busy_s: float = 0.0  # the API process's work on this level's tokens
    # (time s, waiting, running, KV usage 0-1), every duration/TIMELINE_POINTS seconds
    timeline: list[tuple[float, int, int, float]] = field(default_factory=list)


class Replica:
    """One engine core on a virtual device."""

    def __init__(self, index: int, deployment: Deployment, sample_every_s: float) -> None:
        self.executor = SimExecutor(deployment.profile, deployment.cost)
        self.engine = EngineCore(deployment.scheduler, self.executor)
        self.scheduler = self.engine.scheduler
        self.free_at = 0.0
        self.api_free_at = 0.0  # when the API process has handled every token handed to it
        self._per_step_s = deployment.profile.frontend_per_step_s
        self._per_token_s = deployment.profile.frontend_per_token_s
        self.report = ReplicaReport(index)
        self._sample_every_s = sample_every_s
        self._next_sample_s = 0.0

    def has_work(self) -> bool:
        return bool(self.scheduler.running) or bool(self.scheduler.waiting)

    def load(self) -> int:
        """Unfinished requests (running + waiting), for least-loaded routing."""
        return len(self.scheduler.requests)

    def step(self) -> tuple[float, list[Any]]:
        """Run one engine step starting at `free_at`; return (the time its tokens reach the
        clients, engine outputs): the step's end, or later when the API process is busy."""
        outputs, stats = self.engine.step()
        if not self.executor.last.num_requests:
            raise SimulationError(
                f"replica {self.report.index} scheduled nothing with "
                f"{len(self.scheduler.waiting)} waiting and {len(self.scheduler.running)} running"
            )
        end = self.free_at + self.executor.last_step_s
        self.free_at = end
        rep = self.report
        rep.prefix_cache_queries += stats.prefix_cache_queries
        rep.prefix_cache_hits += stats.prefix_cache_hits
        rep.num_preemptions += stats.num_preemptions
        if stats.num_waiting > rep.peak_waiting:
            rep.peak_waiting = stats.num_waiting
        if stats.num_running > rep.peak_running:
            rep.peak_running = stats.num_running
        if stats.kv_cache_usage > rep.peak_kv_usage:
            rep.peak_kv_usage = stats.kv_cache_usage
        if end >= self._next_sample_s:
            rep.timeline.append((end, stats.num_waiting, stats.num_running, stats.kv_cache_usage))
            self._next_sample_s = end + self._sample_every_s
        if self._per_step_s or self._per_token_s:  # every step sends the API process a message
            work = self._per_step_s + self._per_token_s * len(outputs)
            rep.api_busy_s += work
            self.api_free_at = max(end, self.api_free_at) + work
            return self.api_free_at, outputs
        return end, outputs

    def finish_report(self) -> ReplicaReport:
        totals = self.executor.totals
        self.report.steps = totals.steps
        self.report.busy_s = totals.busy_s
        self.report.prompt_tokens_computed = totals.prefill_tokens
        self.report.generation_tokens = totals.sampled_tokens  # as a server's counter counts
        return self.report


@dataclass
class RequestResult:
    """One simulated request, times in seconds from the level's start."""

    index: int
    replica: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    requested_output_tokens: int
    cached_tokens: int
    first_token_s: float  # nan if the request failed
    finish_s: float
    itl_s: list[float] | None = None
    error: str | None = None  # why the engine refused it (prompt beyond the context)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass
class LevelOutcome:
    """Everything one simulated level produced."""

    requests: list[RequestResult]
    duration_s: float  # from the first arrival to the last token
    replicas: list[ReplicaReport]
    engines: list[EngineCore]  # kept for post-run checks (pool free, integrity)


def simulate(deployment: Deployment, requests: list[SimRequest]) -> LevelOutcome:
    """Run `requests` through `deployment.replicas` engine cores until every one finishes.

    The cyclic garbage collector is paused meanwhile: the heap holds every prompt's token ids
    (millions of ints in lists), each full collection walks all of them, and that doubled the
    run time; the loop itself builds no reference cycles. The previous state is restored.
    """
    with paused_gc():
        return _simulate(deployment, requests)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (for code that only builds acyclic garbage)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _simulate(deployment: Deployment, requests: list[SimRequest]) -> LevelOutcome:
    cfg = deployment.config
    sample_every = max(offered_duration_s(requests), 1e-3) / TIMELINE_POINTS
    replicas = [Replica(i, deployment, sample_every) for i in range(deployment.replicas)]
    tracks: dict[str, _Track] = {}
    awaiting_first: set[str] = set()
    record_itl = cfg.record_itl
    route = _router(cfg.policy, replicas)
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    n, i = len(arrivals), 0
    busy: list[Replica] = []  # replicas with unfinished requests
    while True:
        rep = min(busy, key=_free_at) if len(busy) > 1 else (busy[0] if busy else None)
        if i < n and (rep is None or arrivals[i].arrival_s <= rep.free_at):
            spec = arrivals[i]
            i += 1
            target = route()
            rid = str(spec.index)
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True)
            request = Request(rid, spec.prompt_token_ids, params, arrival_time=spec.arrival_s)
            track = tracks[rid] = _Track(spec, request, target.report.index, record_itl)
            target.report.requests += 1
            was_idle = not target.has_work()
            try:
                target.engine.add_request(request)
            except ValueError as exc:  # longer than the context: the server's 400
                track.error = str(exc)
                continue
            awaiting_first.add(rid)
            if was_idle:
                target.free_at = max(target.free_at, spec.arrival_s)
                busy.append(target)
            continue
        if rep is None:
            break
        end, outputs = rep.step()
        if record_itl:
            for out in outputs:  # once per generated token
                rid = out.request_id
                if rid in awaiting_first:
                    awaiting_first.discard(rid)
                    tracks[rid].first_s = end
                _note_gap(tracks[rid], end)
                if out.finish_reason is not None:
                    tracks[rid].last_s = end
        else:  # only first and last tokens matter: filter in C, loop over those alone
            firsts = awaiting_first.intersection(map(_REQUEST_ID, outputs))
            if firsts:
                awaiting_first -= firsts
                for rid in firsts:
                    tracks[rid].first_s = end
            for out in compress(outputs, map(_FINISH_REASON, outputs)):
                tracks[out.request_id].last_s = end
        if not rep.has_work():
            busy.remove(rep)
    frontend = deployment.profile.frontend_latency_s
    results = [_result(t, frontend) for t in tracks.values()]
    results.sort(key=lambda r: r.index)
    duration = max((r.finish_s for r in results if r.error is None), default=0.0)
    reports = [r.finish_report() for r in replicas]
    return LevelOutcome(results, duration, reports, [r.engine for r in replicas])


def _free_at(replica: Replica) -> float:
    return replica.free_at


def _note_gap(track: _Track, end: float) -> None:
    if track.itl is not None and track.first_s != end:
        track.itl.append(end - track.last_s)
    track.last_s = end


def _result(t: _Track, frontend_s: float) -> RequestResult:
    spec, request = t.spec, t.request
    return RequestResult(
        index=spec.index,
        replica=t.replica,
        arrival_s=spec.arrival_s,
        prompt_tokens=len(spec.prompt_token_ids),
        output_tokens=len(request.output_token_ids),
        requested_output_tokens=spec.output_len,
        cached_tokens=max(request.num_cached_tokens, 0),
        first_token_s=t.first_s + frontend_s,
        finish_s=t.last_s + frontend_s,
        itl_s=t.itl,
        error=t.error,
    )


def _router(policy: str, replicas: list[Replica]) -> Any:
    """A zero-argument callable picking the replica for the next arrival."""
    if policy == "round-robin":
        counter = iter(range(1 << 62))
        return lambda: replicas[next(counter) % len(replicas)]
    if policy == "least-loaded":  # fewest unfinished requests; ties go to the lowest index
        return lambda: min(replicas, key=Replica.load)
    raise ValueError(f"unknown routing policy {policy!r}")
