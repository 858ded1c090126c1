"""What an answer's text holds, through the real server and the openai client: the stop token's
text with include_stop_str_in_output (as vLLM), and completions' logprobs.text_offset, where
each token's text starts in the choice's text, the same streamed or not."""

from __future__ import annotations

import pytest

FOX = "The quick brown fox"
EMOJI = "Fox 🦊 and 🦊🦊 fox"  # the tiny BPE never saw emoji: each is 4 byte tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from servelm.text.tokenizer import TextTokenizer

    return TextTokenizer(tiny_model_dir)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_with_include_stop_str_in_output(client, tokenizer, include):
    # the answer's first token is " blocks" (its logit raised far above the rest), a stop token
    (blocks,) = tokenizer.encode(" blocks", add_special_tokens=False)
    extra = {"stop_token_ids": [blocks], "include_stop_str_in_output": include}
    kw = dict(model="tiny", max_tokens=8, temperature=0, logit_bias={str(blocks): 100})
    r = client.completions.create(prompt="fixed-size", extra_body=extra, **kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == (" blocks" if include else "")
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], extra_body=extra, **kw
    )
    assert chat.choices[0].message.content == (" blocks" if include else "")


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token's text starts at its offset; a token that holds part of a character (its
    own decode U+FFFD) is at that character; none past the text's end nor going back."""
    assert len(offsets) == len(tokens)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), offsets
    for token, at in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token:
            assert text[at:].startswith(token), (token, at, text)


def test_text_offset_streamed_with_a_stop_string_is_as_a_whole_answer(client):
    # Text held back while it may still begin a stop string (its last 3 characters here) does
    # not hold the offsets back. (Words, so that random weights make no invalid UTF-8.)
    kw = dict(model="tiny", prompt=FOX, max_tokens=12, temperature=0, logprobs=1, stop=["xyz!"])
    extra = {"ignore_eos": True, "guided_regex": "( [a-z]+)+"}
    whole = client.completions.create(**kw, extra_body=extra).choices[0]
    assert len(whole.logprobs.tokens) == 12
    offsets = []
    for chunk in client.completions.create(stream=True, **kw, extra_body=extra):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
    _check_offsets(whole.text, whole.logprobs.tokens, whole.logprobs.text_offset)
    assert offsets == whole.logprobs.text_offset


def test_text_offset_of_split_characters(client, tokenizer):
    # the answer is the emoji text (a choice constrains it), each emoji 4 tokens of 1 byte
    kw = dict(model="tiny", max_tokens=30, temperature=0, logprobs=0)
    extra = {"guided_choice": [EMOJI]}
    r = client.completions.create(prompt=FOX, extra_body=extra, **kw).choices[0]
    assert r.text == EMOJI
    assert r.logprobs.tokens.count("\ufffd") == 12
    _check_offsets(r.text, r.logprobs.tokens, r.logprobs.text_offset)
    # each of a character's bytes is at the character
    at = [
        o for t, o in zip(r.logprobs.tokens, r.logprobs.text_offset, strict=True) if t == "\ufffd"
    ]
    assert at == [EMOJI.index("🦊")] * 4 + [EMOJI.index("🦊🦊")] * 4 + [EMOJI.index("🦊🦊") + 1] * 4
    streamed = []
    for chunk in client.completions.create(prompt=FOX, stream=True, extra_body=extra, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.text_offset
    assert streamed == r.logprobs.text_offset

    # echoed, the prompt's emoji too: the prompt's offsets, then the answer's after them
    prompt = EMOJI + " then"
    e = client.completions.create(prompt=prompt, echo=True, extra_body=extra, **kw).choices[0]
    assert e.text == prompt + EMOJI
    n = len(tokenizer.encode(prompt))
    _check_offsets(e.text, e.logprobs.tokens, e.logprobs.text_offset)
    assert e.logprobs.text_offset[n] == len(prompt)
    # the same echoed from token ids (the prompt's text is then their decode)
    ids = tokenizer.encode(prompt)
    t = client.completions.create(prompt=ids, echo=True, extra_body=extra, **kw).choices[0]
    assert t.text == e.text and t.logprobs.text_offset == e.logprobs.text_offset


def test_completion_top_logprobs_hold_the_sampled_token(client):
    # as vLLM's: the k most likely and the sampled token; `logprobs: 0` gives the sampled alone
    # (it gave `{}` for every token)
    kw = dict(model="tiny", prompt=FOX, max_tokens=6, temperature=1.0, seed=3)
    zero = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert zero.top_logprobs == [
        {t: v} for t, v in zip(zero.tokens, zero.token_logprobs, strict=True)
    ]
    two = client.completions.create(logprobs=2, **kw).choices[0].logprobs
    assert two.tokens == zero.tokens
    for tok, top in zip(two.tokens, two.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and tok in top
