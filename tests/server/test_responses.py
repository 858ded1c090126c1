"""OpenAI's Responses API (`/v1/responses`) through `servelm serve` and the official openai client,
on the scripted model (tests/scripted_model.py: `logit_bias` picks an answer written in advance),
so each output item and each event is known: text, tool calls, continuations by
`previous_response_id`, stored responses, and what is refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.live_server import LiveServer
from tests.scripted_model import SCRIPTS

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
        "required": ["city"],
    },
    "strict": False,  # the script writes the call; nothing to constrain
}


@pytest.fixture(scope="module")
def server(scripted):
    srv = LiveServer(
        scripted[0],
        "--kv-cache-memory",
        "8MiB",
        "--served-model-name",
        "tiny",
        "--responses-store-size",
        "3",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def bias(scripted):
    return lambda script: {"logit_bias": {str(scripted[1][script]): 100}}


def create(client, bias, script: str, **kw):
    kw.setdefault("input", "What is the weather in Paris?")
    return client.responses.create(model="tiny", temperature=0, extra_body=bias(script), **kw)


def stream(client, bias, script: str, **kw):
    """(events, final response) of a streamed response, checking the events' framing."""
    kw.setdefault("input", "What is the weather in Paris?")
    with client.responses.stream(model="tiny", temperature=0, extra_body=bias(script), **kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed"
    return events, final


def test_a_text_answer_whole_and_streamed(client, bias):
    r = create(client, bias, "plain")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "".join(SCRIPTS["plain"])
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert r.usage.output_tokens == len(SCRIPTS["plain"]) + 1  # and the end token
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.completed_at is not None and r.incomplete_details is None

    events, final = stream(client, bias, "plain")
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.usage.output_tokens == r.usage.output_tokens
    item_id = final.output[0].id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}


def test_a_tool_call_after_text(client, bias):
    r = create(client, bias, "one_call", tools=[TOOL])
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Let me look that up.\n"
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is False

    events, final = stream(client, bias, "one_call", tools=[TOOL])
    fc = final.output[1]
    assert (fc.name, fc.arguments) == (call.name, call.arguments)
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert "".join(e.delta for e in args[:-1]) == call.arguments
    assert args[-1].type == "response.function_call_arguments.done"
    assert args[-1].arguments == call.arguments and {e.output_index for e in args} == {1}
    # the message is done before the call begins: items do not interleave
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(
        ("response.output_item.added", 1)
    )


def test_parallel_calls_are_items_of_their_own(client, bias):
    tools = [TOOL, {"type": "function", "name": "get_time", "strict": False}]
    r = create(client, bias, "two_calls", tools=tools)
    assert [(o.type, o.name) for o in r.output] == [
        ("function_call", "get_time"),
        ("function_call", "get_weather"),
    ]
    _, final = stream(client, bias, "two_calls", tools=tools, parallel_tool_calls=False)
    assert [o.name for o in final.output] == ["get_time"]


def test_a_continuation_builds_the_prompt_chat_would(client, bias, server):
    """`previous_response_id` + a function_call_output: the prompt is the conversation as chat
    messages (the stored input and answer, then the tool's output), token for token."""
    first = create(client, bias, "one_call", tools=[TOOL], instructions="Be brief.")
    call = first.output[1]
    second = create(
        client,
        bias,
        "plain",
        tools=[TOOL],
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}],
    )
    assert second.previous_response_id == first.id and second.output_text
    messages = [  # the first's instructions are not carried over (OpenAI's rule)
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look that up.\n",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "22 C"},
    ]
    chat_tool = {"type": "function", "function": {k: TOOL[k] for k in TOOL if k != "type"}}
    counted = httpx.post(
        f"{server.base_url.removesuffix('/v1')}/tokenize",
        json={"messages": messages, "tools": [chat_tool]},
    ).json()["count"]
    assert second.usage.input_tokens == counted
    with_instructions = httpx.post(
        f"{server.base_url.removesuffix('/v1')}/tokenize",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, *messages[:1]],
            "tools": [chat_tool],
        },
    ).json()["count"]
    assert first.usage.input_tokens == with_instructions


def test_stored_responses_can_be_fetched_deleted_and_age_out(client, bias):
    r = create(client, bias, "plain")
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, bias, "plain", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = create(client, bias, "plain", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    kept = [create(client, bias, "plain").id for _ in range(4)]  # the store holds 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept[0])
    assert client.responses.retrieve(kept[-1]).id == kept[-1]


def test_cut_by_max_output_tokens_is_incomplete(client, bias, server):
    r = create(client, bias, "plain", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == SCRIPTS["plain"][0]
    body = {
        "model": "tiny",
        "input": "hi",
        "max_output_tokens": 1,
        "stream": True,
        "temperature": 0,
        **bias("plain"),
    }
    with httpx.stream("POST", f"{server.base_url}/responses", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("event: ")]
    assert lines[-1] == "event: response.incomplete"


def test_logprobs_when_included(client, bias):
    r = create(client, bias, "plain", include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    # each token of the text, and the end token the answer stopped at (as chat's logprobs)
    assert "".join(lp.token for lp in lps) == r.output_text + "<|im_end|>"
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    assert create(client, bias, "plain").output[0].content[0].logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input"),
        ({"input": "hi", "include": ["everything"]}, "include"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
        (
            {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]},
            "tool_choice",
        ),
        ({"input": []}, "input"),
    ],
)
def test_what_servelm_cannot_do_is_refused_by_name(server, body, param):
    r = httpx.post(f"{server.base_url}/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_without_effort_is_accepted(client, bias):
    r = create(client, bias, "plain", reasoning={"effort": None})
    assert r.output_text == "".join(SCRIPTS["plain"])


def test_a_call_cut_by_max_output_tokens_is_incomplete(client, bias):
    r = create(client, bias, "one_call", tools=[TOOL], max_output_tokens=4)
    assert r.status == "incomplete"
    assert r.output[0].status == "completed" and r.output[-1].status == "incomplete"
    _, events = None, None
    with client.responses.stream(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[TOOL],
        temperature=0,
        max_output_tokens=4,
        extra_body=bias("one_call"),
    ) as s:
        events = list(s)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == [i.status for i in r.output]
    assert events[-1].type == "response.incomplete"


def test_max_output_tokens_is_a_cap_and_errors_name_responses_fields(client, bias, server):
    # past the context: cut to the room left (as vLLM's Responses API), not refused
    r = create(client, bias, "plain", max_output_tokens=1_000_000)
    assert r.status == "completed" and r.output_text == "".join(SCRIPTS["plain"])
    url = f"{server.base_url}/responses"
    bad_format = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
    for body, param, named in [
        ({"input": "hi", "text": {"format": bad_format}}, "text", None),
        (
            {"input": "hi", "tools": [{**TOOL, "parameters": {"type": "nope"}}]},
            "tools",
            "tools.0.parameters",
        ),
        ({"input": "x " * 5000}, "input", None),
    ]:
        reply = httpx.post(url, json={"model": "tiny", **body})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param, error
        assert ".function." not in error["message"] and "max_completion" not in error["message"]
        assert named is None or named in error["message"], error


def test_a_tool_of_null_parameters_is_taken(client, bias):
    # (OpenAI's FunctionToolParam: `parameters` may be null; a strict one takes no arguments,
    # which tests/server/test_strict_tools.py checks on the grammar)
    tool = {"type": "function", "name": "get_time", "parameters": None}
    r = create(client, bias, "plain", tools=[tool])
    assert r.output_text == "".join(SCRIPTS["plain"]) and r.tools[0].strict is True


def test_streamed_logprobs_are_the_whole_answers(client, bias):
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    whole = create(client, bias, "plain", **asked).output[0].content[0].logprobs
    _, final = stream(client, bias, "plain", **asked)
    assert [lp.token for lp in final.output[0].content[0].logprobs] == [lp.token for lp in whole]


def test_input_items_of_a_stored_response(client, bias):
    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    r = create(client, bias, "plain", input=items)
    listed = client.responses.input_items.list(r.id)
    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", "Hi"),
        ("system", "Be brief."),
    ]
    oldest = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert oldest.data[0].role == "system" and oldest.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=oldest.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more


def test_a_call_without_its_output_is_refused(client, bias):
    first = create(client, bias, "one_call", tools=[TOOL])
    with pytest.raises(openai.BadRequestError) as e:
        create(
            client,
            bias,
            "plain",
            tools=[TOOL],
            previous_response_id=first.id,
            input="And tomorrow?",
        )
    assert "No tool output found for function call" in e.value.body["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": ["hi"]}, "must be a string or a list of items"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_bad_input_and_metadata_say_what_is_wrong(server, body, says):
    r = httpx.post(f"{server.base_url}/responses", json={"model": "tiny", **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
