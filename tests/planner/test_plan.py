"""The worked sizing examples: Llama 3.1 8B on one H100, 70B at tp=4."""

import pytest

from servelm.planner.catalog import get_gpu, get_model
from servelm.planner.plan import PlanError, plan

H100 = get_gpu("h100-80gb")


@pytest.fixture
def llama8b_plan():
    return plan(get_model("llama-3.1-8b"), H100)  # bf16, 0.9, 2 GB allowance


def test_llama_8b_on_one_h100(llama8b_plan):
    p = llama8b_plan
    assert p.usable_bytes == 72e9  # 80 GB x 0.9
    assert round(p.weight_bytes / 1e9, 2) == 16.06
    assert p.kv_bytes_per_token == 131_072
    assert p.kv_pool_bytes / 1e9 == pytest.approx(53.94, abs=0.005)  # "about 54 GB"
    assert p.kv_capacity_tokens == pytest.approx(411_000, rel=0.005)
    assert p.kv_capacity_blocks == pytest.approx(25_700, rel=0.005)
    assert round(p.max_concurrency, 1) == 3.1  # at 131,072 tokens
    assert p.typical_concurrency == pytest.approx(164, abs=1)  # at 2,500 tokens
    assert p.fits and p.min_tp == 1
    assert p.collectives_per_step == 0


def test_capping_context_raises_concurrency_four_times(llama8b_plan):
    capped = plan(get_model("llama-3.1-8b"), H100, max_model_len=32_768)
    assert capped.max_concurrency == pytest.approx(4 * llama8b_plan.max_concurrency)


def test_llama_70b_tp4():
    p = plan(get_model("llama-3.1-70b"), H100, tp=4)
    assert (p.q_heads_per_gpu, p.kv_heads_per_gpu) == (16, 2)
    assert p.weight_bytes / 1e9 == pytest.approx(35, abs=0.5)
    assert p.kv_bytes_per_token == 80 * 1024  # 80 KiB per GPU
    assert p.kv_bytes_per_token_total == 4 * 80 * 1024
    assert p.collectives_per_step == 162  # 2 all-reduces per layer x 80, embedding, logits
    assert p.fits


def test_70b_does_not_fit_one_gpu_and_suggests_tp4():
    p = plan(get_model("llama-3.1-70b"), H100)
    assert not p.fits and p.kv_capacity_tokens == 0
    assert p.min_tp == 4 and "TP that fits: 4" in p.verdict


def test_fp8_weights_and_kv_let_70b_fit_two_gpus():
    p = plan(get_model("llama-3.1-70b"), H100, weight_dtype="fp8", kv_dtype="fp8", tp=2)
    assert p.fits and p.min_tp == 2


def test_context_limited_verdict():
    p = plan(get_model("llama-3.1-8b"), get_gpu("l4"))  # 24 GB: weights fit, 128K context not
    assert not p.fits and 0 < p.kv_capacity_tokens < 131_072
    assert "max_model_len" in p.verdict and p.min_tp == 2


def test_405b_needs_quantisation():
    assert plan(get_model("llama-3.1-405b"), H100, tp=8).min_tp is None
    assert plan(get_model("llama-3.1-405b"), H100, weight_dtype="fp8", tp=8).fits


def test_cold_start_is_weights_over_bandwidth_plus_warmup():
    p = plan(get_model("llama-3.1-70b"), H100, tp=4)
    by_source = {c.source: c for c in p.cold_start}
    net = by_source["network volume"]  # 1 GB/s: about three minutes for 70B
    assert net.read_s == pytest.approx(141.1, abs=0.1)
    assert net.total_s == pytest.approx(net.read_s + net.copy_s + 40)
    assert 150 < net.total_s < 210
    assert by_source["local NVMe"].total_s < net.total_s < by_source["internet download"].total_s


def test_bad_settings_raise():
    with pytest.raises(PlanError):
        plan(get_model("llama-3.1-8b"), H100, gpu_memory_utilization=1.5)
    with pytest.raises(PlanError):
        plan(get_model("mistral-7b"), H100, max_model_len=200_000)
