"""Request and response bodies of the OpenAI API (pydantic). Unknown fields are ignored, except
vLLM's request fields that servelm does not implement (`RequestBody.unsupported`): one that asks
for anything but vLLM's default (`use_beam_search: true`, `bad_words`, ...) is refused with a
400 naming it, since a client that sends it expects an answer servelm would not give.

Every string of a request body must be valid Unicode and every integer must fit in 64 bits:
JSON can spell a lone surrogate (`"\\ud800"`), which Python keeps in a str but no tokenizer or
encoder takes, and any integer, which the engine's messages cannot carry. A request holding
either is refused as a whole, naming where.

Types are strict (pydantic's strict mode, issue #32): a string is not a number (`"10"`), a boolean
is not an integer nor a token id (`false`), a float is not an integer (`10.0`). The one coercion
kept is JSON's own: an integer where a float is wanted (`"temperature": 1`, as clients send it).
Simple bounds are declared on the fields, so that /openapi.json states them; SamplingParams
checks them again for callers of the Python API.
"""

from __future__ import annotations

import json
import time
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from servelm.engine.sampling_params import INT64, MAX_LOGPROBS, MAX_N
from servelm.server.errors import APIError
from servelm.text.chat_messages import ROLES


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# A token id as the API takes it: below the vocabulary size too, which the server checks
# (`OpenAIServing.check_token_ids`) since only it knows the vocabulary.
TokenId = Annotated[int, Field(ge=0)]


# A prompt list's shape is told by its first item, its items checked as that shape's in slices.
# The union alone validates every item against each shape in turn, collecting an error per item
# of each shape it is not: a second of a core for 2M token ids. And pydantic holds the GIL
# through each call, so a body parsed on a worker thread (body_parse.py) still stops the event
# loop for as long as its longest one: a slice takes a few ms.
_SLICE = 1 << 15
_PROMPT_ITEMS = {
    first: TypeAdapter(list[item], config=ConfigDict(strict=True))
    for first, item in ((str, str), (int, TokenId))
}


def _in_slices(check: TypeAdapter, value: Any) -> list[Any]:
    if not isinstance(value, list):
        return check.validate_python(value)  # (refused: not a list)
    out: list[Any] = []
    for start in range(0, len(value), _SLICE):
        out += check.validate_python(value[start : start + _SLICE])
    return out


def _one_prompt_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A prompt that fits none of its four shapes gets one error saying what they are, not one
    per shape tried. A list is checked as the one shape its first item tells."""
    first = type(value[0]) if isinstance(value, list) and value else None
    try:
        if first in _PROMPT_ITEMS:
            return _in_slices(_PROMPT_ITEMS[first], value)
        if first is list:  # a list of token id lists
            return [_in_slices(_PROMPT_ITEMS[int], ids) for ids in value]
        return handler(value)  # a string, an empty list, or no shape at all
    except ValidationError:
        raise PydanticCustomError(
            "prompt_type",
            "must be a string, a list of strings, a list of token ids (integers >= 0) or a "
            "list of such lists",
        ) from None


def _numbers_in_range(values: list[Any]) -> bool:
    """Whether a list holds only numbers (bools, ints, floats) with every int in 64 bits: min
    and max at C speed, a slice per call (`_SLICE`). False when unsure (strings, lists, dicts,
    empty): walk it."""
    if not values or type(values[0]) not in (int, float, bool):
        return False
    parts = [values[start : start + _SLICE] for start in range(0, len(values), _SLICE)]
    try:  # anything in JSON that is not a number fails to compare with one
        low, high = min(min(p) for p in parts), max(max(p) for p in parts)
    except TypeError:
        return False
    return INT64[0] <= low and high <= INT64[1]


# vLLM's fields of both chat and completions requests that servelm does not implement, with
# vLLM's default, which asks for nothing and so is accepted (as is null). Fields that change
# no answer (vLLM's request_id, kv_transfer_params, guided_decoding_backend) stay ignored.
VLLM_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "early_stopping": False,
    "bad_words": [],
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "typical_p": 1.0,  # (not vLLM's, but other servers' and transformers')
    # vLLM's default is what a fast tokenizer does, and servelm's decode (`tokenizers`)
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "vllm_xargs": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "guided_whitespace_pattern": None,
    "prompt_embeds": None,
}
# chat requests' (and /tokenize's): ways to build the prompt
VLLM_CHAT_UNSUPPORTED: dict[str, Any] = {
    "continue_final_message": False,
    "chat_template": None,
    "documents": None,
}


def _is_default(value: Any, default: Any) -> bool:
    if value is None or isinstance(default, bool):
        return value is None or value is default
    if isinstance(default, float):
        return type(value) in (int, float) and value == default
    return value == default


class RequestBody(OpenAIModel):
    """A whole request body: refuses one holding text that is not valid Unicode or an integer
    beyond 64 bits, and one asking for what servelm does not implement (`unsupported`)."""

    # a field servelm does not implement -> the value that asks for nothing (vLLM's default)
    unsupported: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, default in cls.unsupported.items():
                if name in data and not _is_default(data[name], default):
                    only = "" if default is None else f"; only {json.dumps(default)} is accepted"
                    raise APIError(400, f"{name} is not supported{only}.", name)
        return data

    @model_validator(mode="before")
    @classmethod
    def _representable(cls, data: Any) -> Any:
        found = _unrepresentable(data)
        if found is not None:
            path, problem = found
            raise APIError(400, f"{'.'.join(path)} {problem}.", path[0])
        if isinstance(data, dict):  # OpenAI's "... or null" fields: null asks for the default
            nulls = [k for k in _null_means_default(cls) if k in data and data[k] is None]
            data = {k: v for k, v in data.items() if k not in nulls} if nulls else data
        return data


@cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that may be null but default to something else (`n`: 1)."""
    return frozenset(
        name
        for name, f in model.model_fields.items()
        if f.default is not None and type(None) in get_args(f.annotation)
    )


def _unrepresentable(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str] | None:
    """(path, what is wrong) of the first string with a lone surrogate or integer beyond 64
    bits in a parsed JSON value, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            problem = f"is not valid Unicode text: a lone surrogate at character {exc.start}"
            return (path or ("body",)), problem
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT64[0] <= value <= INT64[1]:
            return (path or ("body",)), "is out of range: integers must fit in 64 bits"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        if _numbers_in_range(value):  # token ids: thousands of them, checked in C
            return None
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        # the key as it can be written back (escaped: it may hold the lone surrogate itself)
        key_path = (*path, str(key).encode("utf-8", "backslashreplace").decode())
        found = _unrepresentable(key, key_path) if isinstance(key, str) else None
        found = found or _unrepresentable(item, key_path)
        if found:
            return found
    return None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and completions requests."""

    unsupported = VLLM_UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (serving checks)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)  # null: the default (OpenAI: "integer or null")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0
    # vLLM's: prompts share prefix-cache blocks only with prompts of the same salt (a tenant's
    # cached prompts cannot be probed through another tenant's time to first token)
    cache_salt: str | None = Field(None, min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extension: the prompt's logprobs (and top N) in each choice's `prompt_logprobs`
    prompt_logprobs: int | None = None
    # Structured outputs (server/structured.py): OpenAI's, and vLLM's body extensions.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None


class ChatMessage(OpenAIModel):
    # Documented as serving_chat checks it: only an assistant message may go without content.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        },
    )
    # checked in serving_chat (its message names the message); documented here
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={  # in /openapi.json: a whole answer, and one streamed
            "examples": [
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                 "stream": True, "stream_options": {"include_usage": True}},
            ]
        }
    )  # fmt: skip
    unsupported = {
        **VLLM_UNSUPPORTED,
        **VLLM_CHAT_UNSUPPORTED,
        "echo": False,  # vLLM's: the answer after the last message, if that is the assistant's
        "add_special_tokens": False,  # (the template writes every special token)
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # tool calling (server/serving_tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: the chat template's own variables (Qwen3's `enable_thinking`), as
    # transformers' apply_chat_template(**kwargs) takes them (text/chat_template.py)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's deprecated form of tools: accepted only to be refused by name (serving_chat)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2},
                {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 8, "stream": True},
            ]
        }
    )
    unsupported = {**VLLM_UNSUPPORTED, "add_special_tokens": True}  # (a string prompt's BOS)
    prompt: Annotated[
        str | list[str] | list[TokenId] | list[list[TokenId]], WrapValidator(_one_prompt_error)
    ]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # the text (and the logprobs) start with the prompt's
    # accepted so that what servelm cannot honour is refused by name (serving_completion)
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(RequestBody):
    unsupported = VLLM_CHAT_UNSUPPORTED
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # messages are counted as a chat completion with these fields would count them
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "servelm"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
