"""The API process's reading and check of a request's structured output (server/structured.py),
before admission: compiled against the model's own vocabulary, as the engine compiles it, so
that what the engine would refuse is a 400 naming the field rather than a failed request."""

from __future__ import annotations

import asyncio

import pytest

from servelm.engine.sampling_params import StructuredOutput
from servelm.server.errors import APIError
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.structured import checked_structure, requested_structure
from servelm.structured.compiler import GrammarCompiler
from servelm.text.tokenizer import TextTokenizer

ASK = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "field, value",
    [
        ("guided_grammar", 'start: "a" <|no_such_token|>'),  # a special token it lacks
        ("guided_grammar", 'start: "a" <[99999999]>'),  # a token id past it
        ("structured_outputs", {"grammar": 'start: "a" <|no_such_token|>'}),
    ],
)
def test_a_grammar_naming_what_the_vocabulary_lacks_is_a_400_naming_the_field(
    tiny_model_dir, field, value
):
    tok = TextTokenizer(tiny_model_dir)
    req = ChatCompletionRequest(messages=ASK, **{field: value})
    with pytest.raises(APIError) as info:
        asyncio.run(checked_structure(req, tok))
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message.startswith(f"{field}: invalid grammar: ")
    # the engine would have refused it: the check and the engine agree
    spec, _ = requested_structure(req)
    compiler = GrammarCompiler(tiny_model_dir / "tokenizer.json", tok.vocab_size)
    with pytest.raises(ValueError):
        compiler.submit(spec, frozenset(tok.eos_token_ids)).result(30)


def test_a_grammar_naming_tokens_the_vocabulary_has_passes(tiny_model_dir):
    tok = TextTokenizer(tiny_model_dir)
    grammar = 'start: "a" <|im_end|> | "b" <[5]>'
    req = ChatCompletionRequest(messages=ASK, guided_grammar=grammar)
    assert asyncio.run(checked_structure(req, tok)) == StructuredOutput("grammar", grammar)
    compiler = GrammarCompiler(tiny_model_dir / "tokenizer.json", tok.vocab_size)
    assert compiler.submit(StructuredOutput("grammar", grammar), frozenset({2})).result(30)


@pytest.mark.parametrize("disable_fallback", [True, False, None])
def test_structured_outputs_disable_fallback_is_taken(disable_fallback):
    # vLLM's: refuse rather than fall back to another backend; servelm has one backend, so the
    # answer is the same either way
    body = {"regex": "[ab]+", "disable_fallback": disable_fallback}
    req = ChatCompletionRequest(messages=ASK, structured_outputs=body)
    assert requested_structure(req) == (StructuredOutput("regex", "[ab]+"), "structured_outputs")
    req = ChatCompletionRequest(messages=ASK, structured_outputs={**body, "disable_fallback": 1})
    with pytest.raises(APIError, match="disable_fallback must be true or false"):
        requested_structure(req)
