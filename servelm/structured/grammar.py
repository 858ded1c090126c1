"""From a `StructuredOutput` to an llguidance grammar, and whether that grammar compiles.

llguidance is the grammar engine (vLLM's `guidance` backend): one engine for JSON schemas,
regular expressions and Lark grammars (GBNF converted), in a 3 MB wheel with no dependencies,
where xgrammar 0.2 needs transformers and triton at run time. It is imported on the first
request that asks for structure, so start-up and import time stay as they are without one.

JSON is written with `json.dumps`' separators (`", "` and `": "`) and no other whitespace, and
the numbers a schema describes are held to a bounded number of digits, so that a model can
neither emit whitespace nor repeat a digit until `max_tokens` (a small model greedily writing a
population does, `1111...`; writing pi, `3.14159...` on and on):

- an integer or number left unbounded is held to JSON's interoperable range, +-(2**53 - 1)
  (RFC 7493): 16 digits at most before the point;
- a number without its own `multipleOf` gets `multipleOf: 1e-10` (NUMBER_STEP): 10 digits at
  most after the point (the finest step llguidance reads exactly: it reads `multipleOf` as a
  double, and 1e-11 is not one). So such a number is a plain decimal, no exponent (llguidance
  allows none in a bounded number); a value under 1e-10 can only be written as 0, and a small
  one keeps fewer significant digits than a double holds (17, from 1e6 up).

A number inside a value the schema does not describe (`{"type": "object"}`'s properties) is
not bounded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from servelm.engine.sampling_params import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SAFE_INTEGER = 2**53 - 1
# Past a bound beyond SAFE_INTEGER: under int64's limit, and exact as a double, which llguidance
# reads bounds as (-(2**63 - 2) becomes -2**63 there, and is refused)
FAR_INTEGER = 9 * 10**18
# The step of a number whose schema sets none: 10 digits after the point at most
NUMBER_STEP = 1e-10


def to_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec`; ValueError when it cannot be one (bad JSON, say)."""
    import llguidance
    from llguidance import LLMatcher

    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object (or true / false)")
        return LLMatcher.grammar_from_json_schema(bound_numbers(schema), defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(ascii_classes(spec.value))
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices are a non-empty list of non-empty strings")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to it
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def json_rule(schema: Any) -> str:
    """`schema` as the body of a Lark rule, `%json {...}`: a JSON value inside a larger grammar,
    written and bounded as a `json` structured output is. Its refs are its own root's."""
    if isinstance(schema, bool):  # (`%json` takes objects only)
        schema = {} if schema else {"not": {}}
    body = {"x-guidance": JSON_OPTIONS, **bound_numbers(schema)}
    return "%json " + json.dumps(body, ensure_ascii=False)


# \d, \w and \s as ASCII, as a JSON schema's `pattern` reads them (ECMAScript) and vLLM's
# default backend does: llguidance's regexes are Unicode's, where \d{3} lets a small model
# write U+1FBF8 three times. Outside a class, and inside one (where only the positive ones fit).
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\v\\f\\r "}


def ascii_classes(regex: str) -> str:
    r"""`regex` with \d, \w, \s (and \D, \W, \S outside brackets) spelled as ASCII sets."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            letter = regex[i + 1]
            ascii_set = _ASCII_CLASSES.get(letter.lower())
            if ascii_set is not None and in_class and letter.islower():
                out.append(ascii_set)
            elif ascii_set is not None and not in_class:
                out.append(f"[{'' if letter.islower() else '^'}{ascii_set}]")
            else:
                out.append(regex[i : i + 2])  # any other escape, kept whole
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            if regex[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":  # a ] first in a class is itself
                out.append("]")
                i += 1
        elif ch == "]" and in_class:
            in_class = False
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


# Keywords whose values are maps of name -> schema: their keys are names, never keywords (a
# property may be called "default", "enum" or "type"). (A `dependencies` value may also be a
# list of names: left as it is.)
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
# Keywords whose values are JSON values, not schemas: left as they are (a const object keeps
# its keys; a "$ref" inside one is text).
_LITERALS = frozenset({"const", "enum", "default", "examples"})


def _each_schema(schema: Any, node: Callable[[dict[str, Any]], None]) -> Any:
    """A copy of `schema` with `node` applied to every schema in it, innermost first: walked by
    keyword (the values of a name -> schema map are schemas, its keys names; values under
    _LITERALS left as they are; any other object or list looked into for schemas)."""
    if isinstance(schema, list):
        return [_each_schema(item, node) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _LITERALS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _each_schema(sub, node) for name, sub in value.items()}
        else:
            out[key] = _each_schema(value, node)
    node(out)
    return out


def bound_numbers(schema: Any) -> Any:
    """`schema` with every integer and number that has no lower (upper) bound given one at
    -+SAFE_INTEGER, or at FAR_INTEGER where its other bound lies beyond that (a timestamp in
    nanoseconds), and every number without a `multipleOf` held to NUMBER_STEP."""
    return _each_schema(schema, _bound)


def _bound(node: dict[str, Any]) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if ("integer" not in kinds and "number" not in kinds) or "enum" in node or "const" in node:
        return  # (a list of values is bounded already)
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if low is None and (cap := _cap(high, -1)) is not None:
        node["minimum"] = cap
    if high is None and (cap := _cap(low, 1)) is not None:
        node["maximum"] = cap
    if "number" in kinds and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP


def closed_objects(schema: Any) -> Any:
    """`schema` as OpenAI's strict mode reads it (a strict tool's): an object takes no
    properties beyond those it names unless it says so (`additionalProperties`). Without this
    a tool of no parameters, `{"type": "object", "properties": {}}`, let the model invent some."""

    def close(node: dict[str, Any]) -> None:
        if node.get("type") == "object" or "properties" in node:
            node.setdefault("additionalProperties", False)

    return _each_schema(schema, close)


def _cap(other: Any, sign: int) -> int | None:
    """The bound for a number's open side (sign +1: its maximum) given its other bound:
    SAFE_INTEGER, or FAR_INTEGER past a bound beyond it (llguidance refuses a minimum of 1.6e18
    with no maximum); None for a bound of another type (llguidance's to refuse)."""
    if other is None:
        return sign * SAFE_INTEGER
    if not isinstance(other, (int, float)) or isinstance(other, bool):
        return None
    if sign * other <= SAFE_INTEGER:
        return sign * SAFE_INTEGER
    return sign * FAR_INTEGER


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#..." ) moved under `base` ("#/$defs/x"): for a
    schema placed at `base` inside another, whose own `#/$defs/...` and `#` would otherwise
    point at the outer document's root."""

    def rebase(node: dict[str, Any]) -> None:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = base + ref[1:]

    return _each_schema(schema, rebase)


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's view of a vocabulary (tokenizer.json's text; `vocab_size`: the logits'
    width, tokens past the tokenizer's masked), as grammars are compiled against it."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos) or None)


@lru_cache(maxsize=256)
def compile_error(spec: StructuredOutput, tokenizer: Any = None) -> str | None:
    """Why `spec` does not compile, or None when it does (cached by its text). Without a
    `tokenizer` (a `grammar_tokenizer`), what only the vocabulary tells goes unchecked: the
    special tokens (`<|name|>`) and token ids (`<[123]>`) a grammar names."""
    from llguidance import LLMatcher

    try:
        grammar = to_grammar(spec)
    except (ValueError, TypeError) as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return messages[0] if is_error else None
