"""vLLM's request fields that servelm does not implement are refused by name, never quietly
ignored (a client porting from vLLM would get an answer that breaks what it asked for); their
defaults, which ask for nothing, are accepted, and fields no server defines stay ignored."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}

REFUSED = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("early_stopping", True),
    ("bad_words", [" the"]),
    ("allowed_token_ids", [5, 6]),
    ("truncate_prompt_tokens", 2),
    ("typical_p", 0.5),
    ("spaces_between_special_tokens", False),
    ("logits_processors", ["my.module.Processor"]),
    ("return_tokens_as_token_ids", True),
    ("guided_whitespace_pattern", " "),
]
ACCEPTED = [
    ("use_beam_search", False),
    ("length_penalty", 1),
    ("bad_words", []),
    ("typical_p", 1.0),
    ("spaces_between_special_tokens", True),
    ("allowed_token_ids", None),
    ("some_other_clients_field", {"x": 1}),  # nobody's: ignored, as before
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_refused(r: httpx.Response, name: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("name, value", REFUSED)
@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_unimplemented_vllm_fields_are_refused_by_name(server, path, body, name, value):
    assert_refused(post(server, path, {**body, name: value}), name)


@pytest.mark.parametrize("name, value", ACCEPTED)
@pytest.mark.parametrize(
    "path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_their_defaults_and_other_fields_are_accepted(server, path, body, name, value):
    r = post(server, path, {**body, name: value})
    assert r.status_code == 200, r.text


def test_chat_prompt_building_fields(server):
    # vLLM's ways to build a chat prompt that servelm's template rendering does not take
    for name, value in [
        ("continue_final_message", True),
        ("chat_template", "{{ messages[0]['content'] }}"),
        ("documents", [{"title": "t", "text": "x"}]),
        ("echo", True),
        ("add_special_tokens", True),
    ]:
        assert_refused(post(server, "/v1/chat/completions", {**CHAT, name: value}), name)
        if name not in ("echo", "add_special_tokens"):  # (those are /tokenize's own)
            body = {"messages": CHAT["messages"], name: value}
            assert_refused(post(server, "/tokenize", body), name)
    for name, value in [("continue_final_message", False), ("echo", False)]:
        assert post(server, "/v1/chat/completions", {**CHAT, name: value}).status_code == 200
    # completions add the tokenizer's special tokens (BOS) to a string prompt, as vLLM's default
    assert_refused(
        post(server, "/v1/completions", {**COMPLETION, "add_special_tokens": False}),
        "add_special_tokens",
    )
    assert (
        post(server, "/v1/completions", {**COMPLETION, "add_special_tokens": True}).status_code
        == 200
    )


def test_through_the_openai_client(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"bad_words": ["the"]}
        )
    assert info.value.body["param"] == "bad_words"
