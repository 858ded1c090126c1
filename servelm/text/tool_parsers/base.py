"""What every tool-call parser shares: the events it returns and the calls' bookkeeping."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    index: int  # the call's place among the answer's calls
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The delta as an OpenAI `delta.tool_calls` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        fn = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": fn}


Event = str | ToolCallDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


def collect(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a sequence of events."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, str):
            content.append(e)
        elif e.name is not None:
            calls.append(ToolCall(e.id or "", e.name, e.arguments))
        else:
            calls[e.index].arguments += e.arguments
    return "".join(content), calls


def held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: the bookkeeping of calls and events; subclasses read the text."""

    def __init__(
        self,
        tool_names: Iterable[str] | None = None,
        max_calls: int | None = None,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.tool_names = set(tool_names) if tool_names is not None else None
        self.max_calls = max_calls  # parallel_tool_calls false: 1; later calls are dropped
        self.new_id = new_id
        self.num_calls = 0
        self.events: list[Event] = []

    @classmethod
    def instruction(cls, parallel: bool) -> str:
        """How servelm's own tool prompt asks a model to call functions: in this format, the
        one the parser reads (`parallel`: whether several calls may be made)."""
        raise NotImplementedError

    @classmethod
    def calls_text(cls, calls: list[tuple[str, Any]]) -> str:
        """Calls of an earlier turn, (name, arguments: an object, or text that is no JSON),
        written as a model answers in this format."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.events and isinstance(self.events[-1], str):
            self.events[-1] += text
        else:
            self.events.append(text)

    @property
    def _full(self) -> bool:
        return self.max_calls is not None and self.num_calls >= self.max_calls

    def _start_call(self, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self.events.append(ToolCallDelta(index, self.new_id(), name))
        return index

    def _arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, ToolCallDelta) and last.name is None and last.index == index:
            last.arguments += text
        else:
            self.events.append(ToolCallDelta(index, arguments=text))
