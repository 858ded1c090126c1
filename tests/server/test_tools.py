"""Tool calling through `servelm serve` and the official openai client, on a model whose greedy
answers are scripted (tests/scripted_model.py): `logit_bias` picks the script, so each answer,
and each way of splitting it into tokens, is known."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.live_server import LiveServer
from tests.scripted_model import script_text

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(scripted):
    srv = LiveServer(scripted[0], "--kv-cache-memory", "8MiB", "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ask(client, scripted):
    first = scripted[1]

    def ask(script: str, stream: bool = False, **kw):
        kw.setdefault("tools", TOOLS)
        return client.chat.completions.create(
            model="tiny",
            messages=kw.pop("messages", ASK),
            temperature=0,
            logit_bias={str(first[script]): 100},
            stream=stream,
            **kw,
        )

    return ask


def streamed(chunks) -> dict:
    """The chunks joined, checking the shape of every tool-call delta on the way."""
    content, calls, reasons, seen = "", {}, [], []
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        seen.append(delta)
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
            assert delta.content is None and delta.tool_calls is None  # the last chunk: empty
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call: id, type, name, no arguments
                assert tc.id and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None and tc.function.arguments
                calls[tc.index]["arguments"] += tc.function.arguments
    assert len(reasons) == 1
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "reason": reasons[0]}


def whole(r) -> dict:
    (choice,) = r.choices
    m = choice.message
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in m.tool_calls or []
    ]
    return {"content": m.content, "calls": calls, "reason": choice.finish_reason}


def same_but_ids(a: dict, b: dict) -> None:
    strip = lambda d: {**d, "calls": [{**c, "id": None} for c in d["calls"]]}  # noqa: E731
    assert strip(a) == strip(b)


def test_text_then_a_call(ask):
    r = whole(ask("one_call"))
    assert r["content"] == "Let me look that up.\n" and r["reason"] == "tool_calls"
    (call,) = r["calls"]
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert call["arguments"] == '{"city": "Paris", "unit": "celsius"}'
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    s = streamed(ask("one_call", stream=True))
    same_but_ids(s, r)
    assert "<tool" not in s["content"]


def test_parallel_calls_whole_and_streamed(ask):
    r = whole(ask("two_calls"))
    assert r["content"] is None and r["reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in r["calls"]] == [
        ("get_time", {"tz": "UTC"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c["id"] for c in r["calls"]}) == 2
    s = streamed(ask("two_calls", stream=True))
    assert s["content"] == ""
    same_but_ids(s, {**r, "content": ""})


def test_parallel_tool_calls_false_keeps_one(ask):
    for stream in (False, True):
        r = ask("two_calls", stream=stream, parallel_tool_calls=False)
        r = streamed(r) if stream else whole(r)
        assert [c["name"] for c in r["calls"]] == ["get_time"] and r["reason"] == "tool_calls"


def test_text_answers_and_a_held_tag_prefix(ask):
    for script in ("plain", "tag_prefix"):
        r = whole(ask(script))
        assert r == {"content": script_text(script), "calls": [], "reason": "stop"}
        s = streamed(ask(script, stream=True))
        assert s == {"content": script_text(script), "calls": [], "reason": "stop"}


def test_tool_choice_none_and_no_tools_leave_the_text_alone(ask):
    want = {"content": script_text("one_call"), "calls": [], "reason": "stop"}
    assert whole(ask("one_call", tool_choice="none")) == want
    assert whole(ask("one_call", tools=openai.NOT_GIVEN)) == want
    assert streamed(ask("one_call", tool_choice="none", stream=True)) == want


# Forced calls: no script, the grammar writes the answer. The scripted model's logits are all
# zero off its scripts, so greedy takes the first token the grammar allows at each step: the
# schemas are finite (an enum, no parameters), or a string would run to max_tokens.
UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.parametrize(
    "choice,names",
    [
        ("required", {"set_unit", "get_time"}),
        ({"type": "function", "function": {"name": "set_unit"}}, {"set_unit"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_required_and_named_tool_choice_force_valid_calls(client, choice, names):
    kw = dict(messages=ASK, tools=[UNIT, TIME], tool_choice=choice, temperature=0, max_tokens=300)
    kw["model"] = "tiny"
    for parallel in (True, False):
        r = whole(client.chat.completions.create(parallel_tool_calls=parallel, **kw))
        assert r["reason"] == "tool_calls" and r["content"] is None and r["calls"]
        assert len(r["calls"]) == 1 or (parallel and choice == "required")
        for call in r["calls"]:
            assert call["name"] in names
            valid = {"set_unit": [{"unit": "celsius"}, {"unit": "fahrenheit"}], "get_time": [{}]}
            assert json.loads(call["arguments"]) in valid[call["name"]]  # what the schemas allow
        s = streamed(
            client.chat.completions.create(parallel_tool_calls=parallel, stream=True, **kw)
        )
        same_but_ids(s, {**r, "content": ""})


def test_parallel_tool_calls_false_ends_a_forced_answer_after_one_call(client, scripted):
    from servelm.text.tokenizer import TextTokenizer

    # A newline after a call would start the next one: biased up, it always wins where allowed.
    (newline,) = TextTokenizer(scripted[0]).encode("\n", False)
    kw = dict(messages=ASK, tools=[TIME], tool_choice="required", temperature=0, max_tokens=150)
    kw.update(model="tiny", logit_bias={str(newline): 100})
    one = whole(client.chat.completions.create(parallel_tool_calls=False, **kw))
    assert one["reason"] == "tool_calls" and [c["name"] for c in one["calls"]] == ["get_time"]
    many = whole(client.chat.completions.create(**kw))
    assert many["reason"] == "length" and len(many["calls"]) > 2
    assert {c["name"] for c in many["calls"]} == {"get_time"}
    # a named function is called once, whatever parallel_tool_calls says
    kw["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    named = whole(client.chat.completions.create(**kw))
    assert named["reason"] == "tool_calls" and [c["name"] for c in named["calls"]] == ["get_time"]


def test_forced_calls_of_pydantic_tools_with_defs_and_of_tools_without_parameters(client):
    # pydantic's schemas point into their own $defs (nested models, enums); a function that
    # leaves out `parameters` takes none (OpenAI), not any arguments at all
    import enum

    from pydantic import BaseModel, Field

    class Unit(str, enum.Enum):
        c = "celsius"
        f = "fahrenheit"

    class Place(BaseModel):  # short: this model writes on as long as a schema lets it
        city: str = Field(max_length=4)

    class Forecast(BaseModel):
        place: Place
        unit: Unit
        days: list[int] = Field(max_length=2)

    tool = openai.pydantic_function_tool(Forecast)
    assert "$defs" in tool["function"]["parameters"]
    bare = {"type": "function", "function": {"name": "now"}}
    kw = dict(model="tiny", messages=ASK, temperature=0, max_tokens=400)
    r = whole(client.chat.completions.create(tools=[tool, bare], tool_choice="required", **kw))
    assert r["reason"] == "tool_calls" and r["calls"], r
    for call in r["calls"]:
        if call["name"] == "Forecast":
            Forecast.model_validate_json(call["arguments"])
        else:
            assert call == {**call, "name": "now", "arguments": "{}"}
    only = {"type": "function", "function": {"name": "now"}}
    r = whole(client.chat.completions.create(tools=[tool, bare], tool_choice=only, **kw))
    assert [(c["name"], c["arguments"]) for c in r["calls"]] == [("now", "{}")]


def test_a_forced_answer_cut_short_has_no_text(client):
    # max_tokens ends the answer inside the markup, before or after the call's name is read:
    # the markup is not the model's text, so it never reaches `content`.
    kw = dict(model="tiny", messages=ASK, tools=[UNIT], tool_choice="required", temperature=0)
    names = set()
    for max_tokens in (1, 2, 5, 12, 20, 27, 29, 33, 40):  # one character a token
        r = whole(client.chat.completions.create(max_tokens=max_tokens, **kw))
        assert r["reason"] == "length" and r["content"] is None
        names.update(c["name"] for c in r["calls"])
        s = streamed(client.chat.completions.create(max_tokens=max_tokens, stream=True, **kw))
        same_but_ids(s, {**r, "content": ""})
    assert names == {"set_unit"}  # the later cuts fall after the name


def test_forced_tool_choice_refuses_a_second_constraint_and_bad_schemas(client):
    kw = dict(model="tiny", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="forces a tool call") as info:
        client.chat.completions.create(tools=[UNIT], response_format={"type": "json_object"}, **kw)
    assert info.value.body["param"] == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(tools=[bad], **kw)
    assert info.value.body["param"] == "tools"


def test_every_tool_schema_is_checked_whatever_the_tool_choice(client, server):
    # a schema that does not compile is refused up front (OpenAI's rule), named, in one line
    params = {"type": "object", "properties": {"q": {"type": "strin"}}}
    bad = {"type": "function", "function": {"name": "look", "parameters": params}}
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model="tiny", messages=ASK, tools=[TIME, bad], max_tokens=2)
    for choice in ("auto", "required", named):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(tool_choice=choice, **kw)
        assert info.value.body["param"] == "tools"
        message = info.value.body["message"]
        assert message == "tools.1.function.parameters: invalid schema: Invalid type: strin"
    # arguments are an object: a schema of another type is refused (a forced call's arguments
    # would not even be JSON), on /tokenize too
    say = {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}
    for choice in ("auto", {"type": "function", "function": {"name": "say"}}):
        with pytest.raises(openai.BadRequestError, match="tools.0.function.parameters must be"):
            client.chat.completions.create(**{**kw, "tools": [say]}, tool_choice=choice)
    body = {"model": "tiny", "messages": ASK, "tools": [say]}
    assert httpx.post(server.url + "/tokenize", json=body).status_code == 400


def test_a_property_named_like_a_keyword_is_a_property(client):
    # "default", "examples": names of properties here, not keywords whose values are literals;
    # the $ref inside is rebased, the integer bounded, as any other property's
    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str = Field(max_length=4)

    class Trip(BaseModel):
        default: Place
        examples: int

    tool = openai.pydantic_function_tool(Trip)
    assert tool["function"]["parameters"]["properties"]["default"] == {"$ref": "#/$defs/Place"}
    r = whole(
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=300,
        )
    )
    assert r["reason"] == "tool_calls" and [c["name"] for c in r["calls"]] == ["Trip"], r
    trip = Trip.model_validate_json(r["calls"][0]["arguments"])
    assert abs(trip.examples) <= 2**53 - 1


def test_tools_reach_the_prompt_unless_none(ask):
    with_tools = ask("plain").usage.prompt_tokens
    assert (
        ask("plain", tool_choice="none").usage.prompt_tokens
        == ask("plain", tools=openai.NOT_GIVEN).usage.prompt_tokens
    )
    assert with_tools > ask("plain", tools=openai.NOT_GIVEN).usage.prompt_tokens + 50


def test_cut_by_max_tokens(ask):
    r = whole(ask("one_call", max_tokens=4))
    assert r["reason"] == "length" and r["content"] == "Let me look that up.\n"
    assert [(c["name"], c["arguments"]) for c in r["calls"]] == [("get_weather", '{"city": ')]
    same_but_ids(streamed(ask("one_call", max_tokens=4, stream=True)), r)


def test_n_choices_each_with_their_calls(ask):
    r = ask("two_calls", n=2)
    ids = [c.id for choice in r.choices for c in choice.message.tool_calls]
    assert len(ids) == 4 and len(set(ids)) == 4
    chunks = list(ask("two_calls", n=2, stream=True))
    for i in range(2):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        got = streamed(mine)
        assert [c["name"] for c in got["calls"]] == ["get_time", "get_weather"]


def test_the_conversation_continues_after_a_tool_result(ask, server):
    r = ask("one_call")
    call = r.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r2 = whole(ask("plain", messages=history))
    assert r2 == {"content": script_text("plain"), "calls": [], "reason": "stop"}
    # the call and its result are in the prompt, as the tool prompt's text
    body = {"model": "tiny", "messages": history}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": ids}).json()
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        in (prompt["prompt"])
    )
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt["prompt"]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": openai.NOT_GIVEN}, "tool_choice"),
    ],
)
def test_malformed_tool_fields_are_400s_naming_them(ask, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        ask("plain", **kw)
    assert info.value.body["param"] == param


@pytest.mark.parametrize(
    "calls,where",
    [
        (5, "messages.1.tool_calls must be a list"),
        ({"id": "c1", "function": {"name": "get_time"}}, "messages.1.tool_calls must be a list"),
        (["oops"], "messages.1.tool_calls.0 must be an object"),
        ([None], "messages.1.tool_calls.0 must be an object"),
        ([{"id": "c1", "function": "get_time"}], "messages.1.tool_calls.0.function must be"),
        ([{"function": {"arguments": "{}"}}], "messages.1.tool_calls.0.function.name must be"),
        (
            [{"function": {"name": "get_time", "arguments": 5}}],
            "messages.1.tool_calls.0.function.arguments must be",
        ),
    ],
)
def test_malformed_tool_calls_in_the_conversation_are_400s_naming_them(server, calls, where):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = {"model": "tiny", "messages": history, "tools": TOOLS, "max_tokens": 2}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and error["message"].startswith(where), error
    # arguments as an object (not a JSON string) are taken, as templates read them
    history[1]["tool_calls"] = [{"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    assert httpx.post(server.url + "/tokenize", json=body).status_code == 200


@pytest.mark.parametrize(
    "parser,script,calls",
    [
        ("llama3_json", "llama", [("get_weather", '{"city": "Rome"}')]),
        (
            "pythonic",
            "pythonic",
            [("get_weather", '{"city": "Lima"}'), ("get_time", '{"tz": "PET"}')],
        ),
    ],
)
def test_other_formats_with_tool_call_parser(scripted, parser, script, calls):
    srv = LiveServer(scripted[0], "--kv-cache-memory", "8MiB", "--tool-call-parser", parser)
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
        kw = dict(
            model=client.models.list().data[0].id,
            messages=ASK,
            tools=TOOLS,
            temperature=0,
            logit_bias={str(scripted[1][script]): 100},
        )
        r = whole(client.chat.completions.create(**kw))
        assert [(c["name"], c["arguments"]) for c in r["calls"]] == calls
        assert r["content"] is None and r["reason"] == "tool_calls"
        same_but_ids(
            streamed(client.chat.completions.create(stream=True, **kw)), {**r, "content": ""}
        )
        # servelm's own tool prompt (this template renders none) asks for this parser's format
        body = {"messages": ASK, "tools": TOOLS}
        ids = httpx.post(srv.url + "/tokenize", json=body, timeout=30).json()["tokens"]
        prompt = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
        assert "<tool_call>" not in prompt["prompt"]
        # hermes markup is plain text to these parsers
        kw["logit_bias"] = {str(scripted[1]["one_call"]): 100}
        assert whole(client.chat.completions.create(**kw))["content"] == script_text("one_call")
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_default_model_makes_valid_forced_calls(default_model_dir):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
    srv = LiveServer(default_model_dir, "--served-model-name", "default")
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for i, (choice, stream) in enumerate(
            [("required", False), ("required", True), (named, False), (named, True)]
        ):
            r = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Is it raining in Lisbon?"}],
                tools=[weather, TIME],
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=1.0,
                seed=i,
                max_tokens=200,
                stream=stream,
            )
            got = streamed(r) if stream else whole(r)
            assert got["reason"] == "tool_calls" and len(got["calls"]) == 1, got
            (call,) = got["calls"]
            args = json.loads(call["arguments"])
            if call["name"] == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
                assert isinstance(args["city"], str) and len(args["city"]) <= 40
            else:
                assert choice == "required" and (call["name"], args) == ("get_time", {})
    finally:
        srv.stop()
