"""Builds a tiny random-weight Llama folder in the Hugging Face layout, for fast tests.

Weights come from transformers' own `LlamaForCausalLM` (so the reference implementation and the
folder agree by construction); the tokenizer is a byte-level BPE trained here on a few lines.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A serving engine batches requests and streams tokens back to clients.",
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens.",
    "def add(a, b):\n    return a + b\n",
    "Prefix caching lets identical prompts share the same physical blocks.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
] * 20


def build_tokenizer(out: Path, vocab_size: int = 384) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 512,
            }
        )
    )
    return tok.get_vocab_size()


def build_tiny_model(
    out: Path, *, seed: int = 0, tie: bool = True, layers: int = 2, head_dim: int = 16
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out
