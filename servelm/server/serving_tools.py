"""Tool calling for chat completions: what a request's `tools` / `tool_choice` /
`parallel_tool_calls` mean, and the answer's text turned into `tool_calls` (whole or streamed).

The parsing itself is `text/tool_parsers/`; how tools reach the prompt, `text/tool_prompt.py`.
`tool_choice: "required"` and a named function constrain the answer (a structured output) to
Hermes calls of the request's tools, arguments valid for each tool's parameter schema. Under
`"auto"`, a tool marked `strict` constrains it too: free text, or calls whose arguments are
valid once the model opens one (Hermes calls only: other formats are read as written).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from servelm.engine.output_processor import TextDelta
from servelm.engine.sampling_params import StructuredOutput
from servelm.server.errors import APIError
from servelm.server.structured import structure_error
from servelm.structured.grammar import closed_objects, json_rule, rebase_refs
from servelm.text import tool_parsers
from servelm.text.tool_prompt import template_handles_tools

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolSetup:
    """What one request asks of tools. `tools` is None when the prompt gets none (no tools,
    or `tool_choice: none`); `parser` is None when the answer is not read for calls."""

    tools: list[dict[str, Any]] | None
    parser: str | None
    names: list[str]
    parallel: bool
    forced: bool = False  # tool_choice required or named: the answer is calls only
    only: str | None = None  # the named function

    def new_parser(self) -> tool_parsers.ToolParser:
        assert self.parser is not None
        return tool_parsers.make_parser(
            self.parser, tool_names=self.names, max_calls=None if self.parallel else 1
        )


def server_parser(chosen: str | None, chat_template: str | None) -> str:
    """The parser a server uses: `--tool-call-parser`, else the format the model's template
    asks for, else hermes (servelm's own tool prompt asks for the parser's format)."""
    if chosen:
        return chosen
    if not template_handles_tools(chat_template):
        return "hermes"
    return tool_parsers.default_parser(chat_template)


def _tool_names(tools: list[Any]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"tools.{i}.type must be 'function'.", "tools")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools.{i}.function.name is required.", "tools")
        if not _NAME.match(fn["name"]):
            message = f"tools.{i}.function.name must be 1-64 letters, digits, _ . or -."
            raise APIError(400, message, "tools")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise APIError(400, f"tools.{i}.function.strict must be true or false.", "tools")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters must be an object.", "tools")
        # (OpenAI's rule too: arguments are named, `{"type": "string"}` has no JSON object)
        if params.get("type", "object") not in ("object", ["object"]):
            message = (
                f"tools.{i}.function.parameters must be a JSON schema of type 'object' "
                f"(arguments by name); got type {params['type']!r}."
            )
            raise APIError(400, message, "tools")
        names.append(fn["name"])
    return names


def resolve(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: str
) -> ToolSetup | None:
    """The request's tool fields checked (a 400 naming the field), or None without tools."""
    names = _tool_names(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    forced = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
            message = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}."
            raise APIError(400, message, "tool_choice")
        forced = fn["name"]
        if forced not in names:
            raise APIError(
                400, f"tool_choice names {forced!r}, which is not in tools.", "tool_choice"
            )
    elif choice not in ("none", "auto", "required"):
        message = f"tool_choice must be 'none', 'auto', 'required' or a function; got {choice!r}."
        raise APIError(400, message, "tool_choice")
    if choice == "required" and not tools:
        raise APIError(
            400, "tool_choice 'required' forces a call, but there are no tools.", "tool_choice"
        )
    if tool_choice not in (None, "none") and tools is None:  # OpenAI's rule: nothing to choose
        raise APIError(400, "tool_choice is only allowed when tools are given.", "tool_choice")
    if not tools or choice == "none":
        return None
    if choice == "required" or forced:  # the grammar writes hermes calls, whatever the model
        # a named function is called exactly once (OpenAI's meaning, and what clients such as
        # instructor read); `required` takes one or more unless parallel_tool_calls is false
        parallel = parallel is not False and not forced
        return ToolSetup(tools, "hermes", names, parallel, True, forced)
    return ToolSetup(tools, parser, names, parallel is not False)


# OpenAI: a function without `parameters` takes none (not any arguments at all).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# The arguments of a call to a tool not marked strict, in a grammar that lets the model choose
# whether to call (tool_choice auto): any object, as that tool's calls would be unconstrained.
ANY_ARGUMENTS = {"type": "object"}


def is_strict(tool: dict[str, Any]) -> bool:
    """Whether a tool asks that its calls' arguments match its schema (OpenAI's `strict`)."""
    return tool["function"].get("strict") is True


def tool_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with `%json`) whose sentences are Hermes tool calls and
    nothing else: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the
    arguments valid for that tool's parameter schema; one call, or one or more (parallel)."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return _hermes_grammar([start], _call_schema(tools, only, strict_only=False))


def auto_tool_grammar(
    tools: list[dict[str, Any]], parallel: bool, answer: Any = None
) -> str | None:
    """The grammar of an answer that may call tools (tool_choice auto) when some tool is
    strict, else None: free text, or (with `answer`, a JSON schema) a JSON value of that schema;
    or free text and then, once the model opens a call (`<tool_call>`), Hermes calls as
    `tool_grammar`'s, a strict tool's arguments valid for its schema and another's any object,
    to the end of the answer (no text after them, as that grammar's)."""
    if not any(is_strict(t) for t in tools):
        return None
    more = ' ("\\n" call)*' if parallel else ""
    if answer is not None:  # the answer's content is JSON: no text before a call either
        lines = [f"start: answer | call{more}", f"answer: {json_rule(answer)}"]
    else:
        # `head` is lazy: it ends at the first "<tool_call>", and with it the free-text path
        # (TEXT alone is greedy, and would read on past a call's markup unconstrained)
        lines = [
            f"start: TEXT | head rest{more}",
            'head[lazy]: TEXT "<tool_call>"',
            "TEXT: /(?s:.*)/",
        ]
    return _hermes_grammar(lines, _call_schema(tools, None, strict_only=True))


def _hermes_grammar(start: list[str], call_schema: dict[str, Any]) -> str:
    """`start`'s rules and those of a Hermes call, `call` (`rest`: after its start tag)."""
    rules = [
        *start,
        'call: "<tool_call>" rest',
        'rest: "\\n" body "\\n</tool_call>"',
        f"body: {json_rule(call_schema)}",
    ]
    return "\n".join(rules) + "\n"


def _call_schema(
    tools: list[dict[str, Any]], only: str | None, strict_only: bool
) -> dict[str, Any]:
    """The JSON schema of one call's body, `{"name": ..., "arguments": {...}}`, to `only` or to
    any of `tools`: the arguments valid for the tool's parameter schema (with `strict_only`,
    only a strict tool's; another's any object)."""
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if only is None or fn["name"] == only:
            if strict_only and not is_strict(tool):
                params = ANY_ARGUMENTS
            else:
                params = {"type": "object", **fn.get("parameters", NO_PARAMETERS)}
                if is_strict(tool):
                    params = closed_objects(params)
            # Each tool's parameters live at #/$defs/tool_i, their own refs rebased there:
            # pydantic's schemas point at their root's $defs, which is no longer the root.
            defs[f"tool_{i}"] = rebase_refs(params, f"#/$defs/tool_{i}")
            properties = {
                "name": {"const": fn["name"]},  # first: a stream names the call early
                "arguments": {"$ref": f"#/$defs/tool_{i}"},
            }
            calls.append(
                {
                    "type": "object",
                    "properties": properties,
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"$defs": defs, **schema}


async def constrain(
    setup: ToolSetup | None, asked: StructuredOutput | None
) -> StructuredOutput | None:
    """The structured output of a request: a forced tool call's grammar; under tool_choice
    auto with a strict tool, `auto_tool_grammar`'s (a JSON `asked` as its answer); or what the
    request asked. Every tool's parameter schema is checked to compile first, whatever
    `tool_choice` (a 400 naming it): as OpenAI refuses a schema up front, not only when a call
    is forced."""
    if setup is None:
        return asked
    tools = setup.tools or []
    error = await asyncio.to_thread(_parameters_error, tools)
    if error:
        raise APIError(400, error, "tools")
    if setup.forced:
        if asked is not None:
            message = (
                "tool_choice forces a tool call, which no other structured output can also "
                "constrain."
            )
            raise APIError(400, message, "tool_choice")
        grammar = tool_grammar(tools, setup.only, setup.parallel)
    else:
        # Only Hermes calls are enforced (the format the grammar writes); under another parser
        # (pythonic, llama3_json, ...) a strict tool's calls are read from free text, unchecked.
        if setup.parser != "hermes":
            return asked
        answer = json.loads(asked.value) if asked is not None and asked.kind == "json" else None
        grammar = auto_tool_grammar(tools, setup.parallel, answer)
        if grammar is None:
            return asked
        if asked is not None and answer is None:
            message = (
                f"strict tools under tool_choice auto constrain the answer, which a {asked.kind} "
                "structured output cannot also constrain (a JSON schema or json_object can)."
            )
            raise APIError(400, message, "tools")
    spec = StructuredOutput("grammar", grammar)
    error = await asyncio.to_thread(structure_error, spec)
    if error:  # (each schema compiles: the grammar's first line says what is left)
        raise APIError(400, f"tools: invalid grammar: {error.splitlines()[0]}", "tools")
    return spec


def _parameters_error(tools: list[dict[str, Any]]) -> str | None:
    """Why the first tool whose parameter schema does not compile is refused, in one line (the
    grammar engine's message, not its grammar); on a worker thread, cached by the schema."""
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params:
            error = structure_error(StructuredOutput("json", json.dumps(params)))
            if error:
                reason = error.strip().splitlines()[0]
                return f"tools.{i}.function.parameters: invalid schema: {reason}"
    return None


def message_of(text: str, setup: ToolSetup | None) -> tuple[dict[str, Any], bool]:
    """A whole answer as an assistant message, and whether it calls tools."""
    if setup is None:
        return {"role": "assistant", "content": text}, False
    parser = setup.new_parser()
    content, calls = tool_parsers.collect([*parser.feed(text), *parser.finish()])
    if setup.forced:  # calls only: its text is the markup of a call cut short (max_tokens)
        content = None
    if not calls:
        return {"role": "assistant", "content": content}, False
    tool_calls = [c.to_openai() for c in calls]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """`tool_calls` for an answer that calls tools and ended by itself."""
    return "tool_calls" if calls and reason == "stop" else reason


async def stream_tool_calls(
    choices: AsyncIterator[tuple[int, TextDelta]], setup: ToolSetup
) -> AsyncIterator[tuple[int, TextDelta]]:
    """The choices' deltas with their text read for calls: each delta becomes one delta per
    run of content and one per call event (its `tool_calls` set), in order; a finishing one
    ends with an empty delta holding the finish reason."""
    parsers: dict[int, tool_parsers.ToolParser] = {}
    async for i, delta in choices:
        if delta.error:
            yield i, delta
            continue
        parser = parsers.get(i) or parsers.setdefault(i, setup.new_parser())
        events = parser.feed(delta.text)
        if delta.finished:
            events += parser.finish()
        if setup.forced:  # calls only: text is the markup of a call cut short (max_tokens)
            events = [e for e in events if not isinstance(e, str)]
        token_ids, logprobs = delta.token_ids, delta.logprobs  # go with the first piece
        for e in events:
            if isinstance(e, str):
                piece = replace(delta, text=e, tool_calls=None)
            else:
                piece = replace(delta, text="", tool_calls=[e.to_openai()])
            yield i, replace(piece, finish_reason=None, token_ids=token_ids, logprobs=logprobs)
            token_ids, logprobs = [], None
        if delta.finished or token_ids:
            reason = finish_reason(delta.finish_reason, parser.num_calls > 0)
            yield (
                i,
                replace(
                    delta,
                    text="",
                    tool_calls=None,
                    finish_reason=reason,
                    token_ids=token_ids,
                    logprobs=logprobs,
                ),
            )
