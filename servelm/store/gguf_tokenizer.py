"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from GGUF tokenizer metadata.

Input is the GGUF key/value metadata already decoded into plain Python (see
`gguf_import.read_metadata`). Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`:
SmolLM, Llama 3, Qwen 2/3) are built here, with the pre-tokenizers below; SentencePiece ones
(`"llama"`: Gemma, Phi-3, Mistral) by transformers' own GGUF tokenizer converter (transformers
is needed for those only).
An unknown pre-tokenizer is an error rather than a silent guess, because a wrong pre-tokenizer
still "works" but splits text differently from the model's training and quietly degrades it.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

# llama.cpp's token_type values (gguf.TokenType): CONTROL tokens are the chat/special markers,
# USER_DEFINED tokens are added to the vocabulary but are ordinary text.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


# The split regexes of the byte-level vocabularies the families use (llama.cpp's
# `tokenizer.ggml.pre` names; the same as the models' own tokenizer.json): Llama 3 keeps up to
# three digits together, Qwen 2 splits every digit.
_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SPLITS["llama3"] = _SPLITS["llama-v3"] = _SPLITS["llama-bpe"]
_SPLITS["deepseek-r1-qwen"] = _SPLITS["qwen2"]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    # GPT-2's regex is what ByteLevel(use_regex=True) applies. SmolLM ("smollm") was trained with
    # every digit split apart first, which is why its merges hold no multi-digit tokens.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "gpt2", "default"):
        return byte_level
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
        f"supported: {', '.join(sorted(['smollm', 'gpt-2', 'default', *_SPLITS]))}"
    )


def _special_ids(meta: dict[str, Any]) -> set[int]:
    """CONTROL tokens plus whatever bos/eos/unk/pad point at (those must never be split)."""
    types = meta.get("tokenizer.ggml.token_type") or []
    ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            ids.add(int(token_id))
    return ids


def _transformers_converter():
    """transformers' GGUF tokenizer converter (its module moved in transformers 5)."""
    try:
        from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
    except ImportError:
        try:
            from transformers.integrations import ggml as mapping
        except ImportError as exc:
            raise ValueError(
                "a SentencePiece GGUF tokenizer (tokenizer.ggml.model 'llama') is rebuilt by "
                "transformers' GGUF converter: pip install 'transformers>=4.45'"
            ) from exc
    return mapping


def _transformers_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer transformers builds from the same metadata (`GGUF_TOKENIZER_MAPPING` names
    the keys it reads)."""
    mapping = _transformers_converter()
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    arch = meta.get("general.architecture", "llama")
    tokenizer, _ = mapping.convert_gguf_tokenizer(arch, tokenizer_dict)
    return tokenizer


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's tokenizer."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece
        return _transformers_tokenizer(meta)
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); supported: "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens)

    # Added tokens are matched before BPE runs, so "<|im_start|>" stays one id. Adding them in id
    # order keeps the added_tokens list readable; their ids already exist in the vocabulary.
    types = meta.get("tokenizer.ggml.token_type") or []
    special = _special_ids(meta)
    user_defined = {i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED} - special
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined)]
    )
    return tokenizer


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    specials: list[tuple[str, int]] = []
    single = "$A"
    if add_bos:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        specials.append((tokens[bos_id], bos_id))
        single = f"{tokens[bos_id]} {single}"
    if add_eos:
        eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        specials.append((tokens[eos_id], eos_id))
        single = f"{single} {tokens[eos_id]}"
    return processors.TemplateProcessing(single=single, special_tokens=specials)


def tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` a Hugging Face loader expects next to `tokenizer.json`."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(
            meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        ),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
