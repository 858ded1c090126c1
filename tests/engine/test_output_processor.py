"""OutputProcessor: token ids in, text deltas out; stop strings end requests and never leak."""

from __future__ import annotations

import pytest

from servelm.engine.output_processor import OutputProcessor, TextDelta
from servelm.engine.outputs import EngineCoreOutput, Logprobs
from servelm.engine.sampling_params import SamplingParams
from servelm.text.tokenizer import TextTokenizer

FOX = "The quick brown fox jumps over the lazy dog."
HELLO = "Hello world! How are you today? 🦊 fine"
CODE = "def add(a, b):\n    return a + b\n"
EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir)


def feed(
    tok, ids, params, *, finish=None, stop_token_id=None, rid="r", prompt=()
) -> list[TextDelta]:
    """One EngineCoreOutput per token, as the engine sends them; `finish` comes with the last.

    Returns the deltas up to the finishing one, and checks that the processor ignores whatever
    the engine still sends after that (it keeps running until the caller's abort lands).
    """
    proc = OutputProcessor(tok)
    proc.add_request(rid, params, prompt)
    deltas: list[TextDelta] = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        out = EngineCoreOutput(
            rid, [t], finish if last else None, stop_token_id if last else None, num_prompt_tokens=7
        )
        delta = proc.process(out)
        if deltas and deltas[-1].finished:
            assert delta is None
            continue
        assert delta is not None and delta.request_id == rid and delta.num_prompt_tokens == 7
        deltas.append(delta)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert rid not in proc.states
    return deltas


def streamed(deltas: list[TextDelta]) -> str:
    """The text a client saw; also checks that no delta ever sent text the final text lacks."""
    seen = ""
    for d in deltas:
        seen += d.text
    for k in range(len(deltas)):
        assert seen.startswith("".join(d.text for d in deltas[: k + 1]))
    return seen


def assert_partial_stop_held_back(tok, ids, deltas, stops: list[str]) -> None:
    """While the text so far ends with the start of a stop string, that start is not sent."""
    sent = ""
    for k, d in enumerate(deltas[:-1]):
        sent += d.text
        known = tok.decode(ids[: k + 1]).rstrip("\ufffd")
        for s in stops:
            for n in range(1, len(s)):
                if known.endswith(s[:n]):
                    assert len(sent) <= len(known) - n, (sent, known, s)


def reference(tok, ids, stops: list[str], include: bool) -> tuple[str, int]:
    """Final text and number of tokens consumed, by brute force over every token prefix."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n]).rstrip("\ufffd")
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            pos, s = min(hits)
            return text[: pos + len(s) if include else pos], n
    return tok.decode(ids), len(ids)


def test_no_stop_strings_stream_everything_and_length_passes_through(tok):
    ids = tok.encode(HELLO)
    deltas = feed(tok, ids, SamplingParams(max_tokens=len(ids)), finish="length")
    assert streamed(deltas) == tok.decode(ids) == HELLO
    assert deltas[-1].finish_reason == "length" and not deltas[-1].abort_engine
    assert [t for d in deltas for t in d.token_ids] == ids
    # Without stop strings nothing is held back: text flows as soon as a character is whole.
    assert [d.text for d in deltas[:3]] == ["He", "llo", " "]


@pytest.mark.parametrize(
    "stop", [["lazy"], ["zy do"], ["o"], ["The"], ["dog."], ["jumps", "brown"]]
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_request_without_leaking(tok, stop, include):
    ids = tok.encode(FOX)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=len(ids))
    deltas = feed(tok, ids, params, finish="length")
    assert_partial_stop_held_back(tok, ids, deltas, stop)
    want, used = reference(tok, ids, stop, include)
    final = deltas[-1]
    assert final.finish_reason == "stop"
    assert streamed(deltas) == want
    # The engine still runs the request unless the stop string came with its last token.
    assert final.abort_engine == (used < len(ids))
    assert [t for d in deltas for t in d.token_ids] == ids[:used]
    if not include:
        assert not any(s in want for s in stop)


def test_stop_string_is_held_back_until_it_cannot_match(tok):
    ids = tok.encode(FOX)
    deltas = feed(tok, ids, SamplingParams(stop=["fox!"], max_tokens=len(ids)), finish="length")
    assert streamed(deltas) == FOX and deltas[-1].finish_reason == "length"
    assert_partial_stop_held_back(tok, ids, deltas, ["fox!"])
    # Held-back text is released at the finish even though nothing more matched.
    assert deltas[-1].text.endswith("dog.")


def test_stop_string_inside_a_multibyte_character_sequence(tok):
    ids = tok.encode(HELLO)
    deltas = feed(tok, ids, SamplingParams(stop=["🦊"], max_tokens=len(ids)), finish="length")
    assert streamed(deltas) == "Hello world! How are you today? "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].abort_engine


def test_eos_token_text_is_not_part_of_the_output(tok):
    ids = tok.encode(CODE) + [EOS]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, stop=["\n\n"])
        deltas = feed(tok, ids, params, finish="stop", stop_token_id=EOS)
        assert streamed(deltas) == CODE
        assert deltas[-1].finish_reason == "stop" and not deltas[-1].abort_engine
        assert deltas[-1].token_ids == [EOS]


def test_abort_and_error_pass_through(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(stop=["x"]))
    proc.add_request("e", SamplingParams())
    first = proc.process(EngineCoreOutput("a", tok.encode("Hello")))
    assert first is not None and first.text == "Hello"
    aborted = proc.process(EngineCoreOutput("a", [], "abort"))
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.text == ""
    failed = proc.process(EngineCoreOutput("e", [], "error", error="boom"))
    assert failed is not None and failed.finish_reason == "error" and failed.error == "boom"
    assert proc.process(EngineCoreOutput("a", [5])) is None  # finished requests are forgotten
    assert proc.process(EngineCoreOutput("unknown", [5])) is None


def test_requests_are_independent(tok):
    proc = OutputProcessor(tok)
    proc.add_request("a", SamplingParams(stop=["fox"]))
    proc.add_request("b", SamplingParams())
    a_text = b_text = ""
    for t in tok.encode(FOX)[:8]:
        for rid in ("a", "b"):
            d = proc.process(EngineCoreOutput(rid, [t]))
            if d is None:
                continue
            if rid == "a":
                a_text += d.text
            else:
                b_text += d.text
    assert a_text == "The quick brown " and b_text == "The quick brown fox"


def test_several_tokens_in_one_output_are_cut_at_the_stop(tok):
    ids = tok.encode(FOX)  # ... ' the', ' l', 'az', 'y', ' do', 'g', '.'
    lps = [Logprobs(t, -0.5, 1, [(t, -0.5)]) for t in ids]
    proc = OutputProcessor(tok)
    proc.add_request("r", SamplingParams(stop=["lazy"], logprobs=0))
    delta = proc.process(EngineCoreOutput("r", ids, logprobs=lps))
    assert delta is not None and delta.finish_reason == "stop" and delta.abort_engine
    assert delta.text == "The quick brown fox jumps over the "
    used = ids.index(tok.encode("y")[0]) + 1
    assert delta.token_ids == ids[:used]
    assert delta.logprobs == lps[:used]


def test_stop_strings_wait_for_min_tokens(tok):
    # Like EOS and stop_token_ids, a stop string only ends a request after min_tokens tokens.
    ids = tok.encode(FOX)  # 'The', ' qu', 'ick', ' b', 'row', 'n', ' f', 'ox', ...
    params = SamplingParams(stop=["o"], min_tokens=6, max_tokens=len(ids))
    deltas = feed(tok, ids, params, finish="length")
    assert streamed(deltas) == "The quick brown f"
    assert deltas[-1].finish_reason == "stop"
    assert len([t for d in deltas for t in d.token_ids]) == 8


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_s_text_is_kept_with_include_stop_str_in_output(tok, include):
    # As vLLM: the token that ended the request (stop_token_ids, EOS) is in the text when
    # include_stop_str_in_output is set, and left out otherwise.
    ids = tok.encode(FOX)
    stop = ids[5]
    params = SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=include)
    deltas = feed(tok, ids[:6], params, finish="stop", stop_token_id=stop)
    assert streamed(deltas) == tok.decode(ids[: 6 if include else 5])
    assert deltas[-1].finish_reason == "stop" and not deltas[-1].abort_engine
    for skip in (True, False):  # EOS is a special token: its text only when those are kept
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=skip)
        deltas = feed(tok, ids[:5] + [EOS], params, finish="stop", stop_token_id=EOS)
        assert streamed(deltas) == tok.decode(ids[:5] + [EOS][: int(include)], skip)


def test_text_follows_the_prompt(tmp_path):
    # A SentencePiece answer's first word keeps its space after a prompt (Llama 2 / Mistral's
    # decoders drop a text's first space): the text is what decoding both together adds.
    from tests.text.sentencepiece_model import build_tokenizer

    build_tokenizer(tmp_path)
    sp = TextTokenizer(tmp_path)
    prompt = sp.encode("The capital of France")
    answer = sp.encode("The capital of France is Paris.")[len(prompt) :]  # ▁is ▁Paris.
    deltas = feed(sp, answer, SamplingParams(stop=["."]), finish="length", prompt=prompt)
    assert (
        streamed(deltas) == " is Paris" == sp.decode(prompt + answer)[len(sp.decode(prompt)) : -1]
    )
    assert streamed(feed(sp, answer, SamplingParams(), finish="length")) == "is Paris."
