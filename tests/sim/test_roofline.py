"""Step-time roofline: datasheet H100 profile (no fitting) against the worked latencies."""

import dataclasses

import pytest

from servelm.planner.catalog import get_model
from servelm.sim.roofline import (
    PROFILES,
    ModelCost,
    gpu_profile,
    measured_profile,
    pairs_for_request,
    step_cost,
    step_time,
)

H100 = PROFILES["h100-80gb"]
LLAMA_8B = ModelCost.from_shape(get_model("llama-3.1-8b"))


def test_h100_profile_is_the_datasheet():
    assert H100.peak_flops == 989.4e12 and H100.mem_bandwidth == 3.35e12
    assert 0.3 <= H100.compute_efficiency <= 0.6
    assert 0.7 <= H100.bandwidth_efficiency <= 0.85
    assert gpu_profile("h100", dtype="fp8").peak_flops == pytest.approx(
        2 * H100.peak_flops, rel=1e-3
    )


def test_llama_8b_prefill_2000_tokens_about_100ms():
    t = step_time(H100, LLAMA_8B, prefill_tokens=2000, decode_tokens=0, context_tokens_read=0)
    assert t == pytest.approx(0.100, rel=0.30)
    assert step_cost(H100, LLAMA_8B, 2000, 0, 0).bound == "compute"


def test_llama_8b_lone_decode_about_8ms():
    t = step_time(H100, LLAMA_8B, prefill_tokens=0, decode_tokens=1, context_tokens_read=100)
    assert t == pytest.approx(0.008, rel=0.30)
    assert step_cost(H100, LLAMA_8B, 0, 1, 100).bound == "memory"


def test_cost_figures():
    # 2 x 6.98 B matmul params per token; weights read once per step, minus the untied
    # input embedding (gathered, not streamed)
    assert LLAMA_8B.linear_flops_per_token == pytest.approx(2 * 6.98e9, rel=0.01)
    assert LLAMA_8B.weight_bytes_per_step == 8_030_261_248 * 2 - 2 * 128256 * 4096
    assert LLAMA_8B.kv_bytes_per_token == 131_072
    assert LLAMA_8B.attention_flops_per_pair == 4 * 32 * 32 * 128


def test_decode_batching_is_nearly_free_until_kv_dominates():
    one = step_time(H100, LLAMA_8B, 0, 1, 500)
    many = step_time(H100, LLAMA_8B, 0, 64, 64 * 500)
    assert many < 1.5 * one  # weights are shared by the whole batch
    long_ctx = step_time(H100, LLAMA_8B, 0, 64, 64 * 8000)
    assert long_ctx > 2 * one  # 64 x 8,000 tokens of KV outweigh the weights


def test_monotonic_and_empty():
    assert step_time(H100, LLAMA_8B, 0, 0, 0) == 0.0
    base = step_time(H100, LLAMA_8B, 512, 32, 32 * 1000)
    assert step_time(H100, LLAMA_8B, 1024, 32, 32 * 1000) > base
    assert step_time(H100, LLAMA_8B, 512, 33, 33 * 1000) > base
    with pytest.raises(ValueError):
        step_time(H100, LLAMA_8B, -1, 0, 0)


def test_attention_pairs():
    assert pairs_for_request(1, 2000) == 2001  # a decode sees its context and itself
    assert pairs_for_request(4, 0) == 10  # causal: 1 + 2 + 3 + 4
    # a second prefill chunk costs more than its default estimate assumes
    exact = pairs_for_request(1000, 1000)
    assert step_time(H100, LLAMA_8B, 1000, 0, 1000, attention_pairs=exact) > step_time(
        H100, LLAMA_8B, 1000, 0, 1000
    )


def test_tensor_parallel_70b():
    cost = ModelCost.from_shape(get_model("llama-3.1-70b"), tp=4)
    assert cost.allreduces_per_step == 162  # 2 per layer, the embedding, the logits
    assert cost.kv_bytes_per_token == 80 * 1024
    c = step_cost(H100, cost, 0, 1, 1000)
    assert 0 < c.comm_s < c.memory_s  # 162 small collectives, cheap next to 35 GB of weights
    assert 0.010 < c.total_s < 0.030
    with pytest.raises(ValueError):
        step_time(dataclasses.replace(H100, link_bandwidth=0.0), cost, 0, 1, 10)


def test_measured_cpu_profile():
    cpu = measured_profile(flops=1e12, bandwidth=50e9, step_overhead_s=0.005)
    assert cpu.compute_efficiency == cpu.bandwidth_efficiency == 1.0
    tiny = ModelCost.from_shape(get_model("smollm2-135m"))
    t = step_time(cpu, tiny, 0, 1, 10)
    assert t == pytest.approx(tiny.weight_bytes_per_step / 50e9 + 0.005, rel=0.01)
    with pytest.raises(ValueError):
        measured_profile(0, 1)


def test_attention_runs_at_its_own_efficiency():
    # FlashAttention-class kernels: 0.6 of peak on the datasheet profiles; the matmuls 0.4
    assert H100.attention_efficiency == 0.6 and H100.compute_efficiency == 0.4
    pairs = pairs_for_request(6000, 0)
    c = step_cost(H100, LLAMA_8B, 6000, 0, 0, attention_pairs=pairs, sampled_tokens=1)
    matmul = LLAMA_8B.linear_flops_per_token * 6000 + LLAMA_8B.lm_head_flops_per_token
    attention = LLAMA_8B.attention_flops_per_pair * pairs
    assert c.flops == matmul + attention
    assert c.compute_s == pytest.approx(matmul / (0.4 * 989.4e12) + attention / (0.6 * 989.4e12))
    # a measured profile prices every FLOP at its one fitted rate
    cpu = measured_profile(flops=1e12, bandwidth=50e9)
    assert step_cost(cpu, LLAMA_8B, 6000, 0, 0).compute_s == pytest.approx(
        step_cost(cpu, LLAMA_8B, 6000, 0, 0).flops / 1e12
    )


def test_a_decode_stack_prices_the_steps_the_engine_runs_on_it():
    layers = measured_profile(flops=4e11, bandwidth=1e12, step_overhead_s=0.030)
    stack = measured_profile(flops=4e11, bandwidth=1e12, step_overhead_s=0.004)
    cpu = dataclasses.replace(layers, decode_stack=stack, decode_stack_max_tokens=16)
    tiny = ModelCost.from_shape(get_model("smollm2-135m"))
    for prefill, decode, path in [(0, 1, stack), (0, 16, stack), (0, 17, layers),
                                  (1, 3, layers), (64, 0, layers)]:  # fmt: skip
        assert cpu.profile_for_step(prefill, decode) is (stack if path is stack else cpu)
        assert step_time(cpu, tiny, prefill, decode, 100) == step_time(
            path, tiny, prefill, decode, 100
        )
    assert step_time(cpu, tiny, 0, 16, 100) < step_time(cpu, tiny, 0, 17, 100) - 0.025
    assert layers.profile_for_step(0, 1) is layers  # no stack: one path


def test_wide_steps_are_priced_by_their_own_profile():
    layers = measured_profile(flops=6e10, bandwidth=2e10, step_overhead_s=0.010)
    wide = measured_profile(flops=1.1e11, bandwidth=2e10, step_overhead_s=0.080)
    stack = measured_profile(flops=6e10, bandwidth=2e10, step_overhead_s=0.004)
    cpu = dataclasses.replace(layers, decode_stack=stack, decode_stack_max_tokens=16)
    cpu = dataclasses.replace(cpu, wide_step=wide, wide_step_min_tokens=192)
    for prefill, decode, path in [(0, 16, stack), (0, 17, cpu), (191, 0, cpu), (192, 0, wide),
                                  (100, 92, wide), (0, 200, wide), (1024, 0, wide)]:  # fmt: skip
        assert cpu.profile_for_step(prefill, decode) is path
    tiny = ModelCost.from_shape(get_model("smollm2-135m"))
    assert step_time(cpu, tiny, 192, 0, 0) == step_time(wide, tiny, 192, 0, 0)
    assert step_time(cpu, tiny, 1024, 0, 0) < step_time(layers, tiny, 1024, 0, 0) * 0.8
    one_path = dataclasses.replace(layers, wide_step_min_tokens=192)  # no profile: no path
    assert one_path.profile_for_step(192, 0) is one_path
