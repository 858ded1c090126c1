"""Fixtures for store tests: a tiny random-weight Llama GGUF written the way llama.cpp writes one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

Q = gguf.GGMLQuantizationType

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, CONTEXT = 64, 4, 2, 16, 96, 2, 256

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE: "Ġ" is the byte-level stand-in for a space. "1 2" is a merge on purpose: the
# smollm pre-tokenizer splits digits apart first, so it must never fire.
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
PLAIN = ["h", "e", "l", "o", "w", "r", "d", "Ġ", "1", "2", "!"]
TOKENS = SPECIALS + PLAIN + ["".join(m.split(" ")) for m in MERGES]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def llamacpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row reordering llama.cpp's HF->GGUF converter applies (written out here on purpose,
    independent of servelm, so the import is checked against the converter, not against itself)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_tensors(rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": rand(len(TOKENS), HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = rand(len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        t[p + "input_layernorm.weight"] = rand(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = rand(HIDDEN)
    return t


_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _qtype(hf_name: str, all_q4_1: bool) -> Q:
    # A mix like a real Q4_1 file: embeddings Q8_0, k and mlp Q4_1, q/v/o and norms exact.
    # Or, like the default model's file, every projection Q4_1.
    if hf_name == "model.embed_tokens.weight":
        return Q.Q8_0
    if all_q4_1 and hf_name.endswith("proj.weight"):
        return Q.Q4_1
    if hf_name.endswith("down_proj.weight"):
        return Q.Q8_0
    if hf_name.endswith(("k_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return Q.Q4_1
    return Q.F32


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = True,
    pre: str = "smollm",
    seed: int = 0,
    all_q4_1: bool = False,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF to `path`; return the HF-layout weights an exact import must produce."""
    hf = _hf_tensors(np.random.default_rng(seed), tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    expected = {}
    for name, weight in hf.items():
        stored = weight
        if name.endswith("q_proj.weight"):
            stored = llamacpp_permute(weight, HEADS)
        elif name.endswith("k_proj.weight"):
            stored = llamacpp_permute(weight, KV_HEADS)
        qtype = _qtype(name, all_q4_1)
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(name), stored)
            expected[name] = weight
        else:
            writer.add_tensor(_gguf_name(name), quantize(stored, qtype), raw_dtype=qtype)
            # Quantization blocks run along a row, and the permutation moves whole rows, so the
            # import must give back exactly the quantize->dequantize round trip of the HF rows.
            expected[name] = dequantize(quantize(weight, qtype), qtype).reshape(weight.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def make_tiny_gguf(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, np.ndarray]]]:
    """`make_tiny_gguf(name="tiny.gguf", **options) -> (path, expected HF weights)`."""

    def make(name: str = "tiny.gguf", **options: object) -> tuple[Path, dict[str, np.ndarray]]:
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, write_tiny_gguf(path, **options)  # type: ignore[arg-type]

    return make


@pytest.fixture
def tiny() -> SimpleNamespace:
    """The tiny model's dimensions, vocabulary and the llama.cpp permutation, for assertions.

    Handed out as a fixture rather than imported, so the tests work under any pytest import mode.
    """
    return SimpleNamespace(
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        ffn=FFN,
        layers=LAYERS,
        context=CONTEXT,
        tokens=TOKENS,
        permute=llamacpp_permute,
    )
