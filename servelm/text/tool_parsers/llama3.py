"""Llama 3.x tool calls: `{"name": ..., "parameters": {...}}` objects, after an optional
`<|python_tag|>`."""

from __future__ import annotations

import json
from typing import Any

from servelm.text.tool_parsers.base import Event, ToolParser
from servelm.text.tool_parsers.json_call import JsonCallReader


class Llama3JsonParser(ToolParser):
    """Llama 3.x: an answer that starts with `<|python_tag|>` or `{` is one or more
    `{"name": ..., "parameters": {...}}` objects (separated by `;` or whitespace); any other
    answer is text. Without the tag, a call must name one of the request's tools."""

    TAG = "<|python_tag|>"

    @classmethod
    def instruction(cls, parallel: bool) -> str:
        lines = [
            "To call a function, answer with only its name and arguments as a JSON object, "
            "and no other text:",
            '{"name": "function name", "parameters": {"argument name": "value"}}',
            'Write one such object per call, separated by "; ".'
            if parallel
            else "Call at most one function.",
        ]
        return "\n".join(lines)

    @classmethod
    def calls_text(cls, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls
        )

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending = ""
        self.mode = "start"  # start, call, between, text
        self.call: JsonCallReader | None = None
        self.tagged = False

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        while self.pending:
            if self.mode == "text":
                self._content(self.pending)
                self.pending = ""
            elif self.mode == "dropped":
                self.pending = ""
            elif self.mode in ("start", "between"):
                stripped = self.pending.lstrip()
                if self.mode == "between":
                    stripped = stripped.lstrip(";").lstrip()
                if not stripped or (self.TAG.startswith(stripped) and stripped != self.TAG):
                    break
                if stripped.startswith(self.TAG):
                    self.tagged = True
                    self.pending = stripped[len(self.TAG) :]
                    continue
                if stripped[0] == "{" and not self._full:
                    self.pending = stripped
                    self.mode, self.call = "call", JsonCallReader(self, not self.tagged)
                else:
                    self.mode = "text"
                    if self.num_calls:
                        self.pending = stripped
            else:
                assert self.call is not None
                rest = self.call.feed(self.pending)
                state = self.call.scan.state
                if not self.call.started and state in ("error", "done"):
                    self._content(self.call.text)
                    self.mode, self.call = "text", None
                elif state in ("done", "error"):
                    self.mode, self.call = "between", None
                    if self._full:
                        self.mode, rest = "dropped", ""
                self.pending = rest
                if state not in ("done", "error"):
                    break
        return self._take()

    def finish(self) -> list[Event]:
        if self.mode == "call" and self.call is not None and not self.call.started:
            self._content(self.call.text + self.pending)
        elif self.mode == "start":
            self._content(self.pending)
        self.pending = ""
        return self._take()
