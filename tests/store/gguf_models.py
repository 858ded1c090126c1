"""Tiny GGUF files of each architecture the importer reads, written the way llama.cpp's
converter writes them, from a transformers model made with the family's own config class.

    model, path = write_family_gguf(tmp_path, "qwen3", qtype=Q.Q4_K)

The GGUF side is written out here on purpose (tensor names, q/k permutation, Gemma's 1 + w
norms, metadata keys), independent of servelm's importer, so the import is checked against
llama.cpp's conventions rather than against itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.gguf_kquants import Q, quantize_k

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
PLAIN = ["h", "e", "l", "o", "w", "r", "d", "Ġ", "1", "2", "!"]
TOKENS = SPECIALS + PLAIN + ["".join(m.split(" ")) for m in MERGES]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)

# K-quant rows are blocks of 256: every matrix's inputs are a multiple of it.
DIMS = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    vocab_size=len(TOKENS),
)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=32,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=32, query_pre_attn_scalar=64)),
    "phi3": ("Phi3Config", dict(sliding_window=None, original_max_position_embeddings=512)),
}

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: llama.cpp keeps gate and up fused under ffn_up
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    table = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    return f"blk.{layer}.{table[module]}.{kind}"


def llamacpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random-weight transformers model of `arch` (CONFIGS), float32, weights sharp enough
    that greedy tokens rarely tie."""
    import transformers

    name, extra = CONFIGS[arch]
    config = getattr(transformers, name)(**{**DIMS, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":  # logits of a few units: sharp, rarely tied
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def all_of(qtype: Q) -> Callable[[str], Q]:
    """Every matrix `qtype`, vectors (norms, biases) F32, as llama.cpp's quantize leaves them."""
    return lambda name: qtype


def q4_k_m(name: str) -> Q:
    """A Q4_K_M file's mix: Q4_K, with v and down (llama.cpp: some layers' of them), the
    embedding and the head Q6_K."""
    if name.endswith(
        ("v_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")
    ):
        return Q.Q6_K
    return Q.Q4_K


def write_family_gguf(
    path: Path, model, arch: str, qtype_of: Callable[[str], Q] = all_of(Q.F32)
) -> Path:
    """Write `model` (tiny_hf_model) as llama.cpp's converter (and quantize) would."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type; GGUF has the global's
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, weight in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            weight = llamacpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weight = llamacpp_permute(weight, config.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)  # llama.cpp's norm multiplies by w: 1 + w
        qtype = qtype_of(name) if weight.ndim == 2 else Q.F32
        target = gguf_name(name, arch)
        if qtype == Q.F32:
            writer.add_tensor(target, np.ascontiguousarray(weight))
        elif qtype == Q.F16:
            writer.add_tensor(target, weight.astype(np.float16))
        elif qtype == Q.IQ4_NL:  # a type servelm does not read: zero blocks of its size
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            zeros = np.zeros((weight.shape[0], weight.shape[1] // block * nbytes), np.uint8)
            writer.add_tensor(target, zeros, raw_dtype=qtype)
        else:
            writer.add_tensor(target, quantize_k(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
