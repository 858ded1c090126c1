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

Each parser's class also says how to ask for its format (`instruction`, `calls_text`), so that
servelm's own tool prompt (`text/tool_prompt.py`) asks for what the answer's parser reads.
"""

from __future__ import annotations

from servelm.text.tool_parsers.base import (
    Event,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
    new_call_id,
)
from servelm.text.tool_parsers.hermes import HermesParser
from servelm.text.tool_parsers.llama3 import Llama3JsonParser
from servelm.text.tool_parsers.pythonic import PythonicParser

PARSERS = ("hermes", "llama3_json", "pythonic")


def parse(name: str, text: str, **kw) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer."""
    parser = make_parser(name, **kw)
    return collect([*parser.feed(text), *parser.finish()])


def make_parser(name: str, **kw) -> ToolParser:
    return parser_class(name)(**kw)


def parser_class(name: str) -> type[ToolParser]:
    """The parser of a format (its class also says how to ask a model for that format)."""
    classes: dict[str, type[ToolParser]] = {
        "hermes": HermesParser,
        "llama3_json": Llama3JsonParser,
        "pythonic": PythonicParser,
    }
    if name not in classes:
        raise ValueError(f"unknown tool call parser {name!r}; one of {', '.join(PARSERS)}")
    return classes[name]


def default_parser(chat_template: str | None) -> str:
    """The format a model calls tools in, judged by its chat template (hermes when unsure)."""
    t = chat_template or ""
    if "<|python_start|>" in t:
        return "pythonic"  # Llama 4
    if "<|python_tag|>" in t or "<|eot_id|>" in t:
        return "llama3_json"
    return "hermes"


__all__ = [
    "PARSERS",
    "Event",
    "HermesParser",
    "Llama3JsonParser",
    "PythonicParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "collect",
    "default_parser",
    "make_parser",
    "new_call_id",
    "parse",
    "parser_class",
]
