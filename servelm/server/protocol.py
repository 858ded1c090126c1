"""Request and response bodies of the OpenAI API (pydantic). Unknown fields are accepted and ignored.

Every string of a request body must be valid Unicode: JSON can spell a lone surrogate
(`"\\ud800"`), which Python keeps in a str but no tokenizer or encoder takes, so a request
holding one is refused as a whole, naming where it is.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servelm.server.errors import APIError


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestBody(OpenAIModel):
    """A whole request body: refuses one holding text that is not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            path, index = where
            raise APIError(
                400,
                f"{'.'.join(path)} is not valid Unicode text: a lone surrogate at character "
                f"{index}.",
                path[0],
            )
        return data


def _lone_surrogate(value: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], int] | None:
    """(path, character index) of the first lone surrogate in a parsed JSON value, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (path or ("body",)), exc.start
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key_path = (*path, str(key))
        found = _lone_surrogate(key, key_path) if isinstance(key, str) else None
        found = found or _lone_surrogate(item, key_path)
        if found:
            return found
    return None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    # accepted so that what servelm cannot honour is refused by name (serving_chat)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    # accepted so that what servelm cannot honour is refused by name (serving_completion)
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


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
