"""config.json fields that change the computation are computed, or refused by name: never
dropped in silence.

- Biases as each family's transformers modeling file builds them (`attention_bias` on q/k/v
  and o for Llama, Qwen3 and Gemma; `mlp_bias` on gate/up/down for Llama; none for Mistral
  whatever its config says) and the MLP activations of `hidden_act` / `hidden_activation`:
  greedy tokens and logprobs equal transformers' (tests/model/family_harness.py).
- The C decode loop (worker/decode_stack.py), which computes SiLU and no biases, does not take
  a model with another activation or with biases: the torch layers run it.
- A checkpoint tensor the model does not read is refused by name (a bias, a scale), except
  what a model computes itself (rotary inv_freq) or ties (lm_head beside a tied embedding).
- A quantized checkpoint (`quantization_config`: FP8, GPTQ) is refused by its quant_method.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelm import LLM, SamplingParams
from servelm.kernels.build import compiler
from servelm.model.config import ModelConfigError
from servelm.model.loader import WeightLoadError
from tests.model.family_harness import check_against_transformers, make_tiny_model

# Torch layers for the roomy runs, the C kernels (where they build) for the tight ones.
BACKENDS = dict(roomy_kernels="torch", kernels=("auto",))


@pytest.mark.parametrize(
    "config, fields, biases",
    [
        # o_proj's bias too (servelm once loaded q/k/v's alone)
        ("LlamaConfig", dict(attention_bias=True), ("q_proj", "o_proj")),
        ("LlamaConfig", dict(mlp_bias=True), ("gate_proj", "down_proj")),
        ("LlamaConfig", dict(hidden_act="gelu"), ()),
        ("MistralConfig", dict(hidden_act="relu", attention_bias=True, mlp_bias=True), ()),
        ("Qwen2Config", dict(hidden_act="gelu_new"), ("q_proj",)),
        ("Qwen3Config", dict(attention_bias=True), ("k_proj", "o_proj")),
        ("Gemma2Config", dict(attention_bias=True, hidden_activation="gelu"), ("o_proj",)),
    ],
)
def test_biases_and_activations_match_transformers(tmp_path, config, fields, biases):
    model_dir = make_tiny_model(tmp_path, config, **fields)
    names = set(load_file(str(model_dir / "model.safetensors")))
    have = {n.split(".")[-2] for n in names if n.endswith("proj.bias")}
    assert set(biases) <= have and (biases or not have), have  # the case is what it says
    check_against_transformers(model_dir, max_tokens=16, **BACKENDS)


def _decode_stack_built(model_dir: Path) -> bool:
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        quantization="int4",
        kv_cache_memory="8MiB",
        device="cpu",
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids) == 4
    return llm.engine.executor.decode_stack is not None


@pytest.mark.skipif(compiler() is None, reason="the C kernels need a C compiler")
def test_the_c_layer_loop_runs_silu_without_biases_only(tmp_path):
    """int4 weights in bfloat16 put a plain Llama in the C decode loop; one with GELU or with
    biases stays in the torch layers, which compute them."""
    assert _decode_stack_built(make_tiny_model(tmp_path / "plain", "LlamaConfig"))
    gelu = make_tiny_model(tmp_path / "gelu", "LlamaConfig", hidden_act="gelu")
    assert not _decode_stack_built(gelu)
    biased = make_tiny_model(tmp_path / "bias", "LlamaConfig", attention_bias=True, mlp_bias=True)
    assert not _decode_stack_built(biased)


def _rewrite(model_dir: Path, change) -> None:
    """Rewrite the checkpoint with `change(tensors)` applied (a dict of name -> tensor)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _load(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB")


def test_a_tensor_the_model_does_not_read_is_refused_by_name(tmp_path):
    model_dir = make_tiny_model(tmp_path, "LlamaConfig")  # mlp_bias false in config.json
    _rewrite(model_dir, lambda t: t.update({"model.layers.1.mlp.down_proj.bias": torch.ones(64)}))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.\{1\}\.mlp\.down_proj\.bias"):
        _load(model_dir)


def test_tensors_a_model_computes_or_ties_are_ignored(tmp_path):
    model_dir = make_tiny_model(tmp_path, "LlamaConfig", tie_word_embeddings=True)

    def add(tensors):
        assert "lm_head.weight" not in tensors
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite(model_dir, add)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(_load(model_dir).generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3


def _fp8_folder(src: Path, dst: Path, quantization_config: dict | None) -> Path:
    """`src` with each projection weight as float8_e4m3fn and a per-tensor `weight_scale`, the
    layout of FP8 releases (Qwen3-*-FP8, llm-compressor's)."""
    shutil.copytree(src, dst)

    def to_fp8(tensors):
        for name in [n for n in tensors if n.endswith("proj.weight")]:
            scale = tensors[name].abs().max() / 448.0
            tensors[name] = (tensors[name] / scale).to(torch.float8_e4m3fn)
            tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(()).float()

    _rewrite(dst, to_fp8)
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
    ],
)
def test_a_quantized_checkpoint_is_refused_by_its_method(tmp_path, quant):
    src = make_tiny_model(tmp_path, "LlamaConfig")
    model_dir = _fp8_folder(src, tmp_path / "quantized", quant)
    method = quant["quant_method"]
    with pytest.raises(ModelConfigError, match=f"quant_method '{method}' is not supported"):
        _load(model_dir)


def test_fp8_weights_without_a_quantization_config_are_refused_by_their_scales(tmp_path):
    src = make_tiny_model(tmp_path, "LlamaConfig")
    model_dir = _fp8_folder(src, tmp_path / "fp8", None)
    with pytest.raises(WeightLoadError, match=r"self_attn\.q_proj\.weight_scale"):
        _load(model_dir)
