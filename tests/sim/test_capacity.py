"""The load model on one H100 (datasheet profile, no fitting): the knee, capacity, saturation.

Capacity = the highest rate whose TTFT p99 stays under 1 s (SLO TTFT <= 1 s for 99 % of the
requests, found by bisection on one seeded arrival stream, so every number here is exact and
repeatable: simulated time does not depend on how busy the test machine is).

RAG (6,000 / 250): prefills queue one behind the other (FCFS, chunked), so TTFT is the waiting
time of an M/D/1 queue plus the prefill itself, D = 0.234 s here. For Poisson arrivals its p99
stays under 1 s up to about 2.0/s (D = 0.24 s), 2.4/s (D = 0.22 s) or 2.8/s (D = 0.20 s), and a
little less in the engine, where a finishing prompt's last chunk shares its step with the next
prompt's first tokens (so vLLM's 8,192-token budget on an H100 lowers it further). On this
test's arrival stream the datasheet profile (2,000-token prefill 74 ms) reaches 1.75/s. Issue #5
asked for both a 70-130 ms prefill and a rag capacity of at least 2/s, which by the queue above
cannot both hold (2/s takes a 71 ms prefill); issue #29 moved the capacity's lower bound to
1.5/s, which the datasheet profile meets (1.75/s).
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


def test_rag_capacity_is_between_1_5_and_4_5():
    rag = resolve(RAG.with_(num_requests=600))
    assert meets_at(rag, 1.5) >= RAG.capacity_threshold
    assert meets_at(rag, 4.5) < RAG.capacity_threshold


def test_rag_saturates_near_3_per_second_with_the_kv_pool_full():
    # "Tops out near 3/s" (the seeds) is the saturation throughput, where the KV pool is full.
    overload, _ = run_level(resolve(RAG.with_(num_requests=300)), Load(rate=8.0))
    assert 2.5 <= overload.summary["request_throughput"] <= 4.5
    assert overload.server["peak_kv_cache_usage_perc"] > 0.95
