"""Simulator requests: the bench's lengths and arrivals, random ids, the shared prefix."""

import math
import random
import statistics

import pytest

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec, sample_length
from servelm.sim.workload import arrival_times, build_requests, request_lengths


def test_lengths_follow_the_bench_streams():
    spec = WorkloadSpec.from_preset("chat", len_dist="lognormal", len_spread=0.6)
    rng = random.Random("7/level3/11")  # the bench draws output first, then input
    expected_out = sample_length(rng, 250, "lognormal", 0.6)
    expected_in = sample_length(rng, 500, "lognormal", 0.6)
    assert request_lengths(spec, 7, "level3", 11) == (expected_in, expected_out)
    assert request_lengths(WorkloadSpec(), 7, "level3", 11) == (500, 250)


def test_poisson_arrivals_at_the_rate_and_scaled_by_it():
    times = arrival_times(Load(rate=10.0), 5000, seed=0, level=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert 4999 / times[-1] == pytest.approx(10.0, rel=0.05)
    doubled = arrival_times(Load(rate=20.0), 5000, seed=0, level=0)
    assert doubled[-1] == pytest.approx(times[-1] / 2)  # same gaps, scaled
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)
    bursty = arrival_times(Load(rate=10.0, burstiness=0.25), 5000, seed=0, level=0)
    b_gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.stdev(b_gaps) / statistics.mean(b_gaps) > 1.6  # cv = 1/sqrt(shape)
    assert arrival_times(Load(rate=math.inf), 3, 0, 0) == [0.0, 0.0, 0.0]


def test_requests_share_only_the_prefix():
    chat = build_requests(WorkloadSpec(), Load(rate=5.0), 20, seed=1, vocab_size=1000)
    assert all(len(r.prompt_token_ids) == 500 and r.output_len == 250 for r in chat)
    assert len({tuple(r.prompt_token_ids[:16]) for r in chat}) == 20
    assert all(0 < t < 1000 for r in chat for t in r.prompt_token_ids)
    shared = build_requests(
        WorkloadSpec.from_preset("shared-prefix"), Load(rate=5.0), 5, seed=1, vocab_size=1000
    )
    assert all(len(r.prompt_token_ids) == 1100 for r in shared)
    assert len({tuple(r.prompt_token_ids[:1000]) for r in shared}) == 1
    again = build_requests(WorkloadSpec(), Load(rate=5.0), 20, seed=1, vocab_size=1000)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in chat]
    with pytest.raises(ValueError):
        build_requests(WorkloadSpec(), Load(concurrency=4), 5)
