"""`strict: true` tools under `tool_choice: "auto"`: the answer is free text or Hermes calls, and
a strict tool's arguments match its schema once the model opens a call (OpenAI's promise).

The grammar itself on the tiny model's tokenizer; the real server on the scripted model (its
greedy answers known, tests/scripted_model.py) and on the default model with the official
openai client, where the free-running answer breaks the schema and the strict one does not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from servelm.engine.sampling_params import StructuredOutput
from servelm.server.serving_tools import auto_tool_grammar
from servelm.structured.compiler import GrammarCompiler
from servelm.text.tokenizer import TextTokenizer
from tests.live_server import LiveServer
from tests.scripted_model import script_text
from tests.server.test_tools import streamed, whole

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def weather(strict: bool | None, params=CITY) -> dict:
    fn = {"name": "get_weather", "description": "The weather in a city.", "parameters": params}
    return {"type": "function", "function": fn if strict is None else {**fn, "strict": strict}}


LOOSE = {"type": "function", "function": {"name": "note", "parameters": CITY}}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


GOOD = call("get_weather", '{"city": "Oslo", "days": 2}')


# -- the grammar, on the tiny model's tokenizer -------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return TextTokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def accepts(tiny_model_dir, tok):
    """Whether a grammar's matcher follows `text` token by token, and then allows the end."""
    compiler = GrammarCompiler(tiny_model_dir / "tokenizer.json", tok.vocab_size)
    eos = frozenset(tok.eos_token_ids)

    def accepts(grammar: str, text: str) -> bool:
        template = compiler.submit(StructuredOutput("grammar", grammar), eos).result(30)
        matcher = template.deep_copy()
        ids = tok.encode(text, add_special_tokens=False)
        if not all(matcher.consume_token(t) for t in ids):
            return False
        return all(matcher.consume_token(t) for t in list(eos)[:1])  # the end, allowed

    return accepts


def test_no_strict_tool_no_grammar():
    assert auto_tool_grammar([weather(None), weather(False), LOOSE], True) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_free_text_or_valid_calls(accepts, parallel):
    grammar = auto_tool_grammar([weather(True), LOOSE], parallel)
    for text in ("", "Just text, with <tool and </tool_call> but no call.", GOOD, "Sure.\n" + GOOD):
        assert accepts(grammar, text), text
    # a strict tool's arguments match its schema; another tool's are any object
    assert accepts(grammar, call("note", '{"city": "Paris", "days": 30, "x": [1]}'))
    for bad in (
        call("get_weather", '{"city": "Paris", "days": 2}'),  # not in the enum
        call("get_weather", '{"city": "Oslo", "days": 7}'),  # past the maximum
        call("get_weather", '{"city": "Oslo"}'),  # a required argument missing
        call("lookup", "{}"),  # no such tool
        call("note", '"text"'),  # arguments are an object
        "<tool_call>\nnot JSON\n</tool_call>",
        "Text <tool_call>" + GOOD[len("<tool_call>") :] + " and text after the call.",
    ):
        assert not accepts(grammar, bad), bad
    assert accepts(grammar, GOOD + "\n" + GOOD) == parallel


def test_a_strict_tools_objects_take_only_what_they_name(accepts):
    # OpenAI's strict mode: no properties beyond those named, unless a schema says otherwise
    # (a tool of no parameters let the model invent some)
    bare = {
        "type": "function",
        "function": {
            "name": "get_time",
            "strict": True,
            "parameters": {"type": "object", "properties": {}},
        },
    }
    grammar = auto_tool_grammar([bare, weather(True)], True)
    assert accepts(grammar, call("get_time", "{}"))
    assert not accepts(grammar, call("get_time", '{"tz": "UTC"}'))
    assert not accepts(grammar, call("get_weather", '{"city": "Oslo", "days": 2, "x": 1}'))
    open_ = {"type": "object", "properties": {}, "additionalProperties": True}
    grammar = auto_tool_grammar([weather(True, open_)], True)
    assert accepts(grammar, call("get_weather", '{"tz": "UTC"}'))


def test_with_a_json_answer_the_answer_is_that_json_or_calls(accepts):
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    grammar = auto_tool_grammar([weather(True)], True, answer)
    assert accepts(grammar, '{"ok": true}') and accepts(grammar, GOOD)
    for bad in ('{"ok": 1}', "Sure.", "Sure.\n" + GOOD, '{"ok": true}' + GOOD):
        assert not accepts(grammar, bad), bad


# -- the server, on the scripted model ----------------------------------------------------


@pytest.fixture(scope="module")
def client(scripted):
    srv = LiveServer(scripted[0], "--kv-cache-memory", "8MiB", "--served-model-name", "tiny")
    yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def ask(client, scripted, script: str, tools: list, stream: bool = False, **kw):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        temperature=0,
        logit_bias={str(scripted[1][script]): 100},
        max_tokens=100,
        stream=stream,
        **kw,
    )


def test_a_strict_tools_call_matches_its_schema(client, scripted):
    # The script calls get_weather for Paris, which this schema's enum does not hold: as
    # written without `strict` (the parser reads what the model wrote) ...
    loose = whole(ask(client, scripted, "one_call", [weather(None)]))
    (wrote,) = loose["calls"]
    assert json.loads(wrote["arguments"])["city"] == "Paris"
    # ... and with it, the grammar bends the call into the schema from there on
    for stream in (False, True):
        r = ask(client, scripted, "one_call", [weather(True), LOOSE], stream=stream)
        got = streamed(r) if stream else whole(r)
        assert got["content"] == "Let me look that up.\n" and got["reason"] == "tool_calls", got
        (made,) = got["calls"]
        assert made["name"] == "get_weather"
        jsonschema.validate(json.loads(made["arguments"]), CITY)


def test_free_text_stays_content_under_strict_tools(client, scripted):
    for script in ("plain", "tag_prefix"):
        for stream in (False, True):
            r = ask(client, scripted, script, [weather(True)], stream=stream)
            got = streamed(r) if stream else whole(r)
            assert got == {"content": script_text(script), "calls": [], "reason": "stop"}


def test_strict_tools_with_a_structured_output(client, scripted):
    # a JSON answer is the answer's grammar beside the calls'; another kind is refused by name
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    got = whole(ask(client, scripted, "one_call", [weather(True)], response_format=fmt))
    assert got["content"] is None and got["reason"] == "tool_calls", got  # no text before it
    (made,) = got["calls"]
    jsonschema.validate(json.loads(made["arguments"]), CITY)
    # "{" biased up: the JSON answer, as content
    (brace,) = TextTokenizer(scripted[0]).encode("{", False)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Is it fine?"}],
        tools=[weather(True)],
        response_format=fmt,
        temperature=0,
        logit_bias={str(brace): 100},
        max_tokens=100,
    )
    got = whole(r)
    assert got["calls"] == [] and got["reason"] == "stop", got
    jsonschema.validate(json.loads(got["content"]), schema)
    with pytest.raises(openai.BadRequestError, match="strict tools under tool_choice auto") as e:
        ask(client, scripted, "plain", [weather(True)], extra_body={"guided_regex": "[a-z]+"})
    assert e.value.body["param"] == "tools"
    # not strict: the structured output alone, as before
    r = ask(client, scripted, "plain", [weather(False)], extra_body={"guided_regex": "[a-z]+"})
    assert r.choices[0].message.content.isalpha()


def test_strict_is_a_boolean(client, scripted):
    with pytest.raises(openai.BadRequestError, match=r"tools.0.function.strict must be") as e:
        ask(client, scripted, "plain", [{**weather(None), "function": {"name": "f", "strict": 1}}])
    assert e.value.body["param"] == "tools"


# -- the default model --------------------------------------------------------------------


def few_shot(question: str) -> list[dict]:
    """Three turns in which the assistant called get_weather with the user's city and days as
    said: SmolLM2-135M then calls it for the next question too, days and city as asked."""
    messages: list[dict] = []
    for i, (city, days) in enumerate([("Rome", 2), ("Oslo", 1), ("Lima", 3)]):
        arguments = json.dumps({"city": city, "days": days})
        messages += [
            {"role": "user", "content": f"Weather in {city} for {days} days?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
        ]
    return [*messages, {"role": "user", "content": question}]


@pytest.mark.slow
def test_the_default_model_keeps_a_strict_tools_schema(default_model_dir):
    srv = LiveServer(default_model_dir, "--served-model-name", "default", startup_timeout=300)
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)

        def answer(question: str, strict: bool | None, stream: bool = False) -> dict:
            r = client.chat.completions.create(
                model="default",
                messages=few_shot(question),
                tools=[weather(strict)],
                temperature=0,
                max_tokens=100,
                stream=stream,
            )
            return streamed(r) if stream else whole(r)

        for question in ("Weather in Tokyo for 30 days?", "Weather in Lisbon for 10 days?"):
            # free-running, the model calls with the city and the days asked: neither fits
            (wrote,) = answer(question, None)["calls"]
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(json.loads(wrote["arguments"]), CITY)
            for stream in (False, True):
                got = answer(question, True, stream)
                assert got["reason"] == "tool_calls" and len(got["calls"]) == 1, got
                (made,) = got["calls"]
                assert made["name"] == "get_weather"
                jsonschema.validate(json.loads(made["arguments"]), CITY)
        # a question no tool answers: text, ended by the model
        for stream in (False, True):
            got = answer("Tell me a joke.", True, stream)
            assert got["calls"] == [] and got["content"] and got["reason"] == "stop", got
    finally:
        srv.stop()
