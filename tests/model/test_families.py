"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers (issue #34): a tiny random-weight model
of each made with transformers' own config class, served by servelm's real loader and engine in
float32, greedy tokens and logprobs equal to transformers' (tests/model/family_harness.py:
batched, prefix-cached, chunked, preempted).

The configs make each family's differences count: head_dim apart from hidden / heads (Qwen3),
soft-capping caps small enough to bend these logits (Gemma 2), a window of 16 tokens under
prompts of 45-88 (Gemma), query_pre_attn_scalar apart from head_dim, random norm weights (so
the (1 + w) norms and q/k norms are not identities), LongRoPE short factors and attention factor
(Phi-3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from servelm.kernels.build import compiler
from servelm.model.config import ModelConfigError, spec_from_dict
from tests.model.family_harness import check_against_transformers, make_tiny_model

WINDOW = 16
# Both attention paths, one engine each: torch ops for the batched and prefix-cached runs, the
# C kernels (where they build) for the chunked and preempted one.
BACKENDS = dict(roomy_kernels="torch", kernels=("auto",))


def test_qwen3(tmp_path):
    model_dir = make_tiny_model(tmp_path, "Qwen3Config", num_hidden_layers=3, head_dim=24)
    spec = json.loads((model_dir / "config.json").read_text())
    assert spec["architectures"] == ["Qwen3ForCausalLM"]
    check_against_transformers(model_dir, **BACKENDS)


def test_gemma2(tmp_path):
    model_dir = make_tiny_model(
        tmp_path,
        "Gemma2Config",
        num_hidden_layers=4,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0,
    )
    spec = spec_from_dict(json.loads((model_dir / "config.json").read_text()))
    assert spec.layer_windows == (WINDOW, None, WINDOW, None)
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (5.0, 4.0)
    check_against_transformers(model_dir, **BACKENDS)


def test_gemma3(tmp_path):
    model_dir = make_tiny_model(
        tmp_path,
        "Gemma3TextConfig",
        num_hidden_layers=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24,
    )
    spec = spec_from_dict(json.loads((model_dir / "config.json").read_text()))
    assert spec.architecture == "Gemma3ForCausalLM"
    assert spec.layer_windows == (WINDOW, None, WINDOW, None)
    assert (spec.rope_theta, spec.local_rope_theta) == (1e6, 1e4)
    check_against_transformers(model_dir, **BACKENDS)


PHI3_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.25 * i for i in range(8)],  # head_dim 16: 8 frequencies
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 256,
}


def test_phi3(tmp_path):
    # Prompts and answers stay under original_max_position_embeddings, where transformers and
    # servelm both use the short factors (the long ones: test_longrope_table_matches).
    model_dir = make_tiny_model(
        tmp_path,
        "Phi3Config",
        rope_scaling=PHI3_ROPE,
        original_max_position_embeddings=256,
        max_position_embeddings=1024,
    )
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names  # fused in the checkpoint
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    check_against_transformers(model_dir, **BACKENDS)


def test_longrope_table_matches_transformers():
    """servelm's LongRoPE table against transformers' own frequencies and attention factor:
    short factors below original_max_position_embeddings, long ones from there on."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from servelm.model.layers.rotary import RotaryEmbedding

    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        rope_scaling=dict(PHI3_ROPE),
        original_max_position_embeddings=256,
        max_position_embeddings=1024,
    )
    cfg = json.loads(config.to_json_string()) | {"architectures": ["Phi3ForCausalLM"]}
    spec = spec_from_dict(cfg)
    assert spec.rope_scaling["factor"] == 4.0
    table = RotaryEmbedding(spec.head_dim, 1024, spec.rope_theta, spec.rope_scaling)
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    for seq_len, rows in ((None, slice(0, 256)), (257, slice(256, 1024))):
        inv_freq, attention = longrope(config, seq_len=seq_len)
        assert attention > 1.0
        pos = torch.arange(1024, dtype=torch.float32)[rows]
        freqs = torch.outer(pos, inv_freq)
        cos = torch.cat((freqs, freqs), -1).cos() * attention
        torch.testing.assert_close(table.cos[rows], cos, rtol=0, atol=1e-6)


def _spec(arch: str, **fields):
    base = dict(
        architectures=[arch],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
    )
    return spec_from_dict(base | fields)


def test_older_config_layouts():
    """Configs written before transformers 5's layer_types and rope_parameters."""
    gemma2 = _spec("Gemma2ForCausalLM", sliding_window=4096, query_pre_attn_scalar=256)
    assert gemma2.layer_windows == (4096, None) * 3  # even layers local
    assert gemma2.attn_scale == 256**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = _spec(
        "Gemma3ForCausalLM",
        sliding_window=512,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh",
    )
    assert gemma3.layer_windows == (512, 512, None) * 2  # every third layer global
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling["factor"] == 8.0 and gemma3.hidden_act == "gelu_pytorch_tanh"
    phi3 = _spec(
        "Phi3ForCausalLM",
        sliding_window=2047,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.5] * 8},
    )
    assert phi3.layer_windows == (2047,) * 6  # transformers windows every Phi-3 layer
    assert phi3.rope_scaling["factor"] == 32.0
    qwen3 = _spec(
        "Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=4
    )
    assert qwen3.layer_windows == (None,) * 4 + (64,) * 2


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"hidden_activation": "gelu_fast"}, "gelu_fast"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5},
            "partial_rotary_factor",
        ),
    ],
)
def test_config_refusals_name_the_field(fields, named):
    with pytest.raises(ModelConfigError, match=named):
        _spec(
            "Gemma2ForCausalLM",
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            **fields,
        )


@pytest.mark.skipif(compiler() is None, reason="the C kernels need a C compiler")
def test_phi3_runs_in_the_c_layer_loop(tmp_path, monkeypatch):
    """Phi-3's layer is the Llama layer (only its rotary table differs), so with int4 weights
    in bfloat16 the C decode loop runs it, past original_max_position_embeddings too (long
    factors), with the same greedy tokens as the Python layers."""
    from servelm import LLM, SamplingParams
    from servelm.model.phi3 import Phi3ForCausalLM
    from tests.model.family_harness import prompts_sharing_prefix

    rope = PHI3_ROPE | {"original_max_position_embeddings": 64}
    model_dir = make_tiny_model(
        tmp_path,
        "Phi3Config",
        rope_scaling=rope,
        original_max_position_embeddings=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    prompts = prompts_sharing_prefix(380)  # 45-88 tokens: past 64
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    for c_loop in (True, False):
        if not c_loop:
            monkeypatch.setattr(Phi3ForCausalLM, "c_layer_loop", lambda self: False)
        # No prefix caching: both runs compute the same steps, which round alike in bfloat16.
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            quantization="int4",
            kv_cache_memory="8MiB",
            device="cpu",
            enable_prefix_caching=False,
        )
        assert (llm.engine.executor.decode_stack is not None) == c_loop
        tokens.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
    assert tokens[0] == tokens[1]
