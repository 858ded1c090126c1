"""Pythonic tool calls: `[get_weather(city="Paris"), get_time()]` (Llama 3.2 / 4 style)."""

from __future__ import annotations

import ast
import json

from servelm.text.tool_parsers.base import Event, ToolParser


class PythonicParser(ToolParser):
    """`[get_weather(city="Paris"), get_time()]` (optionally in `<|python_start|>` ...
    `<|python_end|>`): a list of calls with literal keyword arguments, each to one of the
    request's tools. The calls are handed out when the list closes; any other answer is text."""

    START, END = "<|python_start|>", "<|python_end|>"

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
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
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
            except ValueError:
                return None
            if None in args:  # **kwargs
                return None
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        return calls

    def finish(self) -> list[Event]:
        if self.mode in ("start", "list"):
            self._content(self.pending)
        self.pending = ""
        return self._take()
