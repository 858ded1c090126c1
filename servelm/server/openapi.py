"""/openapi.json as the server behaves (issue #32): what each route answers, so that a client
generated from the document, or a fuzzer checking answers against it (tests/server/
test_schemathesis.py), finds what the server does.

FastAPI documents a 422 for every route with a body, which servelm never sends: its handlers
(server/errors.py) answer 400 with OpenAI's error object. Here the 422s go, and each route lists
the statuses it can answer with the error schema, `text/event-stream` beside JSON where
`"stream": true` makes a 200 a stream of server-sent events, and the answers' shapes (these
models document; the handlers build plain dicts).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from servelm.server.errors import ErrorResponse
from servelm.server.protocol import Usage


class LogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(LogprobEntry):
    top_logprobs: list[LogprobEntry]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None


class AssistantMessage(BaseModel):
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseObject(BaseModel):
    """A Responses API answer (`POST /v1/responses`, `GET /v1/responses/{id}`); the request's
    echoed fields (tools, text, metadata, ...) beside these."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created_at: int
    completed_at: int | None
    status: str
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed Responses API answer (`response.created`, ...,
    `response.completed`); its other fields by type, as OpenAI documents them."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseItems(BaseModel):
    """A page of a stored response's input items."""

    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: str
    deleted: bool


class Tokenized(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: "The request is invalid: a field's type or value, a prompt over the context.",
        401: "No valid API key (`Authorization: Bearer ...`), when the server has one.",
        404: "No such model (or stored response).",
        413: "The request body is over --max-request-bytes.",
        500: "The engine failed on this request.",
        503: "The engine is not running, or the waiting queue is full (with Retry-After).",
    }
    return {s: {"model": ErrorResponse, "description": described[s]} for s in statuses}


# What each route answers besides its 200 (and 401 everywhere when keys are on).
GENERATE = {
    200: {"description": 'The answer as JSON, or with `"stream": true` as server-sent events.'},
    **_errors(400, 404, 413, 500, 503),
}
# Each streamed event (OpenAPI 3.1 has `schema` describe one event of a stream): a chunk, an
# error object if the request fails mid-stream, then `[DONE]`.
STREAMS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": CompletionChunk}
# The Responses API's stream: typed events (`event: <type>` and the event as data), no [DONE].
TYPED_STREAMS = {"/v1/responses": ResponseStreamEvent}
TOKENS = _errors(400, 404, 413)
MODEL = _errors(404)
PAGE = _errors(400, 404)  # a page of a stored response's items: a bad limit or order too
HEALTH = {200: {"description": "The engine is running (no body)."}, **_errors(503)}


# Where token ids go in a request: their bound, the vocabulary's size, is known only at start-up.
TOKEN_ID_FIELDS = {
    "ChatCompletionRequest": ("stop_token_ids",),
    "CompletionRequest": ("stop_token_ids", "prompt"),
    "DetokenizeRequest": ("tokens",),
}


def install_openapi(
    app: FastAPI, api_key: bool, open_paths: frozenset[str], vocab_size: int
) -> None:
    """Make `app.openapi()` (served as /openapi.json) describe the server as it behaves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, api_key, open_paths)
            _bound_token_ids(app.openapi_schema["components"]["schemas"], vocab_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI, api_key: bool, open_paths: frozenset[str]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc["components"]["schemas"]  # ErrorResponse is there: GENERATE names it
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    unauthorized = {
        "description": _errors(401)[401]["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for path, chunk in STREAMS.items():
        chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(chunk_schema.pop("$defs", {}))
        schemas[chunk.__name__] = chunk_schema
        doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {
            "schema": _event(chunk.__name__)
        }
    for path, event in TYPED_STREAMS.items():
        schemas[event.__name__] = event.model_json_schema()
        doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = {
            "schema": _typed_event(event.__name__)
        }
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if api_key and path not in open_paths:
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = unauthorized
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _bound_token_ids(schemas: dict[str, Any], vocab_size: int) -> None:
    """Each token id (an integer with `minimum: 0`) of TOKEN_ID_FIELDS gets `maximum`."""

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = vocab_size - 1
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for model, fields in TOKEN_ID_FIELDS.items():
        for field in fields:
            walk(schemas[model]["properties"][field])


def _json_of(name: str) -> dict[str, Any]:
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": f"#/components/schemas/{name}"},
    }


def _typed_event(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": _json_of(name)},
    }


def _event(chunk: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [_json_of(chunk), _json_of("ErrorResponse"), {"const": "[DONE]"}]}
        },
    }
