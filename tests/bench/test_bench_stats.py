"""Tests for servelm.bench.stats against hand-computed cases."""

from __future__ import annotations

import random

import numpy as np
import pytest

from servelm.bench.results import RequestRecord
from servelm.bench.stats import (
    SLO,
    capacity_at_slo,
    distribution,
    error_counts,
    goodput,
    meets_slo,
    percentile,
    summarize,
    tpot,
)


def ok(index: int, ttft: float, e2e: float, tokens: int, itl: list[float] | None = None):
    return RequestRecord(
        index=index,
        start_s=0.0,
        prompt_tokens=100,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=tokens,
        itl_s=itl or [],
    )


def failed(index: int, error: str = "500") -> RequestRecord:
    return RequestRecord(index=index, start_s=0.0, error=error, error_message="boom")


def test_percentile_interpolates_linearly() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile(list(range(1, 11)), 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_percentile_matches_numpy_default() -> None:
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(257)]
    for q in (1, 25, 50, 90, 95, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_distribution_scales_and_handles_empty() -> None:
    dist = distribution([0.1, 0.2, 0.3, 0.4], scale=1000)
    assert dist["mean"] == pytest.approx(250)
    assert dist["p50"] == pytest.approx(250)
    assert dist["max"] == pytest.approx(400)
    assert dist["p99"] == pytest.approx(397)  # 300 + 0.97 * 100
    assert distribution([]) == {
        "mean": None,
        "p50": None,
        "p90": None,
        "p95": None,
        "p99": None,
        "max": None,
    }


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(e2e_s=1.0, ttft_s=0.1, output_tokens=10) == pytest.approx(0.1)
    assert tpot(e2e_s=1.0, ttft_s=0.1, output_tokens=1) is None
    assert ok(0, 0.2, 2.2, 21).tpot_s == pytest.approx(0.1)
    assert failed(0).tpot_s is None


def test_meets_slo_needs_both_targets() -> None:
    slo = SLO(ttft_ms=300, tpot_ms=50)
    assert meets_slo(ok(0, 0.3, 0.3 + 9 * 0.05, 10), slo)  # exactly on both limits
    assert not meets_slo(ok(0, 0.301, 0.5, 10), slo)
    assert not meets_slo(ok(0, 0.1, 0.1 + 9 * 0.051, 10), slo)
    assert meets_slo(ok(0, 0.1, 0.1, 1), slo)  # one token: no TPOT to miss
    assert not meets_slo(failed(0), slo)
    assert meets_slo(ok(0, 5.0, 50.0, 10), SLO(ttft_ms=None, tpot_ms=None))


def test_summary_and_goodput_hand_computed() -> None:
    slo = SLO(ttft_ms=300, tpot_ms=50)
    records = [
        ok(0, 0.1, 0.1 + 9 * 0.02, 10, itl=[0.02] * 9),  # meets
        ok(1, 0.2, 0.2 + 9 * 0.04, 10, itl=[0.04] * 9),  # meets
        ok(2, 0.5, 0.5 + 9 * 0.02, 10, itl=[0.02] * 9),  # TTFT too slow
        ok(3, 0.1, 0.1 + 9 * 0.10, 10, itl=[0.10] * 9),  # TPOT too slow
        failed(4, "503"),
    ]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s["completed"] == 4 and s["failed"] == 1
    assert s["errors"] == {"503": 1}
    assert s["output_tokens"] == 40 and s["input_tokens"] == 400
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(20.0)
    assert s["total_token_throughput"] == pytest.approx(220.0)
    assert s["goodput"] == pytest.approx(1.0)  # 2 requests in 2 s
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # the failure counts against it
    assert goodput(records, 2.0, slo) == pytest.approx(1.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(150)
    assert s["ttft_ms"]["max"] == pytest.approx(500)
    assert s["tpot_ms"]["p50"] == pytest.approx(30)
    assert s["itl_ms"]["mean"] == pytest.approx(45)
    assert s["e2e_ms"]["p50"] == pytest.approx(620)  # of 280, 560, 680, 1000


def test_summary_prefers_server_prompt_tokens() -> None:
    record = ok(0, 0.1, 0.2, 2)
    record.server_prompt_tokens = 130
    assert summarize([record], 1.0, SLO())["input_tokens"] == 130


def test_error_counts_sorted_by_kind() -> None:
    records = [failed(0, "timeout"), failed(1, "401"), failed(2, "401"), ok(3, 0.1, 0.2, 2)]
    assert error_counts(records) == {"401": 2, "timeout": 1}


def test_capacity_at_slo_stops_at_the_knee() -> None:
    levels = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.9), (8.0, 0.5), (16.0, 0.92)]
    assert capacity_at_slo(levels, threshold=0.9) == 2  # 16 passes by noise but is past the knee
    assert capacity_at_slo(levels, threshold=0.99) == 0
    assert capacity_at_slo([(1.0, 0.2), (2.0, 1.0)], threshold=0.9) is None
    assert capacity_at_slo([], threshold=0.9) is None


def test_capacity_at_slo_sorts_levels_by_load() -> None:
    levels = [(8.0, 0.1), (2.0, 1.0), (None, 1.0), (4.0, 0.95)]  # None = infinite rate, last
    assert capacity_at_slo(levels, threshold=0.9) == 3
