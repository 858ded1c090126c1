"""Tool calls in a model's answer: Hermes `<tool_call>` JSON, Llama 3.x JSON and pythonic lists.

One parser object follows one answer as its text arrives (`feed`, then `finish`) and returns
events in order: plain text (content) and `ToolCallDelta`s. A call's first delta carries its id
and name with empty arguments; the following ones carry argument fragments, which join to the
call's whole `arguments`. A whole answer is parsed by feeding it at once (`parse`), so a
streamed answer and the same answer in one body agree by construction.

Text that may still turn into markup (a prefix of `<tool_call>`, an opening `{` or `[` where
the format starts a call) is held back until it is known, as stop strings are. A call whose
body turns out not to be one (no name, not JSON) is handed back as text, markup and all.
Arguments in JSON formats are the model's own text of the value, streamed as it arrives; in
the pythonic format they are the JSON of the keyword arguments, sent once the list closes.
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "pythonic")


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


def parse(name: str, text: str, **kw) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer."""
    parser = make_parser(name, **kw)
    return collect([*parser.feed(text), *parser.finish()])


def make_parser(name: str, **kw) -> ToolParser:
    cls = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser}
    if name not in cls:
        raise ValueError(f"unknown tool call parser {name!r}; one of {', '.join(PARSERS)}")
    return cls[name](**kw)


def default_parser(chat_template: str | None) -> str:
    """The format a model calls tools in, judged by its chat template (hermes when unsure:
    the format servelm's own tool prompt asks for)."""
    t = chat_template or ""
    if "<|python_start|>" in t:
        return "pythonic"  # Llama 4
    if "<|python_tag|>" in t or "<|eot_id|>" in t:
        return "llama3_json"
    return "hermes"


def _held(text: str, marker: str) -> int:
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


class _ObjectScanner:
    """Reads one JSON object character by character, noting its top-level fields.

    `fields` maps each finished key to its value's text; `open_key` / `open_value` are the key
    and text so far of the value being read. `state` ends as "done" after the closing brace or
    "error" at the first character that cannot belong to a JSON object.
    """

    def __init__(self) -> None:
        self.state = "start"  # start, key, colon, value, comma, done, error
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.fields: dict[str, str] = {}
        self.open_key: str | None = None
        self.open_value = ""
        self._key = ""
        self.consumed = 0  # characters read, the closing brace included

    def feed(self, text: str) -> None:
        for ch in text:
            if self.state in ("done", "error"):
                return
            self.consumed += 1
            self._step(ch)

    def _step(self, ch: str) -> None:
        s = self.state
        if s == "value":
            self._value_char(ch)
        elif s == "key":
            if self.in_str:
                self._key += ch
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    try:
                        self.open_key = json.loads(self._key)
                        self.state = "colon"
                    except ValueError:
                        self.state = "error"
            elif ch == '"':
                self.in_str, self._key = True, ch
            elif ch == "}" and not self.fields:
                self.state = "done"
            elif not ch.isspace():
                self.state = "error"
        elif ch.isspace():
            return
        elif s == "start":
            self.state = "key" if ch == "{" else "error"
        elif s == "colon":
            self.state, self.open_value = ("value", "") if ch == ":" else ("error", "")
        elif s == "comma":
            self.state = {",": "key", "}": "done"}.get(ch, "error")

    def _value_char(self, ch: str) -> None:
        v = self.open_value
        if not v and ch.isspace():
            return
        if self.in_str:
            self.open_value += ch
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 0:
                    self._end_value()
            return
        if self.depth == 0 and v and v[0] not in "{[" and (ch in ",}" or ch.isspace()):
            self._end_value()  # a number, true, false or null ends at its delimiter
            self._step(ch)
            return
        self.open_value += ch
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth < 0:
                self.state = "error"
            elif self.depth == 0:
                self._end_value()

    def _end_value(self) -> None:
        self.fields[self.open_key or ""] = self.open_value
        self.open_key, self.open_value = None, ""
        self.state = "comma"


class _JsonCallReader:
    """One `{"name": ..., "arguments" | "parameters": {...}}` object, read as it arrives: emits
    the call's start once its name is read, then its arguments' text as it comes."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, parser: ToolParser, check_name: bool) -> None:
        self.parser = parser
        self.check_name = check_name
        self.scan = _ObjectScanner()
        self.text = ""  # everything fed, for handing back a body that is no call
        self.index: int | None = None
        self.sent = 0  # characters of the arguments' text emitted
        self.args_key: str | None = None

    @property
    def started(self) -> bool:
        return self.index is not None

    def feed(self, text: str) -> str:
        """Reads what belongs to the object; returns what follows it. Call `started` and
        `scan.state` for how it went."""
        before = self.scan.consumed
        self.scan.feed(text)
        used = self.scan.consumed - before
        self.text += text[:used]
        self._emit()
        return text[used:]

    def _name(self) -> str | None:
        raw = self.scan.fields.get("name")
        if raw is None:
            return None
        try:
            name = json.loads(raw)
        except ValueError:
            return None
        return name if isinstance(name, str) and name else None

    def _emit(self) -> None:
        scan, p = self.scan, self.parser
        if self.index is None:
            name = self._name()
            if name is None:
                return
            if self.check_name and p.tool_names is not None and name not in p.tool_names:
                return  # no markup says it is a call: only a known tool's name does
            self.index = p._start_call(name)
        args_text, complete = self._args_text()
        if args_text is None:
            if scan.state == "done":  # no arguments given: an empty object
                p._arguments(self.index, "{}")
            return
        if args_text.startswith('"'):  # arguments as a JSON string of JSON: wait, decode
            if complete and not self.sent:
                self.sent = len(args_text)
                try:
                    decoded = json.loads(args_text)
                except ValueError:
                    decoded = args_text
                p._arguments(self.index, decoded if isinstance(decoded, str) else args_text)
            return
        p._arguments(self.index, args_text[self.sent :])
        self.sent = len(args_text)

    def _args_text(self) -> tuple[str | None, bool]:
        scan = self.scan
        for key in self.ARGUMENT_KEYS:
            if key in scan.fields:
                return scan.fields[key], True
        if scan.open_key in self.ARGUMENT_KEYS and scan.state == "value":
            return scan.open_value, False
        return None, False


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending = ""  # text not yet handed out
        self.call: _JsonCallReader | None = None
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
            keep = _held(self.pending, self.START)
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
        self.call = _JsonCallReader(self, check_name=False)
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


class Llama3JsonParser(ToolParser):
    """Llama 3.x: an answer that starts with `<|python_tag|>` or `{` is one or more
    `{"name": ..., "parameters": {...}}` objects (separated by `;` or whitespace); any other
    answer is text. Without the tag, a call must name one of the request's tools."""

    TAG = "<|python_tag|>"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.pending = ""
        self.mode = "start"  # start, call, between, text
        self.call: _JsonCallReader | None = None
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
                    self.mode, self.call = "call", _JsonCallReader(self, not self.tagged)
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
            body, self.pending = self.pending[: self.scanned], self.pending[self.scanned :]
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
