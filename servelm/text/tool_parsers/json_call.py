"""A JSON tool call (`{"name": ..., "arguments": {...}}`) read character by character as it
arrives, for the Hermes and Llama 3 JSON parsers."""

from __future__ import annotations

import json

from servelm.text.tool_parsers.base import ToolParser


class ObjectScanner:
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
                if self._string_ends(ch):
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

    def _string_ends(self, ch: str) -> bool:
        """One more character of an open JSON string (a key or a value): whether it closes it."""
        if self.esc:
            self.esc = False
        elif ch == "\\":
            self.esc = True
        elif ch == '"':
            self.in_str = False
            return True
        return False

    def _value_char(self, ch: str) -> None:
        v = self.open_value
        if not v and ch.isspace():
            return
        if self.in_str:
            self.open_value += ch
            if self._string_ends(ch) and self.depth == 0:
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


class JsonCallReader:
    """One `{"name": ..., "arguments" | "parameters": {...}}` object, read as it arrives: emits
    the call's start once its name is read, then its arguments' text as it comes."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, parser: ToolParser, check_name: bool) -> None:
        self.parser = parser
        self.check_name = check_name
        self.scan = ObjectScanner()
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
