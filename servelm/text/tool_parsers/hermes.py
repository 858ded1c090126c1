"""Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5,
SmolLM3, Hermes; servelm's own tool prompt asks for them unless told another format)."""

from __future__ import annotations

import json
from typing import Any

from servelm.text.tool_parsers.base import Event, ToolParser, held
from servelm.text.tool_parsers.json_call import JsonCallReader


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them."""

    START, END = "<tool_call>", "</tool_call>"

    @classmethod
    def instruction(cls, parallel: bool) -> str:
        lines = [
            "To call a function, answer with its name and arguments as a JSON object between "
            "<tool_call> and </tool_call>:",
            "<tool_call>",
            '{"name": "function name", "arguments": {"argument name": "value"}}',
            "</tool_call>",
            "Write one such block per call." if parallel else "Call at most one function.",
        ]
        return "\n".join(lines)

    @classmethod
    def calls_text(cls, calls: list[tuple[str, Any]]) -> str:
        bodies = [json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls]
        return "\n".join(f"{cls.START}\n{body}\n{cls.END}" for body in bodies)

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending = ""  # text not yet handed out
        self.call: JsonCallReader | None = None
        self.after_call = False  # between the end of a call's JSON and its end tag
        self.dropped = False  # parallel_tool_calls false and a call made: the rest is dropped

    def feed(self, text: str) -> list[Event]:
        if self.dropped:
            return self._take()
        self.pending += text
        while self.pending:
            if self.call is not None:
                rest = self.call.feed(self.pending)
                state = self.call.scan.state
                if not self.call.started and state in ("error", "done"):
                    self._give_back(rest)
                    continue
                # (a call already under way that stops being JSON ends where it stops)
                self.pending = rest
                if state not in ("done", "error"):
                    break
                self.call, self.after_call = None, True
                continue
            if self.after_call:  # the end tag, after optional whitespace
                stripped = self.pending.lstrip()
                if not stripped or (self.END.startswith(stripped) and stripped != self.END):
                    break
                self.after_call = False
                if stripped.startswith(self.END):
                    self.pending = stripped[len(self.END) :]
                continue
            if not self._text():
                break
        return self._take()

    def _text(self) -> bool:
        """Hands out the text before a start tag; True if a call starts (more to read)."""
        pos = self.pending.find(self.START)
        if pos < 0:
            keep = held(self.pending, self.START)
            if self.num_calls:  # whitespace between or after calls is no content
                body = self.pending[: len(self.pending) - keep]
                if not body.strip():
                    return False
            cut = len(self.pending) - keep
            self._content(self.pending[:cut])
            self.pending = self.pending[cut:]
            return False
        before = self.pending[:pos]
        if not (self.num_calls and not before.strip()):
            self._content(before)
        self.pending = self.pending[pos + len(self.START) :]
        if self._full:  # parallel_tool_calls false: the rest of the answer is dropped
            self.pending, self.dropped = "", True
            return False
        self.call = JsonCallReader(self, check_name=False)
        return True

    def _give_back(self, rest: str) -> None:
        """A body that is no call: its text, tag included, is content after all."""
        assert self.call is not None
        self._content(self.START + self.call.text)
        self.call = None
        self.pending = rest

    def finish(self) -> list[Event]:
        if self.dropped:
            pass
        elif self.call is not None and not self.call.started:
            self._content(self.START + self.call.text + self.pending)
        elif self.call is None and not self.after_call:
            if not (self.num_calls and not self.pending.strip()):
                self._content(self.pending)
        self.pending, self.call = "", None
        return self._take()
