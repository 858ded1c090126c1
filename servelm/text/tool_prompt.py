"""Tools and tool turns in the prompt: through the model's own chat template when it reads
them, otherwise as servelm's own text (a plain ChatML template drops them).

servelm's text, for a template that does not mention `tools`, in the call format of the parser
that reads the answer (`parser`: Hermes `<tool_call>` blocks unless the server was told
another, `--tool-call-parser`; each parser's class writes its format):

- the tools go in a system message (appended to the conversation's own, or a new first one),
  or, where the template has no system role (Gemma 2's raises, Mistral v0.1/v0.2's want turns
  to alternate from a user one), at the start of the first user message: a short instruction,
  each tool's `{"type": "function", "function": {...}}` as one JSON line between `<tools>`
  and `</tools>`, and the call format (Hermes':
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call);
- an assistant turn's `tool_calls` are appended to its content in that format;
- `role: tool` messages become a user turn, each result between `<tool_response>` and
  `</tool_response>` (consecutive results share one turn).

The model's own template gets the request's tools as `tools`, and each call's `arguments`
as an object (templates write them with `tojson`; the API carries them as a JSON string).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from servelm.text.chat_template import template_keeps_system
from servelm.text.tool_parsers import parser_class

_TOOLS_VARIABLE = re.compile(r"\btools\b")


def template_handles_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (and so, by convention, renders
    tool calls and tool results too)."""
    return bool(template) and bool(_TOOLS_VARIABLE.search(template or ""))


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object where its JSON string holds one; as given otherwise."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def tools_instruction(
    tools: list[dict[str, Any]], parallel: bool = True, parser: str = "hermes"
) -> str:
    """The tools and how to call them, in the format `parser` reads."""
    lines = [
        "# Tools",
        "",
        "You may call the functions described below (JSON schemas, one per line, between "
        "<tools> and </tools>) when they help you answer.",
        "<tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools),
        "</tools>",
        "",
        parser_class(parser).instruction(parallel),
    ]
    return "\n".join(lines)


def _calls_text(calls: list[dict[str, Any]], parser: str) -> str:
    """An assistant turn's calls (checked: `chat_messages.template_messages`) as text."""
    pairs = [
        (c["function"]["name"], _arguments_object(c["function"].get("arguments") or {}))
        for c in calls
    ]
    return parser_class(parser).calls_text(pairs)


def _as_text(messages: list[dict[str, Any]], parser: str = "hermes") -> list[dict[str, Any]]:
    """Tool calls and results written into plain turns (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
            continue
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if calls:
            parts = [m.get("content") or "", _calls_text(calls, parser)]
            m["content"] = "\n".join(p for p in parts if p)
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out


def _with_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tool calls: each call's arguments as an object."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                if isinstance(c.get("function"), dict):
                    fn = dict(c["function"])
                    fn["arguments"] = _arguments_object(fn.get("arguments", {}))
                    c["function"] = fn
                calls.append(c)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def prepare_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
    parallel: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    parser: str = "hermes",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render: unchanged for a template that reads tools (arguments as
    objects), servelm's text otherwise, in `parser`'s call format (and no `tools` for the
    template). `special_tokens`: those the template is rendered with."""
    if template_handles_tools(template):
        return _with_objects(messages), tools or None
    messages = _as_text(messages, parser)
    if not tools:
        return messages, None
    block = tools_instruction(tools, parallel, parser)
    if template is None or template_keeps_system(template, special_tokens):
        if messages and messages[0].get("role") in ("system", "developer"):
            messages[0] = _with_block(messages[0], block)
        else:
            messages.insert(0, {"role": "system", "content": block})
        return messages, None
    # A template without a system role: the first user turn starts with the block, as Gemma's
    # own guidance places instructions. A system message the request sent still meets the
    # template's refusal (as it would with transformers or vLLM); servelm adds none of its own.
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        messages.insert(0, {"role": "user", "content": block})
    else:
        messages[first_user] = _with_block(messages[first_user], block, before=True)
    return messages, None


def _with_block(message: dict[str, Any], block: str, before: bool = False) -> dict[str, Any]:
    content = message.get("content") or ""
    if not content:
        return {**message, "content": block}
    return {**message, "content": f"{block}\n\n{content}" if before else f"{content}\n\n{block}"}
