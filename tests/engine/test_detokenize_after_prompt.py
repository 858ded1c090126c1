"""The offline API on SentencePiece models (Llama 2 and Mistral layouts): each answer's text is
what decoding its prompt and its tokens together adds to the prompt's text, the `tokenizers`
library's own decode as the reference, whatever tokens the random weights pick (byte tokens
among them)."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams

PROMPTS = [
    "The capital of France",
    "[INST] Hello world, how are you? [/INST]",
    "A serving engine streams 🍕",
]


@pytest.fixture(scope="module", params=["legacy", "metaspace"])
def llm(request, tmp_path_factory):
    from tests.text.sentencepiece_model import build_model

    folder = build_model(tmp_path_factory.mktemp(f"sp-{request.param}"), request.param)
    return LLM(str(folder), kv_cache_memory="8MiB", max_model_len=512)


def test_text_is_what_decoding_adds_to_the_prompt(llm):
    tok = llm.tokenizer
    params = SamplingParams(temperature=0.8, seed=3, n=4, max_tokens=24, ignore_eos=True)
    # random weights pick byte tokens (half the vocabulary) as often as pieces: also without
    byte_ids = [tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    words = SamplingParams(**{**vars(params), "logit_bias": dict.fromkeys(byte_ids, -100.0)})
    outputs = llm.generate(PROMPTS * 2, [params] * len(PROMPTS) + [words] * len(PROMPTS))
    first_spaces = 0
    for result in outputs:
        prompt = result.prompt_token_ids
        for out in result.outputs:
            whole, before = tok.decode(prompt + out.token_ids), tok.decode(prompt)
            if not whole.startswith(before):  # sampled bytes that make no UTF-8 (see tests/text)
                continue
            want, text = whole[len(before) :], out.text
            # Bytes at the very end that complete no character are held back; and a character
            # already handed out cannot be taken back when bytes that make no UTF-8 follow it
            # (decode then shows U+FFFD for it too).
            assert set(want[len(text) :]) <= {"\ufffd"}, (want, text)
            assert all(a == b or b == "\ufffd" for a, b in zip(text, want, strict=False))
            first_spaces += tok.tokenizer.id_to_token(out.token_ids[0]).startswith("\u2581")
    assert first_spaces  # some answers start with a word: the case the prompt decides


def test_forced_first_word_keeps_its_space(llm):
    tok = llm.tokenizer
    is_ = tok.tokenizer.token_to_id("\u2581is")
    params = SamplingParams(temperature=0, max_tokens=1, logit_bias={is_: 100})
    (result,) = llm.generate(["The capital of France"], params)
    assert result.outputs[0].token_ids == [is_] and result.outputs[0].text == " is"
