"""Server-side view of a run: scrape Prometheus /metrics before, during and after it.

Works with any server exposing `servelm:` or `vllm:` metric names (same suffixes), plus the
standard `process_cpu_seconds_total` of the process that serves /metrics (for servelm and
vLLM, the API process, whose CPU per step and per streamed token `servelm simulate
--calibrate-bench` prices). Counters are reported as deltas over the run, gauges as peaks
polled during it, and the server's TTFT median is estimated from the delta of its histogram
buckets (linear within a bucket, as Prometheus' histogram_quantile does). Names are matched on the sample, with `_total` stripped, because the
parser strips it from counter family names but not from samples of untyped metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("servelm", "vllm")
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "engine_steps",  # servelm only: step messages the API process handled
    "process_cpu_seconds",
)
PROCESS_CPU = "process_cpu_seconds_total"  # prometheus_client's process collector, unprefixed
GAUGES = ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running")
TTFT_BUCKETS = "time_to_first_token_seconds_bucket"
# older vLLM names -> the current suffix
_ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_prefix_cache_queries": "prefix_cache_queries",
    "gpu_prefix_cache_hits": "prefix_cache_hits",
}


@dataclass
class Snapshot:
    """One scrape: each metric summed over its label sets, keyed by suffix without `_total`."""

    prefix: str
    values: dict[str, float] = field(default_factory=dict)
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


_WANTED = {*COUNTERS, *GAUGES, TTFT_BUCKETS}


def _wanted(line: str, prefix: str) -> bool:
    """Whether a sample line is one the report reads: the parser then skips the comments and
    the other histograms' buckets, most of a scrape, which keeps the client's CPU small (twice
    a second, on the machine it measures; docs/performance.md)."""
    if line.startswith(PROCESS_CPU):
        return True
    if not line.startswith(prefix + ":"):
        return False
    name = line[len(prefix) + 1 :].split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
    return _ALIASES.get(name, name) in _WANTED


def parse_metrics(text: str) -> Snapshot | None:
    """A Snapshot of the servelm:/vllm: metrics in Prometheus text, None if there are none."""
    prefix = next((p for p in PREFIXES if f"{p}:" in text), None)
    if prefix is None:
        return None
    values: dict[str, float] = defaultdict(float)
    buckets: dict[float, float] = defaultdict(float)
    text = "\n".join(line for line in text.splitlines() if _wanted(line, prefix)) + "\n"
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == PROCESS_CPU:
                    values["process_cpu_seconds"] += sample.value
                    continue
                if not sample.name.startswith(prefix + ":"):
                    continue
                name = sample.name[len(prefix) + 1 :]
                if name == TTFT_BUCKETS:
                    buckets[float(sample.labels["le"])] += sample.value
                elif not name.endswith("_created"):
                    name = name.removesuffix("_total")
                    values[_ALIASES.get(name, name)] += sample.value
    except (ValueError, KeyError, TypeError):
        return None
    return Snapshot(prefix, dict(values), dict(buckets))


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Estimate the q-quantile (0-1) from cumulative bucket counts {le: count}."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bound: that bound is all we know
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def server_report(
    before: Snapshot, after: Snapshot, peaks: dict[str, float] | None = None
) -> dict[str, Any]:
    """Counter deltas, prefix-cache hit rate, TTFT median and gauge peaks of one run.

    `peaks` are the gauges polled during the run; None: none was polled, and the gauges' peaks
    are None too, not the idle values scraped before and after it."""
    report: dict[str, Any] = {"metrics_prefix": after.prefix}
    for name in COUNTERS:
        if name in after.values:
            report[name] = after.values[name] - before.values.get(name, 0.0)
        else:
            report[name] = None
    hits, queries = report["prefix_cache_hits"], report["prefix_cache_queries"]
    report["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
    delta = {le: n - before.ttft_buckets.get(le, 0.0) for le, n in after.ttft_buckets.items()}
    median = histogram_quantile(0.5, delta)
    report["ttft_p50_ms"] = None if median is None else median * 1000
    for name in GAUGES:
        seen = [s.values[name] for s in (before, after) if name in s.values]
        if peaks is not None and name in peaks:
            seen.append(peaks[name])
        report[f"peak_{name}"] = max(seen) if seen and peaks is not None else None
    return report


class MetricsWatcher:
    """Scrapes {root}/metrics at start and stop and polls gauges in between.

    If the first scrape finds no usable metrics the watcher stays idle and reports None. A run
    shorter than the poll interval is never polled: it reports its counters, and None for the
    gauges' peaks (a scrape at its end finds the requests done, "peak running 0").
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        metrics_url: str,
        headers: dict[str, str] | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self._client = client
        self._url = metrics_url
        self._headers = headers or {}
        self._interval_s = interval_s
        self._before: Snapshot | None = None
        self._peaks: dict[str, float] = {}
        self._polled = False  # whether a poll of this run got a snapshot
        self._task: asyncio.Task[None] | None = None

    async def scrape(self) -> Snapshot | None:
        try:
            response = await self._client.get(self._url, headers=self._headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        return parse_metrics(response.text) if response.status_code == 200 else None

    async def start(self) -> None:
        self._before = await self.scrape()
        self._peaks, self._polled = {}, False
        if self._before is not None:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> dict[str, Any] | None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._before is None:
            return None
        after = await self.scrape()
        if after is None:
            return None
        return server_report(self._before, after, self._peaks if self._polled else None)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            snapshot = await self.scrape()
            self._polled = self._polled or snapshot is not None
            for name in GAUGES:
                if snapshot is not None and name in snapshot.values:
                    value = snapshot.values[name]
                    self._peaks[name] = max(self._peaks.get(name, value), value)
