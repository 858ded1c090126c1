"""Structured outputs through `servelm serve` and the official openai client, on the default
model: `parse` with a pydantic model at temperature 1.0, json_object, regex, choice and grammar
requests on both endpoints, 400s that name the parameter (the server serving on), and a batch
mixing constrained and plain requests whose plain answers are those of a run without them."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import LiveServer

MODEL = "default"


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str
    species: Literal["cat", "dog", "bird"]
    age: int | None = None


class Person(BaseModel):
    name: str
    age: int
    favourite_color: Color
    # (bounded: at temperature 1 the small model, left to itself, may list pets until the token
    # limit on some seeds, and which seeds depends on the CPU's rounding; maxItems stops it, and
    # `parse` validates the bound)
    pets: list[Pet] = Field(max_length=4)
    nickname: str | None = None


EXAMPLE = (
    '{"name": "Ann Lee", "age": 31, "favourite_color": "green", "pets": [{"name": "Rex", '
    '"species": "dog", "age": 4}], "nickname": null}'
)


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = LiveServer(default_model_dir, "--served-model-name", MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def chat(client, content: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def test_parse_a_nested_pydantic_model_20_of_20_at_temperature_1(client):
    def one(i: int):
        return client.chat.completions.parse(
            model=MODEL,
            messages=[
                {"role": "system", "content": f"Answer in JSON, like {EXAMPLE}"},
                {"role": "user", "content": f"Describe person number {i} and their pets."},
            ],
            response_format=Person,
            temperature=1.0,
            seed=i,
            max_tokens=800,
        )

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(one, range(20)))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content


def test_json_object(client):
    reply = chat(client, "Give me a JSON object about Paris.", temperature=1.0, seed=1,
                 max_tokens=300, response_format={"type": "json_object"})  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_regex_choice_grammar_on_chat_and_completions(client):
    regex = r"\d{3}-[A-Z]{2}"
    reply = chat(
        client, "A code?", max_tokens=20, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, reply.choices[0].message.content, re.ASCII)  # \d: 0-9
    assert reply.choices[0].finish_reason == "stop"

    reply = chat(client, "Is the sky blue?", logprobs=True, top_logprobs=5,
                 extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert reply.choices[0].message.content in ("yes", "no")
    for entry in reply.choices[0].logprobs.content:  # alternatives the grammar allows only
        assert entry.top_logprobs and all(t.logprob > -1e30 for t in entry.top_logprobs)

    grammar = 'start: "(" num " " op " " num ")"\nop: "+" | "-"\nnum: /[0-9]{1,2}/'
    done = client.completions.create(
        model=MODEL, prompt="An arithmetic expression:", max_tokens=30, temperature=1.0, seed=3,
        extra_body={"guided_grammar": grammar},
    )  # fmt: skip
    assert re.fullmatch(r"\(\d{1,2} [+-] \d{1,2}\)", done.choices[0].text)

    done = client.completions.create(
        model=MODEL, prompt="Name a colour:", max_tokens=10, n=3, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )  # fmt: skip
    assert all(c.text in ("red", "green", "blue") for c in done.choices)

    done = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=100, stream=True,
        extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"], "additionalProperties": False}},
    )  # fmt: skip
    assert json.loads("".join(c.choices[0].text for c in done if c.choices)).keys() == {"a"}


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),  # fmt: skip
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {}}, "response_format"),  # OpenAI's type is required
        ({"response_format": {"json_schema": {"name": "x", "schema": {}}}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_invalid_specs_are_400s_naming_the_parameter(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "hi", max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    reply = chat(client, "hi", max_tokens=5)  # the server serves on
    assert reply.choices[0].message.content is not None


PLAIN = [f"Tell me about the number {n}." + " Be concrete." * n for n in range(1, 7)]


def plain(client, prompt: str) -> list[str]:
    reply = chat(client, prompt, temperature=0, max_tokens=96, logprobs=True,
                 extra_body={"ignore_eos": True})  # fmt: skip
    return [t.token for t in reply.choices[0].logprobs.content]


def test_mixed_batch_plain_answers_are_unchanged(client):
    with ThreadPoolExecutor(len(PLAIN)) as pool:
        want = list(pool.map(lambda p: plain(client, p), PLAIN))

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}  # fmt: skip

    def constrained(i: int) -> tuple[str, str]:
        time.sleep(0.2 * i)  # they join (and leave) while the plain answers are being decoded
        reply = chat(client, f"A city and a number, as JSON ({i}).", temperature=1.0, seed=i,
                     max_tokens=200, response_format={"type": "json_schema",
                                      "json_schema": {"name": "c", "schema": schema}})  # fmt: skip
        return reply.choices[0].finish_reason, reply.choices[0].message.content

    with ThreadPoolExecutor(len(PLAIN) * 2) as pool:
        jobs = [pool.submit(constrained, i) for i in range(len(PLAIN))]
        plain_jobs = [pool.submit(plain, client, p) for p in PLAIN]
        got = [j.result() for j in plain_jobs]
        mixed = [j.result() for j in jobs]
    assert got == want
    for reason, text in mixed:
        assert reason == "stop", text
        assert json.loads(text).keys() == {"city", "n"}
