"""SentencePiece-style tokenizers (Llama 2, Mistral, Phi-3: "▁" for spaces, bytes for what is
not in the vocabulary, a decoder that drops the text's first space) and a tiny random Llama
folder around one, for tests of detokenizing.

Two layouts as Hugging Face converts them: `legacy` (Llama 2: a Prepend("▁") + Replace
normalizer, decoder Replace / ByteFallback / Fuse / Strip) and `metaspace` (Mistral, later
Llama conversions: a Metaspace pre-tokenizer and decoder with prepend_scheme "first").
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world, how are you? I am fine, thank you very much.",
    "A serving engine streams tokens back to its clients.",
] * 30
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
LAYOUTS = ("legacy", "metaspace")


def build_tokenizer(out: Path, layout: str = "legacy") -> int:
    """`tokenizer.json` and `tokenizer_config.json` in `out`; returns the vocabulary size.

    Pieces and merges are trained here; the 256 byte tokens `<0x00>`... are ordinary vocabulary
    entries, as in Llama 2's file, and `[INST]` / `[/INST]` special tokens, as in Mistral's."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "\u2581")
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(state["vocab"], key=state["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]

    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    if layout == "legacy":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [
                decoders.ByteFallback(),
                decoders.Metaspace(prepend_scheme="first", split=False),
            ]
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "tokenizer_class": "LlamaTokenizerFast",
                "model_max_length": 512,
                "chat_template": "{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
            }
        )
    )
    return tok.get_vocab_size()


def build_model(out: Path, layout: str = "legacy") -> Path:
    """A tiny random-weight Llama whose tokenizer is `build_tokenizer`'s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.model.family_harness import TINY

    vocab = build_tokenizer(out, layout)
    shape = {**TINY, "max_position_embeddings": 512}
    config = LlamaConfig(vocab_size=vocab, **shape, tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out
