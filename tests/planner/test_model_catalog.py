"""Catalog sanity: parameter counts match the published sizes, GPU numbers are sane."""

import pytest

from servelm.planner.catalog import GPUS, MODELS, get_gpu, get_model
from servelm.planner.shapes import ShapeError

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "mistral-7b": 7_248_023_552,
    "smollm2-135m": 134_515_008,
    "mixtral-8x7b": 46_702_792_704,  # every expert counted
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-3-1b": 999_885_952,
    "phi-3.5-mini": 3_821_079_552,
}


def test_catalog_covers_the_named_models():
    assert set(MODELS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_from_shape(name):
    assert MODELS[name].num_params() == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_are_consistent(name):
    m = MODELS[name]
    assert m.num_heads % m.num_kv_heads == 0  # grouped-query attention
    assert m.max_context >= 8192 and m.hf_id


def test_lookup_accepts_hub_ids():
    assert get_model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"
    assert get_model("Qwen/Qwen2.5-72B-Instruct").name == "qwen2.5-72b"
    assert get_model("mistralai/Mistral-7B-Instruct-v0.3").name == "mistral-7b"
    with pytest.raises(ShapeError):
        get_model("gpt-5")


def test_gpu_catalog():
    assert {
        "h100-80gb",
        "h200-141gb",
        "a100-40gb",
        "a100-80gb",
        "l4",
        "a10g",
        "rtx-4090",
        "b200",
    } <= set(GPUS)
    h100 = get_gpu("h100")
    assert h100.memory_bytes == 80e9 and h100.mem_bandwidth == 3.35e12
    assert h100.peak_flops("fp8") == pytest.approx(2 * h100.peak_flops("bf16"), rel=1e-3)
    assert get_gpu("a100-80gb").peak_flops("fp8") == 312e12  # no fp8 tensor cores
    for g in GPUS.values():
        assert 16e9 <= g.memory_bytes <= 200e9
        assert 0.2e12 <= g.mem_bandwidth <= 10e12
        assert 50e12 <= g.bf16_flops <= 5e15
    with pytest.raises(ShapeError):
        get_gpu("tpu-v5")
