"""Tests for servelm.bench.server_metrics: parsing, deltas, histogram median."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelm.bench.server_metrics import histogram_quantile, parse_metrics, server_report

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 7.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_queries_total{model_name="m"} 100.0
vllm:prefix_cache_hits_total{model_name="m"} 40.0
vllm:num_preemptions_total{model_name="m"} 2.0
process_cpu_seconds_total 12.0
"""


def registry_text(prompt: float, hits: float, queries: float, ttft: list[float]) -> str:
    """Metrics as prometheus_client itself writes them (counters get _total and _created)."""
    registry = CollectorRegistry()
    Counter("servelm:prompt_tokens", "p", ["model_name"], registry=registry).labels("m").inc(prompt)
    Counter("servelm:prefix_cache_hits", "h", registry=registry).inc(hits)
    Counter("servelm:prefix_cache_queries", "q", registry=registry).inc(queries)
    Gauge("servelm:kv_cache_usage_perc", "kv", registry=registry).set(0.5)
    histogram = Histogram(
        "servelm:time_to_first_token_seconds", "t", registry=registry, buckets=(0.1, 0.2, 0.4)
    )
    for value in ttft:
        histogram.observe(value)
    return generate_latest(registry).decode()


def test_parse_strips_prefix_total_and_created() -> None:
    snapshot = parse_metrics(registry_text(10, 3, 8, [0.05, 0.15]))
    assert snapshot is not None and snapshot.prefix == "servelm"
    assert snapshot.values["prompt_tokens"] == 10
    assert snapshot.values["prefix_cache_hits"] == 3
    assert snapshot.values["kv_cache_usage_perc"] == 0.5
    assert not any(name.endswith(("_total", "_created")) for name in snapshot.values)
    assert snapshot.ttft_buckets == {0.1: 1, 0.2: 2, 0.4: 2, math.inf: 2}


def test_parse_reads_only_what_the_report_uses() -> None:
    """Other histograms (a server has several) are left out before parsing, the rest kept."""
    other = CollectorRegistry()
    latency = Histogram("servelm:e2e_request_latency_seconds", "e", registry=other)
    latency.observe(0.3)
    Gauge("servelm:num_requests_running", "r", registry=other).set(4)
    text = registry_text(10, 3, 8, [0.05, 0.15]) + generate_latest(other).decode()
    snapshot = parse_metrics(text)
    assert snapshot is not None
    assert snapshot.values == {
        "prompt_tokens": 10,
        "prefix_cache_hits": 3,
        "prefix_cache_queries": 8,
        "kv_cache_usage_perc": 0.5,
        "num_requests_running": 4,
    }
    assert snapshot.ttft_buckets == {0.1: 1, 0.2: 2, 0.4: 2, math.inf: 2}


def test_parse_vllm_names_and_aliases() -> None:
    snapshot = parse_metrics(VLLM_TEXT)
    assert snapshot is not None and snapshot.prefix == "vllm"
    assert snapshot.values["kv_cache_usage_perc"] == 0.25  # old gpu_ name
    assert snapshot.values["num_preemptions"] == 2
    assert snapshot.values["process_cpu_seconds"] == 12.0  # the standard, unprefixed name


def test_report_has_the_serving_process_cpu_of_the_run() -> None:
    before = parse_metrics(VLLM_TEXT)
    after = parse_metrics(
        VLLM_TEXT.replace("process_cpu_seconds_total 12.0", "process_cpu_seconds_total 15.5")
    )
    assert before is not None and after is not None
    assert server_report(before, after)["process_cpu_seconds"] == pytest.approx(3.5)
    no_process = parse_metrics(VLLM_TEXT.replace("process_cpu_seconds_total 12.0\n", ""))
    assert no_process is not None
    assert server_report(no_process, no_process)["process_cpu_seconds"] is None


def test_parse_without_engine_metrics() -> None:
    assert parse_metrics("process_cpu_seconds_total 1.0\n") is None
    assert parse_metrics("<html>not found</html>") is None


def test_histogram_quantile_hand_computed() -> None:
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.4]
    buckets = {0.1: 4, 0.2: 8, 0.4: 10, math.inf: 10}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.125)  # 0.1 + 0.1 * 1/4
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, {0.1: 0, 0.2: 1, math.inf: 4}) == 0.2  # in +Inf: last bound
    assert histogram_quantile(0.5, {0.1: 0, math.inf: 0}) is None
    assert histogram_quantile(0.5, {}) is None


def test_report_uses_deltas_of_the_run() -> None:
    before = parse_metrics(registry_text(100, 10, 50, [0.05] * 6))
    after = parse_metrics(registry_text(400, 70, 150, [0.05] * 6 + [0.3] * 4))
    assert before is not None and after is not None
    report = server_report(before, after, peaks={"num_requests_waiting": 9})
    assert report["metrics_prefix"] == "servelm"
    assert report["prompt_tokens"] == 300
    assert report["prefix_cache_hits"] == 60 and report["prefix_cache_queries"] == 100
    assert report["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert report["generation_tokens"] is None  # not exposed by this server
    # only the run's 4 observations, all in (0.2, 0.4]: median at the middle of that bucket
    assert report["ttft_p50_ms"] == pytest.approx(300)
    assert report["peak_kv_cache_usage_perc"] == 0.5
    assert report["peak_num_requests_waiting"] == 9
    assert report["peak_num_requests_running"] is None
