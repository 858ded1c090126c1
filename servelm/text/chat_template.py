"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` renders them.

Same environment settings (sandboxed, trim_blocks, lstrip_blocks, loop controls), the same
helpers (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) and the same
variables (messages, add_generation_prompt, tools, documents, the special tokens), so the
string we tokenize is byte-for-byte the one the model was trained to see.
"""

from __future__ import annotations

import json
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


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
            **(special_tokens or {}),
            **extra,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None
