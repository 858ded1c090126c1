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


# -- after a prompt: the text an answer adds to its prompt's, as decoding both together gives it


def _pieces(tok: TextTokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    stream = tok.decode_stream(skip, prompt)
    return [stream.step(i) for i in ids]


def _reference(tok: TextTokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    """The `tokenizers` library's own answer: decode(prompt + ids) less decode(prompt)."""
    whole, before = tok.decode(prompt + ids, skip), tok.decode(prompt, skip)
    assert whole.startswith(before)
    return whole[len(before) :]


def _check_after(tok: TextTokenizer, prompt: list[int], ids: list[int], skip=True) -> None:
    streamed = "".join(_pieces(tok, prompt, ids, skip))
    # (a prompt that ends in part of a character: the answer's text starts with all of it)
    whole, before = tok.decode(prompt + ids, skip), tok.decode(prompt, skip).rstrip("\ufffd")
    if not whole.startswith(before):
        # ByteFallback decodes a run of byte tokens as a whole, and bytes that make no UTF-8
        # turn all of it into U+FFFD, the prompt's characters too: no answer to compare with
        # (random ids); the stream only has to carry on.
        assert "\ufffd" in whole
        return
    whole = whole[len(before) :]
    # Only bytes at the very end that do not complete a character are still held back; and a
    # stream cannot take back a character it gave that such bytes later turn into U+FFFD.
    assert len(streamed) <= len(whole), (streamed, whole)
    assert all(a == b or b == "\ufffd" for a, b in zip(streamed, whole, strict=False)), (
        streamed,
        whole,
    )
    assert set(whole[len(streamed) :]) <= {"\ufffd"}, (streamed, whole)


@pytest.fixture(scope="module", params=["legacy", "metaspace"])
def sp_tok(request, tmp_path_factory) -> TextTokenizer:
    from tests.text.sentencepiece_model import build_tokenizer

    folder = tmp_path_factory.mktemp(f"sp-{request.param}")
    build_tokenizer(folder, request.param)
    return TextTokenizer(folder)


def test_sentencepiece_answer_keeps_its_first_space(sp_tok):
    # Llama 2 / Mistral decoders drop the first space of a text, not of an answer's first word
    prompt = sp_tok.encode("The capital of France")
    is_ = sp_tok.tokenizer.token_to_id("\u2581is")
    assert (
        sp_tok.decode_stream(True, prompt).step(is_) == " is" == _reference(sp_tok, prompt, [is_])
    )
    # with no prompt, or one whose text is empty (BOS skipped), it starts a text, as in decode
    assert sp_tok.decode_stream(True).step(is_) == "is"
    assert sp_tok.decode_stream(True, [1]).step(is_) == "is" == _reference(sp_tok, [1], [is_])


def test_sentencepiece_stream_after_prompt_equals_decode(sp_tok):
    is_ = sp_tok.tokenizer.token_to_id("\u2581is")
    answer = [is_, *sp_tok.encode("Paris 🍕, thank you", add_special_tokens=False)]
    inst_end = sp_tok.tokenizer.token_to_id("[/INST]")
    prompts = [
        sp_tok.encode("The capital of France"),
        sp_tok.encode("[INST] Hello world, how are you? [/INST]"),  # ends with a special token
        sp_tok.encode("Hello") + [inst_end] * 6,  # more of them than the priming starts with
        sp_tok.encode("🍕🍕 thank"),  # byte tokens in the priming window
        sp_tok.encode("The capital of France is Paris. " * 8),  # longer than the window
        [1],
    ]
    for prompt in prompts:
        for skip in (True, False):
            _check_after(sp_tok, prompt, answer, skip)
            assert all("\ufffd" not in p for p in _pieces(sp_tok, prompt, answer, skip))
    g = random.Random(0)
    for _ in range(100):
        prompt = sp_tok.encode(g.choice(TEXTS[:4]))
        ids = [g.randrange(0, sp_tok.vocab_size) for _ in range(g.randrange(1, 12))]
        _check_after(sp_tok, prompt, ids)


def test_byte_level_stream_after_prompt_equals_decode(tiny_tok):
    for text in TEXTS:
        ids = tiny_tok.encode(text, add_special_tokens=False)
        for cut in {1, len(ids) // 2, len(ids) - 1}:
            _check_after(tiny_tok, ids[:cut], ids[cut:])
    g = random.Random(1)
    for _ in range(100):
        prompt = tiny_tok.encode(g.choice(TEXTS), add_special_tokens=False)
        ids = [g.randrange(3, tiny_tok.vocab_size) for _ in range(g.randrange(1, 12))]
        _check_after(tiny_tok, prompt, ids)


def _check_split_character(tok: TextTokenizer) -> None:
    ids = tok.encode("hi 🦊 there", add_special_tokens=False)
    first = next(k for k, i in enumerate(ids) if tok.decode([i]) == "\ufffd")
    prompt, answer = ids[: first + 2], ids[first + 2 :]  # two of the fox's four bytes in each
    pieces = _pieces(tok, prompt, answer)
    assert "".join(pieces) == "🦊 there" and all("\ufffd" not in p for p in pieces)


def test_a_character_split_between_prompt_and_answer_comes_out_whole(tiny_tok, sp_tok):
    _check_split_character(tiny_tok)
    _check_split_character(sp_tok)


def test_bytes_that_make_no_utf8_do_not_stop_a_sentencepiece_stream(sp_tok):
    # ByteFallback decodes a run of byte tokens as a whole: "j" then bytes that make no UTF-8
    # turn the "j" into U+FFFD as well, which `tokenizers`' DecodeStream cannot take back (it
    # raised "Invalid prefix"). The stream goes on, the bytes after the "j" as decode has them.
    byte = {b: sp_tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0x6A, 0xFD, 0x42, 0x8B)}
    ids = [byte[0x6A], byte[0xFD], byte[0x42], byte[0x8B], byte[0x42]]
    ids.append(sp_tok.tokenizer.token_to_id("\u2581capital"))
    prompt = sp_tok.encode("The")
    whole = _reference(sp_tok, prompt, ids)
    assert whole == "\ufffd" * 5 + " capital"
    assert _pieces(sp_tok, prompt, ids) == ["j", "", "", "", "", "\ufffd" * 4 + " capital"]
