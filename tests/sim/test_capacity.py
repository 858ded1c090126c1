"""The load model on one H100 (datasheet profile, no fitting): the knee, capacity, saturation.

Capacity = the highest rate whose TTFT p99 stays under 1 s (SLO TTFT <= 1 s for 99 % of the
requests, found by bisection on one seeded arrival stream, so every number here is exact and
repeatable: simulated time does not depend on how busy the test machine is).
"""

import pytest

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.sim.config import SimConfig, resolve
from servelm.sim.sweep import meets_at, run_level, search_capacity

CHAT = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", workload=WorkloadSpec.from_preset("chat"))
RAG = CHAT.with_(workload=WorkloadSpec.from_preset("rag"))


def ttft_p50(config: SimConfig, rate: float, n: int) -> float:
    run, _ = run_level(resolve(config.with_(num_requests=n)), Load(rate=rate), stream="search")
    return run.summary["ttft_ms"]["p50"]


@pytest.fixture(scope="module")
def chat_capacity() -> float:
    return search_capacity(CHAT.with_(num_requests=1000), start=16, rel_tol=0.08).rate


def test_chat_capacity(chat_capacity):
    assert 14 <= chat_capacity <= 30


def test_chat_ttft_is_flat_then_climbs_at_the_knee(chat_capacity):
    unloaded = ttft_p50(CHAT, 0.2, 20)  # 500 prompt tokens on an idle GPU: ~20 ms
    assert unloaded == pytest.approx(20, rel=0.3)  # ms
    assert ttft_p50(CHAT, 0.7 * chat_capacity, 1000) < 2 * unloaded  # the batch just grows
    assert ttft_p50(CHAT, 1.15 * chat_capacity, 1000) > 10 * unloaded  # requests queue


def test_rag_capacity_and_saturation():
    # A 6,000-token prefill takes ~0.25 s here, so Poisson bursts at 2/s already queue to a
    # TTFT p99 near 1 s (M/D/1 at utilisation ~0.5): capacity at the SLO is 1.6-2.3/s
    # depending on the seed. "Tops out near 3/s" is the saturation throughput, where the KV
    # pool is full. Two probes bracket the capacity (the search itself is slower).
    deployment = resolve(RAG.with_(num_requests=600))
    assert meets_at(deployment, 1.5) >= RAG.capacity_threshold
    assert meets_at(deployment, 4.5) < RAG.capacity_threshold
    overload, _ = run_level(resolve(RAG.with_(num_requests=300)), Load(rate=8.0))
    assert 2.5 <= overload.summary["request_throughput"] <= 4.5
    assert overload.server["peak_kv_cache_usage_perc"] > 0.95
