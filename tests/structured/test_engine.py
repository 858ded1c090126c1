"""Structured outputs through the engine (the offline LLM, tiny random-weight model): every
constrained answer conforms, each choice has its own matcher, preemption does not advance a
matcher twice, and unconstrained requests beside constrained ones are untouched."""

from __future__ import annotations

import json
import re

import pytest

from servelm import LLM, SamplingParams
from servelm.engine.sampling_params import StructuredOutput

PROMPTS = [f"Numbers: {i} {i + 1} and the quick brown fox" * (1 + i % 3) for i in range(8)]
REGEX = r"[a-d]{2,5}(-[0-9]{1,3})?"
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["fox", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "tag", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")


def constrained(kind: str, value: str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    return SamplingParams(structured_output=StructuredOutput(kind, value), **kw)


def conforms(kind: str, value: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in json.loads(value)
    obj = json.loads(text)
    return obj.keys() == {"n", "tag", "ok"} and obj["tag"] in ("fox", "dog")


@pytest.mark.parametrize(
    "kind, value",
    [("regex", REGEX), ("choice", '["fox", "lazy dog", "brown"]'), ("json", json.dumps(SCHEMA))],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_conforms_and_stops(llm, kind, value, temperature):
    params = constrained(kind, value, temperature=temperature, seed=7, n=2)
    for result in llm.generate(PROMPTS, params):
        for out in result.outputs:
            assert out.finish_reason == "stop", out
            assert conforms(kind, value, out.text), out.text
    assert not llm.engine.structured.compiling


def test_length_cut_is_length(llm):
    (result,) = llm.generate(PROMPTS[0], constrained("regex", "[a-z]{40}", max_tokens=3))
    assert result.outputs[0].finish_reason == "length"
    assert len(result.outputs[0].token_ids) == 3


def test_unconstrained_rows_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    mixed_prompts = [p for pair in zip(PROMPTS, PROMPTS, strict=True) for p in pair]
    mixed_params = [
        plain if i % 2 == 0 else constrained("regex", REGEX, temperature=1.0)
        for i in range(len(mixed_prompts))
    ]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [r.outputs[0].token_ids for r in mixed[::2]] == [r.outputs[0].token_ids for r in alone]
    for r in mixed[1::2]:
        assert conforms("regex", REGEX, r.outputs[0].text)


def test_preemption_does_not_advance_a_matcher_twice(tiny_model_dir):
    # 24 blocks cannot hold 8 requests of ~100 tokens each: requests are preempted and
    # recomputed mid-answer, and their matchers must stay where their output is.
    blocks, per_block = 24, 2 * 2 * 2 * 16 * 4 * 16
    small = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=blocks * per_block)
    big = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    item = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = json.dumps({"type": "array", "items": item, "minItems": 16, "maxItems": 16})
    params = constrained("json", schema, temperature=0, max_tokens=120)
    prompts = [p * 2 for p in PROMPTS]
    got = small.generate(prompts, params)
    assert small.totals.num_preemptions > 0
    want = big.generate(prompts, params)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
    for r in got:
        assert r.outputs[0].finish_reason == "stop"
        assert len(json.loads(r.outputs[0].text)) == 16
    small.engine.check_integrity()
    assert not small.engine.structured.live or all(
        r.grammar is None for r in small.engine.structured.live.values()
    )


def test_a_grammar_the_engine_cannot_compile_ends_the_request_with_its_reason(llm):
    # the engine ends the request with an error; the offline API raises it (it returned an
    # empty text with finish_reason "error", the reason lost)
    with pytest.raises(ValueError, match="unclosed character class"):
        llm.generate(PROMPTS[0], constrained("regex", "[a-"))
    (result,) = llm.generate(PROMPTS[0], constrained("regex", "[a-c]+", max_tokens=4))
    assert result.outputs[0].text and set(result.outputs[0].text) <= set("abc")


def test_aborts_free_matchers_while_compiling_and_while_running(llm):
    from servelm.engine.request import Request

    core = llm.engine
    ids = llm.tokenizer.encode(PROMPTS[0])

    def add(rid: str, value: str) -> Request:
        request = Request(rid, ids, constrained("regex", value, max_tokens=200), frozenset({2}))
        core.add_request(request)
        return request

    waiting = add("waiting", "[ab]{150}")  # a text never compiled before: still compiling
    (out,) = core.abort_requests(["waiting"])
    assert out.finish_reason == "abort" and not core.structured.compiling
    running = add("running", "[ab]{100}")
    while running.num_output_tokens < 3:
        core.step()
    assert running.grammar is not None
    (out,) = core.abort_requests(["running"])
    assert out.finish_reason == "abort" and running.grammar is None
    plain = Request("plain", ids, SamplingParams(max_tokens=2), frozenset({2}))
    core.add_request(plain)
    while core.has_unfinished_requests():
        core.step()
    assert waiting.grammar is None and not core.structured.live


@pytest.mark.parametrize("kind", ["number", "integer"])
def test_a_number_cannot_run_on_until_max_tokens(llm, tiny_model_dir, kind):
    # A model that favours a digit writes it wherever the grammar allows one: a schema's
    # numbers hold 16 digits before the point and 10 after it at most (structured/grammar.py).
    from servelm.text.tokenizer import TextTokenizer

    tok = TextTokenizer(tiny_model_dir)
    ones = [t for t in range(tok.vocab_size) if tok.decode([t]) in ("1", " 1")]
    schema = {
        "type": "object",
        "properties": {"x": {"type": kind}},
        "required": ["x"],
        "additionalProperties": False,
    }
    params = constrained("json", json.dumps(schema), temperature=0, max_tokens=200)
    params.logit_bias = dict.fromkeys(ones, 100.0)
    (result,) = llm.generate(PROMPTS[0], params)
    out = result.outputs[0]
    assert out.finish_reason == "stop", out.text
    assert out.text.startswith('{"x": 1111111111111111')
    assert len(json.loads(out.text)) == 1 and len(out.text) <= len(
        '{"x": 0000000000000000.0000000000}'
    )
