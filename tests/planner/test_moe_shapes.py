"""Mixtures of experts in `servelm plan`: weights count every expert, compute the active ones.

The catalog's Mixtral-8x7B and Qwen3-30B-A3B come out at their published totals (in
test_model_catalog.py) and at the active sizes their names and cards give (12.9 B, 3.3 B);
the same numbers come from their config.json as published.
"""

import json

import pytest

from servelm.cli import main
from servelm.planner.catalog import get_gpu, get_model
from servelm.planner.plan import plan
from servelm.planner.shapes import shape_from_config
from servelm.sim.roofline import ModelCost

MIXTRAL_CONFIG = {  # mistralai/Mixtral-8x7B-Instruct-v0.1 config.json, the fields that size it
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN3_MOE_CONFIG = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    ("name", "config", "total", "active"),
    [
        ("mixtral-8x7b", MIXTRAL_CONFIG, 46_702_792_704, 12_879_925_248),
        ("qwen3-30b-a3b", QWEN3_MOE_CONFIG, 30_532_122_624, 3_353_032_704),
    ],
)
def test_active_and_total_parameters(name, config, total, active):
    shape = get_model(name)
    assert shape.num_params() == total and shape.active_params() == active
    assert shape_from_config(config, name).num_params() == total
    assert shape_from_config(config, name).active_params() == active
    # The published "12.9B active" / "3.3B activated"
    assert active == pytest.approx({"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9}[name], rel=0.02)


def test_weights_hold_every_expert_and_compute_runs_the_chosen():
    mixtral = get_model("mistralai/Mixtral-8x7B-Instruct-v0.1")
    # bf16: 2 bytes per parameter, every expert (93 GB): more than one H100 holds.
    assert mixtral.weight_bytes("bf16") == pytest.approx(2 * mixtral.num_params(), rel=1e-6)
    p = plan(mixtral, get_gpu("h100"))
    assert not p.fits and p.min_tp == 2 and p.active_params == 12_879_925_248
    # Per token: the attention and two of eight experts (plus the routers) per layer.
    cost = ModelCost.from_shape(mixtral)
    in_blocks = mixtral.layer_linear_params(active=True)
    assert cost.linear_flops_per_token == pytest.approx(2 * in_blocks)
    assert in_blocks == mixtral.active_params() - 2 * 32000 * 4096 - mixtral.norm_params()
    # With TP each rank holds a slice of every expert.
    assert mixtral.weight_bytes("bf16", tp=2) < mixtral.weight_bytes("bf16") / 2 + 1e9


def test_dense_layers_of_a_qwen3_moe_config():
    # Sparse every second layer, and layer 3 dense by name: layers 1 and 5 are sparse.
    config = {
        **QWEN3_MOE_CONFIG,
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    shape = shape_from_config(config)
    assert (shape.sparse_layers(), shape.dense_layers) == (2, 4)
    dense_mlp, expert = 3 * 2048 * 6144, 3 * 2048 * 768
    assert shape.all_mlp_params() == 4 * dense_mlp + 2 * (128 * 2048 + 128 * expert)
    assert shape.all_mlp_params(active=True) == 4 * dense_mlp + 2 * (128 * 2048 + 8 * expert)


def test_plan_cli_reports_active_parameters(capsys):
    assert main(["plan", "qwen3-30b-a3b", "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_params"], out["active_params"]) == (30_532_122_624, 3_353_032_704)
    assert out["fits"]
    assert main(["plan", "mixtral-8x7b", "--gpu", "h200", "--max-model-len", "8192"]) == 0
    assert "46.70 B (12.88 B active)" in capsys.readouterr().out
    assert main(["plan", "--list"]) == 0
    assert "3.35 B active" in capsys.readouterr().out
