"""Grammars from structured-output specs: what compiles, what does not (and says why), and the
masks and matchers the engine builds from them, on the tiny model's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams, StructuredOutput
from servelm.structured.compiler import GrammarCompiler
from servelm.structured.grammar import compile_error
from servelm.structured.matcher import GrammarMatcher
from servelm.text.tokenizer import TextTokenizer

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json", json.dumps(SCHEMA)),
        StructuredOutput("json", '{"type": "object"}'),
        StructuredOutput("regex", r"[a-c]{2,4}-\d+"),
        StructuredOutput("choice", '["yes", "no"]'),
        StructuredOutput("grammar", 'start: "x" ("," "x")*'),
        StructuredOutput("grammar", 'root ::= "a" | "b" digit\ndigit ::= [0-9]'),  # GBNF
    ],
)
def test_valid_specs_compile(spec):
    assert compile_error(spec) is None


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutput("json", "{not json"), "not valid JSON"),
        (StructuredOutput("json", '{"type": "nonsense"}'), "nonsense"),
        (StructuredOutput("regex", "[a-"), ""),
        (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
        (StructuredOutput("choice", "[]"), "non-empty"),
    ],
)
def test_invalid_specs_say_why(spec, words):
    error = compile_error(spec)
    assert error and words in error


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    return GrammarCompiler(tiny_model_dir / "tokenizer.json", vocab_size=400)


def allowed(matcher: GrammarMatcher, vocab: int = 400) -> set[int]:
    bits = np.empty((1, (vocab + 31) // 32), dtype=np.int32)
    matcher.fill(bits, 0)
    flags = (bits[0, :, None] >> np.arange(32)) & 1
    return set(np.flatnonzero(flags.reshape(-1)[:vocab]).tolist())


def test_matcher_follows_tokens_to_the_end(compiler, tiny_model_dir):
    tok = TextTokenizer(tiny_model_dir)
    eos = frozenset(tok.eos_token_ids)
    template = compiler.submit(StructuredOutput("choice", '["fox", "dog"]'), eos).result(30)
    matcher = GrammarMatcher(template.deep_copy())
    first = allowed(matcher)
    assert first and max(first) < tok.vocab_size  # padding past the tokenizer never allowed
    assert not first & eos  # nothing chosen yet: the end is not allowed
    ids = tok.encode("fox", add_special_tokens=False)
    for t in ids[:-1]:
        assert t in allowed(matcher)
        assert not matcher.accept(t)
    assert matcher.accept(ids[-1])  # complete: nothing but the end may follow
    assert allowed(matcher) == set(eos)
    assert matcher.error is None


def test_compiles_are_cached_by_text(compiler):
    spec = StructuredOutput("regex", "[ab]+")
    assert compiler.submit(spec, frozenset({2})) is compiler.submit(spec, frozenset({2}))
    assert compiler.submit(StructuredOutput("regex", "[ab]+"), frozenset({2})).result(30)


def test_a_grammar_that_fails_in_the_engine_fails_its_future(compiler):
    future = compiler.submit(StructuredOutput("regex", "[a-"), frozenset({2}))
    with pytest.raises(ValueError):
        future.result(30)


def test_sampling_params_refuse_an_unknown_kind():
    from servelm.engine.sampling_params import InvalidParamError

    with pytest.raises(InvalidParamError) as info:
        SamplingParams(structured_output=StructuredOutput("yaml", "a: 1"))
    assert info.value.param == "structured_output"
    Request("r", [1], SamplingParams(structured_output=StructuredOutput("regex", "a")))


def test_the_grammar_engine_is_imported_only_when_a_request_asks():
    code = (
        "import sys, servelm.server.app, servelm.worker.executor\n"
        "print('llguidance' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unbounded_integers_get_json_safe_bounds():
    # A small model writing a number greedily can repeat a digit until max_tokens: 16 at most.
    from servelm.structured.grammar import SAFE_INTEGER as SAFE
    from servelm.structured.grammar import bound_numbers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer", "minimum": 0},
            "c": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 5}},
        },
    }
    out = bound_numbers(schema)
    assert out["properties"]["a"] == {"type": "integer", "minimum": -SAFE, "maximum": SAFE}
    assert out["properties"]["b"] == {"type": "integer", "minimum": 0, "maximum": SAFE}
    assert out["properties"]["c"]["items"] == {
        "type": "integer",
        "exclusiveMaximum": 5,
        "minimum": -SAFE,
    }
    assert schema["properties"]["a"] == {"type": "integer"}  # the caller's schema unchanged
    assert compile_error(StructuredOutput("json", json.dumps(schema))) is None


def test_integer_bounds_leave_values_and_far_bounds_alone():
    from servelm.structured.grammar import SAFE_INTEGER as SAFE
    from servelm.structured.grammar import bound_numbers

    literal = {"type": "integer", "x": 1}
    schema = {
        "type": "object",
        "properties": {
            "const": {"const": literal},  # a value that looks like a schema: kept as it is
            "enum": {"enum": [literal, {"type": "integer"}]},
            "ns": {"type": "integer", "minimum": 1_600_000_000_000_000_000},  # nanoseconds
            "low": {"type": "integer", "maximum": -(10**16)},
            "maybe": {"type": ["integer", "null"]},
        },
    }
    out = bound_numbers(schema)["properties"]
    assert out["const"] == {"const": literal} and out["enum"] == schema["properties"]["enum"]
    assert out["ns"] == {
        "type": "integer",
        "minimum": 1_600_000_000_000_000_000,
        "maximum": 9 * 10**18,
    }
    assert out["low"] == {"type": "integer", "maximum": -(10**16), "minimum": -9 * 10**18}
    assert out["maybe"] == {"type": ["integer", "null"], "minimum": -SAFE, "maximum": SAFE}
    assert compile_error(StructuredOutput("json", json.dumps(schema))) is None


def test_refs_rebased_under_where_a_schema_is_placed():
    from servelm.structured.grammar import rebase_refs

    params = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}, "kids": {"items": {"$ref": "#"}}},
        "$defs": {"Unit": {"enum": ["c", "f"]}},
        "default": {"$ref": "#/not/a/schema"},
    }
    out = rebase_refs(params, "#/$defs/tool_0")
    assert out["properties"]["unit"] == {"$ref": "#/$defs/tool_0/$defs/Unit"}
    assert out["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool_0"}
    assert out["default"] == params["default"]
    outer = {"$defs": {"tool_0": out}, "properties": {"arguments": {"$ref": "#/$defs/tool_0"}}}
    assert compile_error(StructuredOutput("json", json.dumps(outer))) is None


def test_regex_classes_are_ascii_as_in_json_schema_patterns():
    # llguidance reads \d as any Unicode digit (a small model wrote U+1FBF8 for \d{3})
    from servelm.structured.grammar import ascii_classes

    cases = {
        r"\d{3}": r"[0-9]{3}",
        r"[\d_]+": r"[0-9_]+",
        r"\w\s": r"[0-9A-Za-z_][\t\n\v\f\r ]",
        r"\D\W\S": r"[^0-9][^0-9A-Za-z_][^\t\n\v\f\r ]",
        r"[^\s]": r"[^\t\n\v\f\r ]",
        r"[]\d]": r"[]0-9]",  # a ] first in a class is itself
        r"\\d\.\d": r"\\d\.[0-9]",  # an escaped backslash, then a d
        r"\p{L}\d": r"\p{L}[0-9]",
    }
    for regex, ascii_regex in cases.items():
        assert ascii_classes(regex) == ascii_regex, regex
        assert compile_error(StructuredOutput("regex", regex)) is None


def test_properties_named_like_keywords_are_schemas_all_the_same():
    # the keys of properties / $defs / dependencies are names: a property called "default"
    # or "examples" is a schema (its $ref rebased, its integer bounded), not a literal
    from servelm.structured.grammar import SAFE_INTEGER as SAFE
    from servelm.structured.grammar import bound_numbers, rebase_refs

    names = ("default", "examples", "enum", "const", "type", "$ref")
    schema = {
        "type": "object",
        "properties": {name: {"type": "integer"} for name in names},
        "$defs": {"default": {"properties": {"enum": {"$ref": "#/$defs/const"}}}, "const": {}},
        "dependencies": {"type": ["integer"]},  # (a list of names: if "type", then "integer")
        "default": {"type": "integer"},  # a literal value all the same
    }
    bounded = bound_numbers(schema)
    for name in names:
        assert bounded["properties"][name] == {"type": "integer", "minimum": -SAFE, "maximum": SAFE}
    assert bounded["dependencies"] == schema["dependencies"]
    assert bounded["default"] == {"type": "integer"}
    rebased = rebase_refs(schema, "#/$defs/tool_0")["$defs"]["default"]["properties"]["enum"]
    assert rebased == {"$ref": "#/$defs/tool_0/$defs/const"}


def test_numbers_are_held_to_16_digits_before_the_point_and_10_after(compiler):
    from servelm.structured.grammar import NUMBER_STEP, bound_numbers
    from servelm.structured.grammar import SAFE_INTEGER as SAFE

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "number"},
            "b": {"type": ["number", "null"], "minimum": 0},
            "c": {"type": "number", "multipleOf": 0.5, "maximum": 1},  # its own step: kept
            "d": {"type": "number", "enum": [3.14159265358979]},  # values: left alone
        },
    }
    out = bound_numbers(schema)["properties"]
    assert out["a"] == {"type": "number", "minimum": -SAFE, "maximum": SAFE, "multipleOf": 1e-10}
    assert out["b"] == {**schema["properties"]["b"], "maximum": SAFE, "multipleOf": NUMBER_STEP}
    assert out["c"] == {**schema["properties"]["c"], "minimum": -SAFE}
    assert out["d"] == schema["properties"]["d"]

    tok = TextTokenizer(compiler.tokenizer_file.parent)
    spec = StructuredOutput("json", json.dumps(schema["properties"]["a"]))
    template = compiler.submit(spec, frozenset(tok.eos_token_ids)).result(30)

    def accepts(text: str) -> bool:
        matcher = template.deep_copy()
        ids = tok.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    for text in ("3.1415926535", "-9007199254740991", "0.0000000001", "12.5", "0"):
        assert accepts(text), text
    for text in ("3.14159265358", "90071992547409910", "1e5", "0.00000000001"):
        assert not accepts(text), text


def test_the_cache_is_bounded_by_the_grammars_text(tiny_model_dir):
    # a compiled grammar holds about 70 times its text: 256 large schemas held gigabytes
    def schema(i: int) -> StructuredOutput:
        props = {f"p{i}_{j}": {"type": "integer"} for j in range(60)}
        return StructuredOutput("json", json.dumps({"type": "object", "properties": props}))

    two = len(schema(0).value) + len(schema(1).value)
    compiler = GrammarCompiler(tiny_model_dir / "tokenizer.json", 400, cache_text_bytes=two)
    eos = frozenset({0})
    first = compiler.submit(schema(0), eos)
    assert compiler.submit(schema(0), eos) is first  # cached: sent again, not compiled again
    second = compiler.submit(schema(1), eos)
    assert compiler.submit(schema(0), eos) is first  # both fit
    compiler.submit(schema(2), eos)  # schema(1), now the least recently used, goes
    assert compiler.submit(schema(0), eos) is first
    assert compiler.submit(schema(1), eos) is not second
    big = StructuredOutput("json", json.dumps({"type": "object", "description": "x" * 3 * two}))
    kept = compiler.submit(big, eos)  # larger than the bound: kept, alone
    assert compiler.submit(big, eos) is kept and kept.result(30) is not None
    assert compiler.submit(schema(0), eos) is not first
    compiler.shutdown()
