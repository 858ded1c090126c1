"""Model shapes: parameter counts from the shape, KV bytes, TP splits, config.json."""

import json

import pytest

from servelm.planner.catalog import get_model, resolve_model
from servelm.planner.shapes import ShapeError, shape_from_config, shape_from_folder

LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

QWEN_05B_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}


def test_kv_bytes_per_token_worked_example():
    # 2 x 32 layers x 8 KV heads x 128 values x 2 bytes
    assert get_model("llama-3.1-8b").kv_bytes_per_token("bf16") == 131_072
    assert get_model("llama-3.1-8b").kv_bytes_per_token("fp8") == 65_536


def test_weight_bytes_scale_with_dtype():
    m = get_model("llama-3.1-8b")
    bf16, fp8, int4 = (m.weight_bytes(d) for d in ("bf16", "fp8", "int4"))
    assert bf16 / 1e9 == pytest.approx(16.06, abs=0.005)
    # quantisation halves / quarters the block matmuls; embeddings + LM head stay bf16
    assert 0.5 < fp8 / bf16 < 0.6
    assert 0.25 < int4 / bf16 < 0.4


def test_kv_heads_replicate_when_fewer_than_tp():
    qwen7 = get_model("qwen2.5-7b")  # 28 query heads, 4 KV heads
    assert qwen7.heads_per_gpu(4) == (7, 1)
    m = get_model("smollm2-135m")  # 9 query, 3 KV heads: tp=3 splits them evenly
    assert m.heads_per_gpu(3) == (3, 1)
    llama1b = get_model("llama-3.2-1b")  # 32 query, 8 KV heads
    assert llama1b.heads_per_gpu(16) == (2, 1)  # 8 KV heads over 16 ranks: replicated
    assert llama1b.kv_bytes_per_token("bf16", 16) == 2 * 16 * 1 * 64 * 2


def test_bad_tp_is_a_typed_error():
    with pytest.raises(ShapeError):
        get_model("qwen2.5-7b").heads_per_gpu(8)  # 28 query heads over 8 GPUs
    with pytest.raises(ShapeError):
        get_model("llama-3.1-8b").weight_bytes("fp4")


def test_shape_from_config_matches_catalog():
    shape = shape_from_config(LLAMA_8B_CONFIG, name="llama-3.1-8b")
    assert shape.head_dim == 128  # derived from hidden / heads when head_dim is absent
    assert shape.num_params() == get_model("llama-3.1-8b").num_params()
    qwen = shape_from_config(QWEN_05B_CONFIG, name="qwen")
    assert qwen.qkv_bias and qwen.tie_embeddings
    assert qwen.num_params() == get_model("qwen2.5-0.5b").num_params()
    # Qwen2's modeling ignores attention_bias / mlp_bias (q, k, v biased; o_proj, MLP not)
    flagged = {**QWEN_05B_CONFIG, "attention_bias": True, "mlp_bias": True}
    assert shape_from_config(flagged, name="qwen").num_params() == qwen.num_params()


def test_shape_from_folder(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B_CONFIG, "head_dim": 128}))
    shape = resolve_model(str(folder))
    assert shape.name == "my-llama"
    assert shape.kv_bytes_per_token() == 131_072
    assert shape_from_folder(folder / "config.json") == shape


def test_config_missing_key_is_a_typed_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ShapeError, match="num_attention_heads|num_hidden_layers"):
        shape_from_folder(tmp_path)
    with pytest.raises(ShapeError):
        shape_from_folder(tmp_path / "missing")
