"""The discrete-event loop around the real engine: latencies, clean finish, prefix hits, replicas."""

import pytest

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.sim.config import SimConfig, resolve
from servelm.sim.simulator import simulate
from servelm.sim.sweep import replicas_for_rate, run_level, search_capacity, to_record
from servelm.sim.workload import SimRequest, build_requests

H100_8B = SimConfig(model="llama-3.1-8b", gpu="h100-80gb")  # datasheet profile, no fitting


def test_lone_request_latencies_match_the_worked_example():
    # 2,000-token prompt: ~100 ms prefill; each lone decode step ~8 ms (+-30 %)
    outcome = simulate(resolve(H100_8B), [SimRequest(0, 0.0, list(range(1, 2001)), 300)])
    r = outcome.requests[0]
    assert r.output_tokens == 300
    assert r.ttft_s == pytest.approx(0.100, rel=0.30)
    tpot = (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
    assert tpot == pytest.approx(0.008, rel=0.30)
    assert outcome.replicas[0].steps == 300  # one prefill step, then 299 decode steps


def level(config: SimConfig, rate: float, n: int, level_: int = 0):
    deployment = resolve(config.with_(num_requests=n))
    return run_level(deployment, Load(rate=rate), level_)


def test_every_request_finishes_and_the_pool_ends_free():
    # a small KV pool forces preemption and recompute on the real scheduler
    config = H100_8B.with_(num_blocks=400, max_num_seqs=64)
    run, outcome = level(config, rate=20.0, n=120)
    assert run.summary["completed"] == 120 and run.summary["failed"] == 0
    assert all(r.output_tokens == r.requested_output_tokens == 250 for r in outcome.requests)
    assert all(r.first_token_s <= r.finish_s for r in outcome.requests)
    assert run.server["num_preemptions"] > 0
    assert run.server["peak_kv_cache_usage_perc"] > 0.9
    for engine in outcome.engines:
        engine.scheduler.kv.check_integrity()
        assert engine.scheduler.kv.usage() == 0.0
        assert not engine.has_unfinished_requests()


def test_shared_prefix_hits_the_real_prefix_cache():
    spec = WorkloadSpec.from_preset("shared-prefix")
    run, outcome = level(H100_8B.with_(workload=spec), rate=4.0, n=40)
    assert run.server["prefix_cache_hit_rate"] > 0.8
    assert all(r.cached_tokens >= 992 for r in outcome.requests[1:])
    cold, _ = level(H100_8B.with_(workload=spec, enable_prefix_caching=False), rate=4.0, n=40)
    assert cold.server["prefix_cache_hits"] == 0
    assert run.summary["ttft_ms"]["p50"] < 0.5 * cold.summary["ttft_ms"]["p50"]


def test_server_block_and_timeline():
    run, outcome = level(H100_8B.with_(replicas=2, policy="least-loaded"), rate=10.0, n=200)
    assert all(90 <= r.requests <= 110 for r in outcome.replicas)  # least-loaded balances
    for rep in run.server["replicas"]:
        assert len(rep["timeline"]) > 50
        t, waiting, running, kv = rep["timeline"][-1]
        assert t > 0 and waiting >= 0 and running >= 0 and 0 <= kv <= 1
    assert run.summary["ttft_ms"]["p99"] is not None and run.summary["tpot_ms"]["p50"] > 8


SHORT = H100_8B.with_(workload=WorkloadSpec(input_len=200, output_len=50), num_requests=400)


@pytest.fixture(scope="module")
def one_replica_capacity() -> float:
    return search_capacity(SHORT, start=64, rel_tol=0.1, min_span_s=0).rate


def test_two_replicas_roughly_double_capacity(one_replica_capacity):
    two = search_capacity(
        SHORT.with_(replicas=2, num_requests=800), one_replica_capacity, 0.1, min_span_s=0
    )
    assert 1.7 <= two.rate / one_replica_capacity <= 2.3


def test_replicas_for_a_target_rate(one_replica_capacity):
    target = 2.5 * one_replica_capacity
    n, attained = replicas_for_rate(SHORT, target, one_replica_capacity, min_span_s=0)
    assert n == 3 and attained >= SHORT.capacity_threshold


def test_same_seed_same_result():
    a, _ = level(H100_8B, rate=8.0, n=60)
    b, _ = level(H100_8B, rate=8.0, n=60)
    assert a.summary == b.summary
    assert build_requests(WorkloadSpec(), Load(rate=8.0), 3)[2].arrival_s > 0


def test_a_prompt_beyond_the_context_is_refused_like_a_400():
    deployment = resolve(H100_8B.with_(max_model_len=1024))
    too_long = SimRequest(1, 0.01, list(range(1, 2001)), 10)
    outcome = simulate(deployment, [SimRequest(0, 0.0, [5] * 100, 10), too_long])
    ok, refused = outcome.requests
    assert ok.error is None and ok.output_tokens == 10
    assert refused.error and "maximum context length" in refused.error
    record = to_record(refused)
    assert record.error == "400" and not record.ok


def test_prefill_admit_cap_gives_a_burst_its_first_tokens_one_prompt_at_a_time():
    # 8 prompts of 1,024 tokens at once, one token out each (no decodes share the steps): a
    # 2,048-token step takes two of them, and both get their first token when it ends; with
    # new prompts admitted only below 1,024 prompt tokens a step, each step takes one, so half
    # the burst is answered sooner
    burst = [SimRequest(i, 0.0, [1 + i] * 1024, 1) for i in range(8)]

    def first_tokens(cap: int) -> list[float]:
        outcome = simulate(resolve(H100_8B.with_(max_prefill_admit_tokens=cap)), burst)
        return sorted(r.ttft_s for r in outcome.requests)

    paired, single = first_tokens(0), first_tokens(1024)
    assert len(set(paired)) == 4 and len(set(single)) == 8
    assert single[0] < paired[0] and sum(single) < sum(paired)
    assert single[-1] == pytest.approx(paired[-1], rel=0.15)  # the same work in all
