"""`servelm plan` sizes Qwen3, Gemma 2/3 and Phi-3 from their config.json as published: the
same totals as the catalog's entries (which test_model_catalog.py holds to the published
counts), Gemma's four norms a layer and Gemma 3's q/k norms included, and a Gemma whose local
layers are windowed still counts every token's KV (its global layers keep them)."""

import pytest

from servelm.planner.catalog import get_gpu, get_model
from servelm.planner.plan import plan
from servelm.planner.shapes import shape_from_config

GEMMA2_2B = {  # google/gemma-2-2b-it config.json, the fields that size it
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "head_dim": 256,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "vocab_size": 256000,
}
GEMMA3_1B = {  # google/gemma-3-1b-it
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "head_dim": 256,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "rope_local_base_freq": 10000,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
PHI35_MINI = {  # microsoft/Phi-3.5-mini-instruct (its rope_scaling factors left out)
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
}


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("gemma-2-2b", GEMMA2_2B),
        ("gemma-3-1b", GEMMA3_1B),
        ("qwen3-8b", QWEN3_8B),
        ("phi-3.5-mini", PHI35_MINI),
    ],
)
def test_config_sizes_like_the_catalog(name, config):
    tied = config | {"tie_word_embeddings": config.get("tie_word_embeddings", True)}
    shape = shape_from_config(tied, name)
    assert shape.num_params() == get_model(name).num_params()
    assert shape.kv_bytes_per_token() == get_model(name).kv_bytes_per_token()


def test_gemma_norms_counted():
    gemma = get_model("google/gemma-2-9b-it")
    assert gemma.post_norms and not gemma.qk_norm
    assert gemma.norm_params() == (4 * 42 + 1) * 3584
    assert get_model("gemma-3-1b").norm_params() == (4 * 26 + 1) * 1152 + 2 * 26 * 256


def test_gemma_kv_is_full_context():
    """Half of Gemma 2's layers look back 4,096 tokens, but one block table serves every
    layer, so a request of 8,192 tokens holds 8,192 tokens of KV in each."""
    p = plan(get_model("gemma-2-9b"), get_gpu("l4"), max_model_len=8192)
    assert p.kv_bytes_per_token == 2 * 42 * 8 * 256 * 2
    assert p.max_concurrency == pytest.approx(p.kv_capacity_blocks / (8192 / 16))
