"""Sweeps, capacity at an SLO and replica counts, reported in the `servelm bench` JSON schema.

A simulated level becomes a `bench.results.RunResult` (one RequestRecord per request, the same
`bench.stats.summarize` summary, a "server" block with the keys `bench.server_metrics` reports
plus the replicas' timelines), so `--out` files of `servelm simulate` and `servelm bench` load,
print and plot with the same code and overlay on one chart.

Capacity uses the bench definition: the highest rate at which at least `capacity_threshold` of
the requests meet the SLO, walking up the rates and stopping at the first miss. The simulator's
default SLO (TTFT <= 1 s, no TPOT limit) with threshold 0.99 reads as "TTFT p99 under 1 s".
`search_capacity` bisects on the rate with one arrival stream scaled to each rate (gamma gaps
scale as 1/rate), so the pass/miss answer is monotone in the rate for a fixed seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from servelm.bench.results import BenchResult, Load, RequestRecord, RunResult, capacity_block
from servelm.bench.stats import SLO, summarize
from servelm.sim.config import Deployment, SimConfig, resolve
from servelm.sim.simulator import LevelOutcome, RequestResult, paused_gc, simulate
from servelm.sim.workload import build_requests


def run_level(
    deployment: Deployment, load: Load, level: int = 0, stream: str | None = None
) -> tuple[RunResult, LevelOutcome]:
    """Simulate one load level; return it in the bench schema and the raw outcome."""
    cfg = deployment.config
    with paused_gc():  # millions of token ids: see `simulate`
        requests = build_requests(
            cfg.workload,
            load,
            cfg.num_requests,
            cfg.seed,
            level,
            deployment.shape.vocab_size,
            stream,
        )
    outcome = simulate(deployment, requests)
    records = [to_record(r) for r in outcome.requests]
    summary = summarize(records, outcome.duration_s, cfg.slo)
    return RunResult(load, summary, server_block(outcome), records), outcome


def to_record(r: RequestResult) -> RequestRecord:
    """A simulated request as the bench client would have recorded it (a refusal is a 400)."""
    if r.error is not None:
        return RequestRecord(
            index=r.index,
            start_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            requested_output_tokens=r.requested_output_tokens,
            error="400",
            error_message=r.error,
        )
    return RequestRecord(
        index=r.index,
        start_s=r.arrival_s,
        prompt_tokens=r.prompt_tokens,
        requested_output_tokens=r.requested_output_tokens,
        ttft_s=r.ttft_s,
        e2e_s=r.e2e_s,
        itl_s=r.itl_s or [],
        output_tokens=r.output_tokens,
        server_prompt_tokens=r.prompt_tokens,
    )


def server_block(outcome: LevelOutcome) -> dict[str, Any]:
    """The `bench.server_metrics.server_report` keys, from the engines' own stats."""
    reps = outcome.replicas
    queries = sum(r.prefix_cache_queries for r in reps)
    hits = sum(r.prefix_cache_hits for r in reps)
    ttfts = sorted(r.ttft_s for r in outcome.requests if r.error is None)
    return {
        "metrics_prefix": "sim",
        "prompt_tokens": sum(r.prompt_tokens_computed for r in reps),
        "generation_tokens": sum(r.generation_tokens for r in reps),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "num_preemptions": sum(r.num_preemptions for r in reps),
        "engine_steps": sum(r.steps for r in reps),
        "process_cpu_seconds": sum(r.api_busy_s for r in reps) or None,  # None: not modelled
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1000 if ttfts else None,
        "peak_kv_cache_usage_perc": max(r.peak_kv_usage for r in reps),
        "peak_num_requests_waiting": max(r.peak_waiting for r in reps),
        "peak_num_requests_running": max(r.peak_running for r in reps),
        "busy_fraction": [
            r.busy_s / outcome.duration_s if outcome.duration_s else 0.0 for r in reps
        ],
        "replicas": [
            {
                "index": r.index,
                "requests": r.requests,
                "steps": r.steps,
                "busy_s": r.busy_s,
                "timeline": [list(point) for point in r.timeline],
            }
            for r in reps
        ],
    }


def run_sweep(config: SimConfig, loads: Sequence[Load]) -> BenchResult:
    """Simulate each load level in turn (level i draws stream i, as `servelm bench` does)."""
    deployment = resolve(config)
    runs = [run_level(deployment, load, level)[0] for level, load in enumerate(loads)]
    return BenchResult(
        sim_config_dict(deployment, loads),
        runs,
        capacity_block(list(runs), config.capacity_threshold),
    )


def sim_config_dict(deployment: Deployment, loads: Sequence[Load] = ()) -> dict[str, Any]:
    """SimConfig.to_dict with the resolved pool size and context, and the swept loads."""
    data = deployment.config.to_dict()
    data["num_blocks"] = deployment.scheduler.num_blocks
    data["max_model_len"] = deployment.scheduler.max_model_len
    data["loads"] = [load.to_dict() for load in loads]
    return data


@dataclass(frozen=True)
class CapacityResult:
    """The highest rate found to meet the SLO, and the probes that found it."""

    rate: float  # 0.0 when even the lowest probe misses
    probes: list[tuple[float, float]]  # (rate, SLO attainment), in probe order


def meets_at(deployment: Deployment, rate: float, burstiness: float = 1.0) -> float:
    """SLO attainment at `rate` on the fixed 'search' stream (same gaps, scaled)."""
    run, _ = run_level(deployment, Load(rate=rate, burstiness=burstiness), stream="search")
    return run.summary["slo_attainment"]


def search_capacity(
    config: SimConfig,
    start: float = 1.0,
    rel_tol: float = 0.03,
    burstiness: float = 1.0,
    max_rate: float = 1e5,
    min_span_s: float = 30.0,
) -> CapacityResult:
    """Grow the rate x2 from `start` until the SLO misses, then bisect to `rel_tol`.

    A probe sends `config.num_requests`, or more so that arrivals span at least `min_span_s`:
    a level much shorter than a request's own latency ends before any queue builds, and
    short levels overstate capacity.

    Needs an SLO (a TTFT or a TPOT limit): without one every request that is served "meets"
    it, at any rate, and the search would double the rate to `max_rate`, simulating
    `rate x min_span_s` requests a probe.
    """
    check_has_slo(config.slo)
    deployment = resolve(config)
    threshold = config.capacity_threshold
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        count = max(config.num_requests, math.ceil(rate * min_span_s))
        probe = deployment
        if count != config.num_requests:
            probe = replace(deployment, config=config.with_(num_requests=count))
        attained = meets_at(probe, rate, burstiness)
        probes.append((rate, attained))
        return attained >= threshold

    lo, hi = 0.0, start
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > max_rate:
            return CapacityResult(lo, probes)
    if lo == 0.0:  # the first probe missed: walk down
        while hi > start / 64:
            hi /= 2
            if ok(hi):
                lo = hi
                hi *= 2
                break
        if lo == 0.0:
            return CapacityResult(0.0, probes)
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(lo, probes)


def check_has_slo(slo: SLO) -> None:
    """ValueError unless `slo` sets a TTFT or a TPOT limit (what capacity is measured at)."""
    if slo.ttft_ms is None and slo.tpot_ms is None:
        raise ValueError("finding capacity needs an SLO: --slo-ttft-ms or --slo-tpot-ms")


def replicas_for_rate(
    config: SimConfig,
    target_rate: float,
    per_replica: float | None = None,
    max_replicas: int = 64,
    min_span_s: float = 30.0,
    burstiness: float = 1.0,
) -> tuple[int, float]:
    """Fewest replicas that meet the SLO at `target_rate`; returns (replicas, attainment).

    Starts from ceil(target / single-replica capacity) and adds replicas until a simulation
    at the target rate (num_requests x replicas requests, so each replica sees a full level,
    spanning at least `min_span_s`) meets the SLO. ValueError when no count up to
    `max_replicas` does, at once where one replica meets the SLO at no rate: a request
    alone on a replica already misses it, and more replicas only share out the requests.
    """
    if target_rate <= 0:
        raise ValueError("target rate must be > 0")
    check_has_slo(config.slo)
    if per_replica is None:
        found = search_capacity(
            config.with_(replicas=1), min_span_s=min_span_s, burstiness=burstiness
        )
        per_replica = found.rate
    if per_replica <= 0:
        raise ValueError(
            f"one replica misses the SLO even at the lowest rate tried, so no number of "
            f"replicas meets it at {target_rate:g} req/s (loosen the SLO or its threshold)"
        )
    n = max(1, math.ceil(target_rate / per_replica))
    attained = 0.0
    while n <= max_replicas:
        count = max(config.num_requests * n, math.ceil(target_rate * min_span_s))
        cfg = config.with_(replicas=n, num_requests=count)
        attained = meets_at(resolve(cfg), target_rate, burstiness)
        if attained >= config.capacity_threshold:
            return n, attained
        n += 1
    raise ValueError(f"{max_replicas} replicas do not meet the SLO at {target_rate:g} req/s")
