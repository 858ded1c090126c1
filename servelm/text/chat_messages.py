"""OpenAI-format chat messages made ready for a model's chat template: one preparation for the
server (chat completions, /tokenize) and the offline `LLM.chat`, so that both build the same
prompt from the same conversation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from servelm.text.chat_template import ChatTemplateError, with_template_roles
from servelm.text.tool_prompt import prepare_messages

if TYPE_CHECKING:
    from servelm.text.tokenizer import TextTokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")


class InvalidMessageError(ChatTemplateError):
    """A message servelm cannot carry to the template (the server answers it with a 400)."""


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (content as plain text), or an
    InvalidMessageError naming the first one servelm cannot carry: an unknown role, a part that
    is not text, no content, tool calls not of OpenAI's shape. A field set to None counts as
    absent (as OpenAI reads it)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessageError(f"messages.{i} must be an object with a role and content.")
        m = {key: value for key, value in message.items() if value is not None}
        role = m.get("role")
        if role not in ROLES:
            raise InvalidMessageError(
                f"messages.{i}.role must be one of {', '.join(ROLES)}; got {role!r}."
            )
        if "function_call" in m:  # the deprecated form of tool_calls
            raise InvalidMessageError(
                f"messages.{i}.function_call is the deprecated form of tool_calls; send tool_calls."
            )
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            # OpenAI: only an assistant message that makes tool calls may go without content.
            raise InvalidMessageError(f"messages.{i}.content is required for a {role!r} message.")
        if isinstance(content, list):  # text parts -> one text, a line apart as vLLM joins them
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise InvalidMessageError(
                        f"messages.{i}.content: only text parts are supported, got {kind!r}."
                    )
            m["content"] = "\n".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise InvalidMessageError(
                f"messages.{i}.content must be a string or a list of text parts."
            )
        if "tool_calls" in m:
            _check_tool_calls(m["tool_calls"], f"messages.{i}.tool_calls")
        m.setdefault("content", "")  # an assistant's tool calls alone: templates read it
        out.append(m)
    return out


def _check_tool_calls(calls: Any, where: str) -> None:
    """An InvalidMessageError naming the first part of `calls` that is not OpenAI's shape: a
    list of {"function": {"name": ..., "arguments": JSON text (or an object)}}."""
    if not isinstance(calls, list):
        raise InvalidMessageError(f"{where} must be a list of tool calls.")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(call, Mapping):
            raise InvalidMessageError(f"{where}.{j} must be an object with a function.")
        if not isinstance(fn, Mapping):
            raise InvalidMessageError(f"{where}.{j}.function must be an object (name, arguments).")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidMessageError(f"{where}.{j}.function.name must be a non-empty string.")
        if not isinstance(fn.get("arguments"), (str, Mapping, type(None))):
            raise InvalidMessageError(
                f"{where}.{j}.function.arguments must be a string of JSON (or an object)."
            )


def prepare_chat(
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    parallel: bool = True,
    parser: str = "hermes",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str | None]:
    """(messages, tools, template) to render a conversation with: the template transformers
    would pick, `developer` turns as that template takes them, and tools and tool turns as
    `text/tool_prompt.py` writes them (`parallel`: whether the model may call several;
    `parser`: the tool-call parser that reads the answer, whose format servelm's text asks for)."""
    template = tokenizer.chat_template_for(tools is not None)
    msgs = with_template_roles(template_messages(messages), template)
    msgs, tools = prepare_messages(
        msgs, tools, template, parallel, tokenizer.special_tokens, parser
    )
    return msgs, tools, template
