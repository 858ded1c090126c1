"""`servelm plan` counts a sliding window where every layer has one (Mistral 7B v0.1): the
engine gives back the blocks behind it, so a request holds at most window + one block of KV
whatever its length. A model with a full-attention layer (Qwen2 with windows on some layers)
keeps every block."""

from servelm.planner.catalog import get_gpu
from servelm.planner.plan import blocks_per_request, plan
from servelm.planner.shapes import shape_from_config

MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1 config.json, the fields that size it
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "vocab_size": 32000,
}


def test_blocks_per_request_stop_at_the_window():
    assert blocks_per_request(32768, 16) == 2048
    assert blocks_per_request(32768, 16, window=4096) == 257  # window + one block
    assert blocks_per_request(100, 16, window=4096) == 7  # shorter than the window: its length


def test_a_windowed_mistral_holds_window_plus_a_block_per_request():
    gpu = get_gpu("h100-80gb")
    windowed = shape_from_config(MISTRAL_7B_V01, "mistral-7b-v0.1")
    full = shape_from_config({**MISTRAL_7B_V01, "sliding_window": None}, "no window")
    assert (windowed.kv_window, full.kv_window) == (4096, 0)
    pw, pf = plan(windowed, gpu), plan(full, gpu)
    assert pw.kv_capacity_blocks == pf.kv_capacity_blocks  # the same pool
    assert pw.max_concurrency / pf.max_concurrency == 2048 / 257  # at 32,768 tokens
    assert pw.typical_concurrency == pf.typical_concurrency  # 2,500 tokens: inside the window
    assert "sliding window 4,096" in pw.verdict


def test_a_pool_short_of_max_len_fits_when_the_window_does():
    # int8 weights on a 24 GB GPU at 0.4: a pool of a few thousand tokens, short of 32,768,
    # still holds a request's window and a block
    gpu = get_gpu("l4")
    shape = shape_from_config(MISTRAL_7B_V01, "mistral-7b-v0.1")
    no_window = shape_from_config({**MISTRAL_7B_V01, "sliding_window": None}, "no window")
    args = dict(weight_dtype="int8", gpu_memory_utilization=0.4, allowance_gb=1.0)
    p, q = plan(shape, gpu, **args), plan(no_window, gpu, **args)
    assert 4096 + 16 <= p.kv_capacity_tokens < 32768, p.kv_capacity_tokens
    assert p.fits and not q.fits


def test_a_full_attention_layer_keeps_every_block():
    qwen2 = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 21,  # layers 0-20 full, 21-23 windowed
    }
    assert shape_from_config(qwen2, "qwen2").kv_window == 0
