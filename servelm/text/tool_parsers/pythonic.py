"""Pythonic tool calls: `[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4 style)."""

from __future__ import annotations

import ast
import json
import keyword
import math
from typing import Any

from servelm.text.tool_parsers.base import Event, ToolParser


class PythonicParser(ToolParser):
    """`[get_weather(city="Paris"), get_time()]` (optionally in `<|python_start|>` ...
    `<|python_end|>`): a list of calls with literal keyword arguments, each to one of the
    request's tools. The calls are handed out when the list closes; any other answer is text."""

    START, END = "<|python_start|>", "<|python_end|>"

    @classmethod
    def instruction(cls, parallel: bool) -> str:
        example = '[function_name(argument_name="value")'
        lines = [
            "To call a function, answer with only a list of calls in Python syntax, each "
            "argument by name as a literal, and no other text:",
            example + (", other_function()]" if parallel else "]"),
            "Put one call per function in the list." if parallel else "Call at most one function.",
        ]
        return "\n".join(lines)

    @classmethod
    def calls_text(cls, calls: list[tuple[str, Any]]) -> str:
        return "[" + ", ".join(f"{name}({_python_arguments(a)})" for name, a in calls) + "]"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending = ""
        self.mode = "start"  # start, list, after, text
        self.depth = 0
        self.quote: str | None = None
        self.esc = False
        self.scanned = 0  # characters of `pending` read in list mode

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        if self.mode == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(self.START):
                stripped = stripped[len(self.START) :].lstrip()
            if not stripped or (self.START.startswith(stripped) and stripped != self.START):
                return []
            if stripped[0] == "[":
                self.mode, self.pending = "list", stripped
            else:
                self.mode = "text"
        if self.mode == "list" and self._scan():
            body, self.pending = (
                self.pending[: self.scanned],
                self.pending[self.scanned :],
            )
            calls = self._calls(body)
            if calls is None:
                self.mode, self.pending = "text", body + self.pending
            else:
                for name, args in calls[: self.max_calls]:
                    index = self._start_call(name)
                    self._arguments(index, args)
                self.mode = "after"
        if self.mode == "after":
            rest = self.pending.lstrip()
            if rest.startswith(self.END):
                rest = rest[len(self.END) :]
            elif self.END.startswith(rest):
                return self._take()
            self.pending = rest
            if rest.strip():
                self.mode = "text"
        if self.mode == "text":
            self._content(self.pending)
            self.pending = ""
        return self._take()

    def _scan(self) -> bool:
        """Reads on from `scanned`; True once the list's closing bracket is read."""
        for i in range(self.scanned, len(self.pending)):
            ch = self.pending[i]
            if self.quote:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.scanned = i + 1
                    return True
        self.scanned = len(self.pending)
        return False

    def _calls(self, body: str) -> list[tuple[str, str]] | None:
        """The calls of a whole list, each with its arguments' JSON; None (the list is text)
        unless every call is to a tool, with keyword arguments whose values are JSON's: the
        model's text is untrusted, and a literal JSON has no form of (b"x", {1, 2}, 1e999,
        a key that is not a string) is no call."""
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
                return None
            name = call.func.id
            if self.tool_names is not None and name not in self.tool_names:
                return None
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None  # (TypeError: an unhashable key, {[1]: 2})
            if None in args or not _is_json(args):  # (None: **kwargs)
                return None
            try:
                calls.append((name, json.dumps(args, ensure_ascii=False, allow_nan=False)))
            except ValueError:  # an integer too long to write out
                return None
        return calls

    def finish(self) -> list[Event]:
        if self.mode in ("start", "list"):
            self._content(self.pending)
        self.pending = ""
        return self._take()


def _is_json(value: Any) -> bool:
    """Whether a Python literal is a JSON value as it stands (a tuple as an array)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int))  # (bool is an int)


def _python_arguments(arguments: Any) -> str:
    """Arguments as a call writes them: by keyword, values as Python literals."""
    if not isinstance(arguments, dict):
        return repr(arguments)  # (text that is no JSON object: kept, if not as a call takes it)
    if all(k.isidentifier() and not keyword.iskeyword(k) for k in arguments):
        return ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return f"**{arguments!r}"
