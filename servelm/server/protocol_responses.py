"""The body of OpenAI's Responses API (`POST /v1/responses`) and what it means as a chat request.

A Responses request asks the engine what a chat completion asks: a conversation (`input` items,
after `instructions` and the conversation a `previous_response_id` names), function tools, a
text format, sampling fields. `chat_request` turns it into the `ChatCompletionRequest` the chat
path already checks, renders and runs, so both APIs share one prompt, one tool prompt and one
grammar. What the Responses API asks that servelm cannot do (built-in tools, images, background
runs, truncation) is refused by name with a 400, never ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from servelm.engine.sampling_params import MAX_LOGPROBS
from servelm.server.errors import APIError
from servelm.server.protocol import ChatCompletionRequest, RequestBody

# `include` values OpenAI documents. Only the first adds anything to a servelm answer; the rest
# ask for the output of tools or reasoning servelm does not have, which is then nothing.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = (
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
)


def _one_input_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """An `input` of neither shape gets one error saying what they are, not one per shape."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "input_type", "must be a string or a list of items (objects with a type or a role)"
        ) from None


# OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, values of 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(RequestBody):
    """OpenAI's request fields, and the sampling fields vLLM's Responses API takes beside them."""

    model_config = {
        "json_schema_extra": {
            "examples": [
                {"input": "Hello", "max_output_tokens": 16},
                {"input": [{"role": "user", "content": "Hello"}], "stream": True},
            ]
        }
    }
    # asks for what servelm does not do -> the value that asks for nothing
    unsupported: ClassVar[dict[str, Any]] = {
        "background": False,
        "conversation": None,
        "prompt": None,
        "max_tool_calls": None,
        "truncation": "disabled",
    }

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]], WrapValidator(_one_input_error)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    user: str | None = None
    # accepted, and nothing to do: a routing or billing hint elsewhere
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning: dict[str, Any] | None = None  # only nulls: this model does not reason
    # vLLM's sampling fields beside OpenAI's
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion `req` asks for, and the conversation it holds: the chat messages of
    `history` (the stored conversation of its `previous_response_id`), then its input's. Its
    `instructions` lead the prompt but stay out of the conversation: a continuation does not
    carry them over (OpenAI's rule)."""
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        message = "reasoning is not supported: this model does not reason before it answers."
        raise APIError(400, message, "reasoning")
    for name in req.include or []:
        if name not in INCLUDABLE:
            raise APIError(400, f"include: unknown value {name!r}.", "include")
    if req.top_logprobs is not None and not req.logprobs:
        message = f"top_logprobs is only returned when include has {LOGPROBS_INCLUDE!r}."
        raise APIError(400, message, "top_logprobs")
    conversation = history + input_messages(req.input, history)
    _check_calls_answered(conversation)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += conversation
    if not messages:
        raise APIError(400, "input must hold at least one item.", "input")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "logprobs": req.logprobs,
        "top_logprobs": (req.top_logprobs or 0) if req.logprobs else None,
        "response_format": response_format(req.text),
        "stream": req.stream,
        **{
            name: getattr(req, name)
            for name in (
                "temperature",
                "top_p",
                "parallel_tool_calls",
                "seed",
                "stop",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "priority",
                "cache_salt",
                "logit_bias",
                "user",
            )
        },
    }
    if req.tools is not None:
        body["tools"] = [chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    body = {k: v for k, v in body.items() if v is not None}
    return ChatCompletionRequest.model_validate(body), conversation


def input_messages(items: str | list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict]:
    """`input` as chat messages: messages as they are (their parts' text), `function_call`
    items as an assistant's tool calls, `function_call_output` items as tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls", [])}
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                message = (
                    f"{where}.role must be user, assistant, system or developer; got {role!r}."
                )
                raise APIError(400, message, "input")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where, empty=True)
            call = {"id": call_id, "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            names[call_id] = name
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif last and last["role"] == "assistant":  # its text, then its calls
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in names:
                message = f"{where}: no function_call with call_id {call_id!r} precedes it."
                raise APIError(400, message, "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append(
                {"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text}
            )
        elif kind == "reasoning":
            continue  # a reasoning model's summary: this model reads none
        else:
            message = f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)."
            raise APIError(400, message, "input")
    return out


def _check_calls_answered(conversation: list[dict[str, Any]]) -> None:
    """A 400 when a function call has no `function_call_output` after it and the conversation
    goes on past it (OpenAI's rule): the model would answer as if the tool had said nothing."""
    waiting: list[str] = []
    for message in conversation:
        if message["role"] == "tool":
            if message["tool_call_id"] in waiting:
                waiting.remove(message["tool_call_id"])
            continue
        if waiting:
            break
        waiting = [call["id"] for call in message.get("tool_calls") or []]
    if waiting:
        message = f"No tool output found for function call {waiting[0]}."
        raise APIError(400, message, "input")


def _string(item: Mapping[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise APIError(
            400, f"{where}.{key} must be a{'' if empty else ' non-empty'} string.", "input"
        )
    return value


# Parts whose text the model reads: what a user writes, and an earlier answer's text.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _text(content: Any, where: str) -> str:
    """A message's content as one text: a string, or text parts joined a line apart (as chat
    messages' parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS:
            message = (
                f"{where}.{j}: only text parts are supported (this model reads text), got {kind!r}."
            )
            raise APIError(400, message, "input")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}.{j}.text must be a string.", "input")
        texts.append(text)
    return "\n".join(texts)


def is_strict(tool: Mapping[str, Any]) -> bool:
    """Whether a Responses function tool is strict: unless it says false (OpenAI's default)."""
    return tool.get("strict", True) is not False


def chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "parameters", "strict"}`) in chat's
    shape. `strict` is true unless the tool says otherwise, as OpenAI's Responses API has it."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        message = f"tools.{i}: only function tools are supported, got type {kind!r}."
        raise APIError(400, message, "tools")
    # (OpenAI's `parameters` may be null: no parameters, as when it is left out)
    function = {
        k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None
    }
    function["strict"] = is_strict(tool)
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> str | dict[str, Any]:
    """`none` / `auto` / `required`, or `{"type": "function", "name": ...}` in chat's shape."""
    if isinstance(choice, Mapping):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            message = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}."
            raise APIError(400, message, "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: `text`, `json_object`, or `json_schema` with
    its name and schema at the top level (not under `json_schema`, as in chat)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise APIError(400, "text.format must be an object with a type.", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise APIError(400, "text.format json_schema needs a schema object.", "text")
        fields = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": fields}
    message = f"text.format.type must be text, json_object or json_schema; got {kind!r}."
    raise APIError(400, message, "text")


def text_config(text: dict[str, Any] | None) -> dict[str, Any]:
    """The `text` a response echoes: the request's, `{"format": {"type": "text"}}` by default."""
    return {"format": {"type": "text"}, **copy.deepcopy(text or {})}
