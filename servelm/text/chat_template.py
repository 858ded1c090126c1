"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` renders them.

Same environment settings (sandboxed, trim_blocks, lstrip_blocks, loop controls), the same
helpers (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) and the same
variables (messages, add_generation_prompt, tools, documents, the special tokens, then a
request's `chat_template_kwargs` over them), so the string we tokenize is byte-for-byte the one
the model was trained to see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or there is no template)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def with_template_roles(
    messages: list[dict[str, Any]], template: str | None
) -> list[dict[str, Any]]:
    """OpenAI's `developer` messages as `system` ones, unless the template knows the role: the
    API defines them as the system prompt by another name, and a template that has never heard
    of them would add its default system prompt and render them as a turn of their own."""
    if template is not None and "developer" in template:
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


# Names a request's `chat_template_kwargs` may not set: what the renderer sets from the request's
# own fields, and what transformers' `apply_chat_template` takes as its arguments (never template
# variables: `tokenize`, `continue_final_message`, ...), which servelm does not take.
_SET_FROM_REQUEST = ("messages", "tools", "add_generation_prompt")
_RENDERER_ARGUMENTS = (
    "conversation",
    "chat_template",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


class TemplateKwargsError(ChatTemplateError):
    """A request's `chat_template_kwargs` names a variable the renderer sets itself."""


def check_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> None:
    """TemplateKwargsError naming the first reserved name in `template_kwargs`. The others
    (`enable_thinking`, `documents`, a special token such as `bos_token`) reach the template as
    transformers' `apply_chat_template(**kwargs)` passes them: over the special tokens."""
    for key in template_kwargs or ():
        if key in _SET_FROM_REQUEST:
            raise TemplateKwargsError(
                f"chat_template_kwargs.{key} is set from the request's own `{key}`; send it there."
            )
        if key in _RENDERER_ARGUMENTS:
            raise TemplateKwargsError(
                f"chat_template_kwargs.{key} is an argument of transformers' apply_chat_template, "
                "not a template variable; servelm does not take it."
            )
    documents = (template_kwargs or {}).get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):  # transformers' own check
        raise TemplateKwargsError("chat_template_kwargs.documents must be a list of objects.")


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    check_template_kwargs(template_kwargs)
    variables = {"documents": None, **(special_tokens or {}), **(template_kwargs or {})}
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **variables,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None
    except Exception as exc:  # the template meeting a value it does not expect (a request's
        # `chat_template_kwargs` value of another type, or named as a helper): a 400, not a 500
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


_PROBE = "servelm probes the system role"


@lru_cache(maxsize=16)
def _keeps_system(template: str, special_tokens: tuple[tuple[str, str], ...]) -> bool:
    probe = [{"role": "system", "content": _PROBE}, {"role": "user", "content": "Hello"}]
    try:
        return _PROBE in render_chat_template(template, probe, True, dict(special_tokens))
    except ChatTemplateError:
        return False


def template_keeps_system(template: str, special_tokens: Mapping[str, str] | None = None) -> bool:
    """Whether a system message reaches the prompt through this template: Gemma 2's raises
    "System role not supported", Mistral v0.1/v0.2's "Conversation roles must alternate", some
    drop it unseen (a probe conversation rendered once per template)."""
    return _keeps_system(template, tuple(sorted((special_tokens or {}).items())))
