"""Which structured output a request asks for, read from the fields clients send, and a 400
before admission when it does not compile.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`: at most one of them per request. The check compiles the
grammar on a worker thread (cached by its text), so the event loop keeps streaming meanwhile;
the grammar engine is imported on the first request that asks for structure. Given the
model's tokenizer it compiles against the vocabulary, as the engine will (the special tokens
and token ids a grammar names exist): llguidance's view of it is built on that first request
(0.2 s for 49k tokens), from the same tokenizer.json. Its width is the tokenizer's, where the
engine's is the logits' (often padded wider): a token id in the padding, which no text has,
is refused here.
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from servelm.engine.sampling_params import StructuredOutput
from servelm.server.errors import APIError

if TYPE_CHECKING:
    from servelm.text.tokenizer import TextTokenizer

ANY_JSON_OBJECT = '{"type": "object"}'
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


def requested_structure(req: Any) -> tuple[StructuredOutput, str] | None:
    """The structured output `req` asks for and the field that asked, or None; a 400 naming the
    field for a malformed one, or when two fields ask."""
    found: list[tuple[StructuredOutput, str]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        found.append((_structured_outputs(structured), "structured_outputs"))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((_spec(kind, value, field), field))
    if len(found) > 1:
        (_, first), (_, second) = found[:2]
        raise APIError(400, f"{second} and {first} both constrain the output; send one.", second)
    return found[0] if found else None


async def checked_structure(
    req: Any, tokenizer: TextTokenizer | None = None
) -> StructuredOutput | None:
    """The structured output `req` asks for, once it is known to compile (else a 400), against
    `tokenizer`'s vocabulary where given."""
    found = requested_structure(req)
    if found is None:
        return None
    await check_structure(*found, tokenizer=tokenizer)
    return found[0]


async def check_structure(
    spec: StructuredOutput, param: str, tokenizer: TextTokenizer | None = None
) -> None:
    """A 400 naming `param` when the grammar engine cannot compile `spec` (for `tokenizer`)."""
    error = await asyncio.to_thread(structure_error, spec, tokenizer)
    if error:
        what = {"json": "schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
        raise APIError(400, f"{param}: invalid {what[spec.kind]}: {error}", param)


def structure_error(spec: StructuredOutput, tokenizer: TextTokenizer | None = None) -> str | None:
    """Why `spec` does not compile (for `tokenizer`), or None; on a worker thread."""
    from servelm.structured.grammar import compile_error

    return compile_error(spec, _grammar_tokenizer(tokenizer) if tokenizer else None)


@lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer: TextTokenizer) -> Any:
    """llguidance's view of `tokenizer`, as the engine builds it (its end-of-sequence ids are
    those every request of this model ends with)."""
    from servelm.structured.grammar import grammar_tokenizer

    text = tokenizer.tokenizer.to_str()  # tokenizer.json's content
    return grammar_tokenizer(text, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise APIError(400, f"{param} must be a JSON schema (an object).", param)
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise APIError(400, f"{param} must be a non-empty list of strings.", param)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string.", param)
    return StructuredOutput(kind, value)


def _response_format(response_format: dict[str, Any]) -> StructuredOutput | None:
    kind = response_format.get("type")  # required, as OpenAI's: never guessed
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT)
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            message = "response_format json_schema needs a json_schema object with a schema."
            raise APIError(400, message, "response_format")
        schema = body.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return StructuredOutput("json", ANY_JSON_OBJECT)
        return _spec("json", schema, "response_format")
    message = f"response_format.type must be text, json_object or json_schema; got {kind!r}."
    if kind is None:
        message = "response_format.type is required: text, json_object or json_schema."
    raise APIError(400, message, "response_format")


def _structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object.", param)
    # vLLM's: whether to refuse rather than fall back to another grammar backend; servelm has
    # one backend, so either way the answer is the same
    if not isinstance(value.get("disable_fallback", False), (bool, type(None))):
        raise APIError(400, f"{param}.disable_fallback must be true or false.", param)
    value = {k: v for k, v in value.items() if k != "disable_fallback"}
    asked = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(asked) - {*STRUCTURED_KEYS, "json_object"})
    if unknown:
        keys = ", ".join((*STRUCTURED_KEYS, "json_object"))
        raise APIError(400, f"{param}.{unknown[0]} is not supported (use one of {keys}).", param)
    if len(asked) != 1:
        message = f"{param} needs exactly one of json, regex, choice, grammar, json_object."
        raise APIError(400, message, param)
    ((key, item),) = asked.items()
    if key == "json_object":
        return StructuredOutput("json", ANY_JSON_OBJECT)
    return _spec(key, item, param)
