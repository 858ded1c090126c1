"""Incremental detokenization: the streamed pieces add up to decoding everything at once."""

from __future__ import annotations

import random

import pytest

from servelm.text.tokenizer import TextTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fox 🦊 and family 👨‍👩‍👧 say hi 👋🏽!",  # 4-byte chars, ZWJ sequence, skin-tone modifier
    "你好，世界。日本語のテキストも。",  # CJK: 3 bytes per char
    "Café naïve résumé Ångström — “quotes” …",  # 2- and 3-byte accents and punctuation
    "def add(a, b):\n    return a + b  # 加法\n\tprint(f'{a!r}')\n",
    "   leading spaces, then\n\n  a blank line",
    " ",
]


def _streamed(tok: TextTokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    stream = tok.decode_stream(skip_special_tokens)
    return [stream.step(i) for i in ids]


def _check_stream(tok: TextTokenizer, text: str) -> list[str]:
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _streamed(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces), pieces  # never half a character
    return pieces


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def default_tok(default_model_dir) -> TextTokenizer:
    return TextTokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_stream_equals_decode(tiny_tok, text):
    _check_stream(tiny_tok, text)


def test_tiny_multibyte_char_waits_for_its_last_byte(tiny_tok):
    # The tiny BPE never saw emoji: one 4-byte character is 4 byte tokens, and the first three
    # produce no text.
    ids = tiny_tok.encode("🦊", add_special_tokens=False)
    assert len(ids) == 4
    assert _streamed(tiny_tok, ids) == ["", "", "", "🦊"]


def test_tiny_special_tokens_skipped_or_kept(tiny_tok):
    ids = tiny_tok.encode("<|im_start|>assistant\nhi 🦊<|im_end|>", add_special_tokens=False)
    assert "".join(_streamed(tiny_tok, ids)) == tiny_tok.decode(ids) == "assistant\nhi 🦊"
    kept = "".join(_streamed(tiny_tok, ids, skip_special_tokens=False))
    assert (
        kept
        == tiny_tok.decode(ids, skip_special_tokens=False)
        == "<|im_start|>assistant\nhi 🦊<|im_end|>"
    )


def test_tiny_random_ids_only_hold_back_an_unfinished_tail(tiny_tok):
    # Sampled ids need not form valid UTF-8. Invalid bytes mid-stream come out as U+FFFD like
    # `decode` does; only bytes that might still begin a character at the very end stay held.
    g = random.Random(0)
    for _ in range(50):
        ids = [g.randrange(3, tiny_tok.vocab_size) for _ in range(g.randrange(1, 30))]
        streamed, whole = "".join(_streamed(tiny_tok, ids)), tiny_tok.decode(ids)
        assert whole.startswith(streamed), (streamed, whole)
        assert set(whole[len(streamed) :]) <= {"\ufffd"}, (streamed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_default_stream_equals_decode(default_tok, text):
    _check_stream(default_tok, text)


@pytest.mark.slow
def test_default_encode_matches_transformers(default_model_dir, default_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        assert default_tok.encode(text) == hf.encode(text), text
        assert default_tok.encode(text, False) == hf.encode(text, add_special_tokens=False), text
        ids = default_tok.encode(text)
        assert default_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def _sentencepiece_with_byte_fallback(folder) -> TextTokenizer:
    """A Llama-2-style tokenizer: ▁ for spaces, any character outside the vocabulary as its
    UTF-8 bytes' own tokens (<0xF0> ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("<unk>", "\u2581", "H", "i", "e", "\u2581H", "\u2581Hi"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "H"), ("\u2581H", "i")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.save(str(folder / "tokenizer.json"))
    return TextTokenizer(folder)


def test_each_tokens_bytes_join_into_the_text(tiny_tok, tmp_path):
    # OpenAI's logprob `bytes`: a token that holds part of a character has that part's bytes,
    # where decoding it alone gives U+FFFD; joined, they are the text again.
    for text in TEXTS:
        ids = tiny_tok.encode(text, add_special_tokens=False)
        assert b"".join(tiny_tok.token_bytes(i) for i in ids) == text.encode()
    split = [i for i in tiny_tok.encode(TEXTS[1], False) if tiny_tok.decode([i]) == "\ufffd"]
    assert split  # the emoji are split into tokens of part of a character
    (im_end,) = tiny_tok.encode("<|im_end|>", False)  # a special token: its own text
    assert tiny_tok.token_bytes(im_end) == b"<|im_end|>"

    sp = _sentencepiece_with_byte_fallback(tmp_path)
    ids = sp.encode("Hi 🌍 Hie", add_special_tokens=False)
    assert sp.decode([ids[2]]) == "\ufffd"  # <0xF0>, the emoji's first byte
    # (SentencePiece's ▁ before the first word is a space of the first token's)
    assert b"".join(sp.token_bytes(i) for i in ids) == " Hi 🌍 Hie".encode()
