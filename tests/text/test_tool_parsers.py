"""Tool-call parsers on given answers: whole, and streamed in every split (which must agree)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from servelm.text.tool_parsers import (
    ToolCallDelta,
    collect,
    default_parser,
    make_parser,
    parse,
)

TOOLS = ["get_weather", "get_time"]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def whole(name: str, text: str, **kw):
    return parse(name, text, new_id=ids(), tool_names=kw.pop("tool_names", TOOLS), **kw)


def streamed(name: str, pieces: list[str], **kw):
    parser = make_parser(name, new_id=ids(), tool_names=kw.pop("tool_names", TOOLS), **kw)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def splits(text: str, seed: int = 0):
    """The text one character at a time, at every single cut, and in random pieces."""
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_stream_agrees(name: str, text: str, **kw) -> None:
    want = whole(name, text, **dict(kw))
    for pieces in splits(text):
        events = streamed(name, pieces, **dict(kw))
        assert collect(events) == want, pieces
        started = set()
        for e in events:  # a call's first delta has its id and name and no arguments
            if isinstance(e, ToolCallDelta):
                if e.index not in started:
                    assert e.name and e.id and e.arguments == ""
                    started.add(e.index)
                else:
                    assert e.name is None and e.id is None and e.arguments
            else:
                assert e, "no empty content events"


HERMES = [
    # (answer, content, [(name, arguments)])
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me check.\n",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n'
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>\n',
        "",
        [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Oslo"}')],
    ),
    (  # braces, quotes and the end tag inside strings; nested arguments
        '<tool_call>{"name": "get_weather", "arguments": {"q": "a}\\"</tool_call>{", '
        '"n": [1, {"x": null}], "ok": true}}</tool_call>',
        "",
        [("get_weather", '{"q": "a}\\"</tool_call>{", "n": [1, {"x": null}], "ok": true}')],
    ),
    (  # no arguments: an empty object; arguments given as a JSON string: decoded
        '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_weather", '
        '"arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')],
    ),
    (
        "No tools needed: <tool> and <tool_ are text.",
        "No tools needed: <tool> and <tool_ are text.",
        [],
    ),
    (  # a body that is no call is text, tag and all
        "<tool_call>not json</tool_call> then text",
        "<tool_call>not json</tool_call> then text",
        [],
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (  # a call cut short (max_tokens): a call with the arguments so far
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        "Sure. ",
        [("get_weather", '{"city": "Par')],
    ),
    ("Hi <tool_ca", "Hi <tool_ca", []),  # a held tag prefix comes out at the end
    ('<tool_call>{"name": "get_we', '<tool_call>{"name": "get_we', []),  # name never finished
    (  # text after a call is content; whitespace between calls is not
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.',
        "\n\nDone.",
        [("get_time", "{}")],
    ),
    (  # the end tag missing: the call still counts
        '<tool_call>{"name": "get_time", "arguments": {"tz": 5}}',
        "",
        [("get_time", '{"tz": 5}')],
    ),
    (  # scalars at the top level end at their delimiter
        '<tool_call>{"name": "get_time", "arguments": {"a": 1}, "x": 12 }</tool_call>',
        "",
        [("get_time", '{"a": 1}')],
    ),
    (  # unicode survives as written
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}</tool_call>',
        "",
        [("get_weather", '{"city": "Zürich 東京"}')],
    ),
]


@pytest.mark.parametrize("answer,content,calls", HERMES)
def test_hermes(answer, content, calls):
    got_content, got_calls = whole("hermes", answer)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
    assert_stream_agrees("hermes", answer)


def test_hermes_arguments_stream_as_they_arrive():
    parser = make_parser("hermes", new_id=ids())
    assert parser.feed("Ok <tool_") == ["Ok "]  # the tag's start is held back
    assert parser.feed('call>{"name": "get_time", "arg') == [ToolCallDelta(0, "call_0", "get_time")]
    assert parser.feed('uments": {"tz": "U') == [ToolCallDelta(0, arguments='{"tz": "U')]
    assert parser.feed('TC"}}</tool') == [ToolCallDelta(0, arguments='TC"}')]
    assert parser.feed("_call>") == []
    assert parser.finish() == []


def test_hermes_any_name_inside_the_tags():
    _, calls = whole("hermes", '<tool_call>{"name": "other", "arguments": {}}</tool_call>')
    assert [c.name for c in calls] == ["other"]


def test_parallel_false_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> bye'
    )
    for name, answer in [
        ("hermes", text),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
        ),
        ("pythonic", "[get_time(), get_weather(city='Oslo')]"),
    ]:
        content, calls = whole(name, answer, max_calls=1)
        assert (content, [c.name for c in calls]) == ("", ["get_time"]), name
        assert_stream_agrees(name, answer, max_calls=1)


LLAMA = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<|python_tag|>{"name": "get_time", "arguments": {"tz": "UTC"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Oslo"}')],
    ),
    ("  The answer is 4.", "  The answer is 4.", []),
    # JSON that is no call (no name, or a name that is no tool) stays text
    ('{"city": "Paris", "name": "x"}', '{"city": "Paris", "name": "x"}', []),
    ('{"name": "Bob", "parameters": {}}', '{"name": "Bob", "parameters": {}}', []),
    (
        '{"name": "get_time", "parameters": {}}\nThat is all.',
        "That is all.",
        [("get_time", "{}")],
    ),
]


@pytest.mark.parametrize("answer,content,calls", LLAMA)
def test_llama3_json(answer, content, calls):
    got_content, got_calls = whole("llama3_json", answer)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    assert_stream_agrees("llama3_json", answer)


def test_llama3_tag_accepts_any_name():
    _, calls = whole("llama3_json", '<|python_tag|>{"name": "search", "parameters": {}}')
    assert [c.name for c in calls] == ["search"]


PYTHONIC = [
    (
        '[get_weather(city="Paris", days=3, metric=True), get_time()]',
        "",
        [("get_weather", '{"city": "Paris", "days": 3, "metric": true}'), ("get_time", "{}")],
    ),
    (
        "<|python_start|>[get_weather(city='a]b', tags=['x', None])]<|python_end|>",
        "",
        [("get_weather", '{"city": "a]b", "tags": ["x", null]}')],
    ),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[unknown(a=1)]", "[unknown(a=1)]", []),  # not a tool of the request
    ("[get_time(x)]", "[get_time(x)]", []),  # positional arguments: not a call
    ("Just text [get_time()]", "Just text [get_time()]", []),
    ("[get_time(tz='UTC')] done", "done", [("get_time", '{"tz": "UTC"}')]),
    ("[get_time(", "[get_time(", []),
    # a literal that JSON has no form of is no call: the model's text is its answer
    *[
        (f"[get_weather(city={value})]", f"[get_weather(city={value})]", [])
        for value in ('b"Paris"', "{1, 2}", "{[1]: 2}", "{1: 2}", "1e999", "-1e999", "1j")
    ],
    ("[get_time(tz=('UTC', -1.5))]", "", [("get_time", '{"tz": ["UTC", -1.5]}')]),
]


@pytest.mark.parametrize("answer,content,calls", PYTHONIC)
def test_pythonic(answer, content, calls):
    got_content, got_calls = whole("pythonic", answer)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    assert_stream_agrees("pythonic", answer)


def test_arguments_are_json():
    for name, answer in [
        ("hermes", HERMES[2][0]),
        ("llama3_json", LLAMA[1][0]),
        ("pythonic", PYTHONIC[0][0]),
    ]:
        for call in whole(name, answer)[1]:
            assert isinstance(json.loads(call.arguments), dict)


def test_ids_unique_by_default():
    text = '<tool_call>{"name": "get_time"}</tool_call>' * 3
    _, calls = parse("hermes", text)
    assert len({c.id for c in calls}) == 3 and all(c.id.startswith("call_") for c in calls)


def test_default_parser_from_template():
    assert default_parser("{{ '<|eot_id|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert default_parser("{{ '<|python_start|>' }}") == "pythonic"
    assert default_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_parser(None) == "hermes"


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        make_parser("mistral")
