"""From a `StructuredOutput` to an llguidance grammar, and whether that grammar compiles.

llguidance is the grammar engine (vLLM's `guidance` backend): one engine for JSON schemas,
regular expressions and Lark grammars (GBNF converted), in a 3 MB wheel with no dependencies,
where xgrammar 0.2 needs transformers and triton at run time. It is imported on the first
request that asks for structure, so start-up and import time stay as they are without one.

JSON is written with `json.dumps`' separators (`", "` and `": "`) and no other whitespace, and an
integer a schema leaves unbounded is held to JSON's interoperable range (+-(2**53 - 1), RFC
7493): a model can neither emit whitespace nor repeat a digit until `max_tokens` (a small model
greedily writing a population does, `1111...`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from servelm.engine.sampling_params import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SAFE_INTEGER = 2**53 - 1


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
        return LLMatcher.grammar_from_json_schema(bound_integers(schema), defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices are a non-empty list of non-empty strings")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to it
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def bound_integers(schema: Any) -> Any:
    """`schema` with every integer that has no lower (upper) bound given one at -+SAFE_INTEGER."""
    if isinstance(schema, list):
        return [bound_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bound_integers(value) for key, value in schema.items()}
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


@lru_cache(maxsize=256)
def compile_error(spec: StructuredOutput) -> str | None:
    """Why `spec` does not compile, or None when it does (cached by its text)."""
    from llguidance import LLMatcher

    try:
        grammar = to_grammar(spec)
    except (ValueError, TypeError) as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None
