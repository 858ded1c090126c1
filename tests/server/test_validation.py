"""Strict types and token-id ranges on the API (issue #32): each nasty input gets an
OpenAI-shaped 400 naming the field, `error.code` is a string or null, and the server goes on
serving with no KV block held by what it refused."""

import time

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]
FAR = 10**9  # a token id far beyond the tiny model's vocabulary


def post(server, path, body):
    base = server.url if path in ("/tokenize", "/detokenize") else server.base_url
    return httpx.post(base + path, json=body, timeout=30)


def assert_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert status != 400 or err["type"] == "invalid_request_error", err
    assert err["code"] is None or isinstance(err["code"], str), err  # OpenAI's: string or null
    return err


CASES = [
    # a string, a float or a boolean is not an integer
    ("/completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens", "got a string"),
    ("/completions", {"prompt": "hi", "max_tokens": 10.0}, "max_tokens", "got a number"),
    ("/completions", {"prompt": "hi", "n": True}, "n", "got a boolean"),
    ("/completions", {"prompt": "hi", "seed": "7"}, "seed", "got a string"),
    ("/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "got a boolean"),
    ("/chat/completions", {"messages": MSG, "top_logprobs": 2.0, "logprobs": True},
     "top_logprobs", "got a number"),
    ("/chat/completions", {"messages": MSG, "max_completion_tokens": "5"},
     "max_completion_tokens", "got a string"),
    # nor a string a number, nor a number a boolean or a string
    ("/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature", "got a string"),
    ("/completions", {"prompt": "hi", "stream": "true"}, "stream", "got a string"),
    ("/completions", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos", "got an integer"),
    ("/completions", {"prompt": "hi", "stream_options": {"include_usage": 1}, "stream": True},
     "stream_options", "got an integer"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "got"),
    ("/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, "messages", "got"),
    ("/completions", {"prompt": 5}, "prompt", "got an integer"),
    # a boolean is not a token id, wherever token ids go
    ("/completions", {"prompt": [True]}, "prompt", "token ids"),
    ("/completions", {"prompt": [[False]]}, "prompt", "token ids"),
    ("/completions", {"prompt": [[1, 2], [3, True]]}, "prompt", "token ids"),
    ("/completions", {"prompt": [1.0, 2.0]}, "prompt", "token ids"),
    ("/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids", "boolean"),
    ("/detokenize", {"tokens": [False]}, "tokens", "got a boolean"),
    ("/detokenize", {"tokens": [1.0]}, "tokens", "got a number"),
    ("/detokenize", {"tokens": ["1"]}, "tokens", "got a string"),
    # token ids out of the vocabulary, wherever token ids go
    ("/completions", {"prompt": "hi", "stop_token_ids": [FAR]}, "stop_token_ids", str(FAR)),
    ("/chat/completions", {"messages": MSG, "stop_token_ids": [2, FAR]}, "stop_token_ids",
     str(FAR)),
    ("/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ("/completions", {"prompt": [1, 2, FAR]}, "prompt", str(FAR)),
    ("/completions", {"prompt": [[1, 2], [3, FAR]]}, "prompt", str(FAR)),
    ("/completions", {"prompt": [[1, 2], [3, -4]]}, "prompt", "token ids"),
    ("/detokenize", {"tokens": [1, FAR]}, "tokens", str(FAR)),
    ("/detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0"),
    ("/completions", {"prompt": "hi", "logit_bias": {str(FAR): 1}}, "logit_bias", str(FAR)),
    ("/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias", "'-1'"),
    ("/completions", {"prompt": "hi", "logit_bias": {"5_0": 1}}, "logit_bias", "'5_0'"),
    ("/completions", {"prompt": "hi", "logit_bias": {" 5": 1}}, "logit_bias", "' 5'"),
    ("/completions", {"prompt": "hi", "logit_bias": {"\u0665": 1}}, "logit_bias", "token ids"),
    # bounds the document states
    ("/completions", {"prompt": "hi", "n": 0}, "n", "got 0"),
    ("/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice", "at least 1"),
    # fields that mean nothing without another (OpenAI's rules): refused, never ignored
    ("/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "logprobs is true"),
    ("/chat/completions", {"messages": MSG, "stream_options": {"include_usage": True}},
     "stream_options", "stream is true"),
    ("/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream is true"),
    ("/chat/completions", {"messages": MSG, "tool_choice": "auto"}, "tool_choice", "tools are given"),
    ("/tokenize", {"messages": MSG, "tool_choice": "auto"}, "tool_choice", "tools are given"),
    ("/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions",
     "send tools"),
    ("/chat/completions", {"messages": MSG, "function_call": "auto"}, "function_call",
     "send tools"),
    ("/chat/completions", {"messages": [*MSG, {"role": "assistant", "content": None,
     "function_call": {"name": "f", "arguments": "{}"}}]}, "messages", "send tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,param,says", CASES)
def test_nasty_input_is_an_openai_400_naming_the_field(server, path, body, param, says):
    err = assert_error(post(server, path, body), 400, param)
    assert says in err["message"], err


def test_openai_nullable_fields_take_null_as_their_default(server):
    # OpenAI types n, stream, logprobs and echo as "... or null"; clients that send every
    # unset field as null must get the defaults, not a 400
    chat = {"messages": MSG, "max_tokens": 2, "n": None, "stream": None, "logprobs": None}
    r = post(server, "/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    plain = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    r = post(server, "/completions", {**plain, "n": None, "stream": None, "echo": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == post(server, "/completions", plain).json()["choices"]
    # (fields that are not OpenAI's nullable ones stay strict)
    assert_error(
        post(server, "/completions", {"prompt": "hi", "ignore_eos": None}), 400, "ignore_eos"
    )


def test_json_coercions_clients_rely_on_still_work(server, client):
    # An integer where a float is wanted is JSON's own (the openai client sends 1 for 1).
    r = post(server, "/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1,
                                      "top_p": 1, "presence_penalty": 0, "logit_bias": {"5": 1}})  # fmt: skip
    assert r.status_code == 200, r.text
    out = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=2, temperature=1, top_p=1, frequency_penalty=0,
        logit_bias={5: 1}, seed=3, n=2,
    )  # fmt: skip
    assert len(out.choices) == 2 and out.usage.completion_tokens == 4


def test_error_code_is_a_string_or_null_everywhere(server):
    model = post(server, "/chat/completions", {"model": "nope", "messages": MSG})
    assert assert_error(model, 404, "model")["code"] == "model_not_found"
    long = post(server, "/completions", {"prompt": [5] * 600})
    assert assert_error(long, 400, "prompt")["code"] == "context_length_exceeded"
    for field in ("max_tokens", "max_completion_tokens"):
        room = post(server, "/chat/completions", {"messages": MSG, field: 600})
        assert assert_error(room, 400, field)["code"] == "context_length_exceeded"
    invalid = post(server, "/completions", {"prompt": "hi", "top_p": 7})
    assert assert_error(invalid, 400, "top_p")["code"] is None
    bad_json = httpx.post(server.base_url + "/completions", content=b"{", timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert assert_error(bad_json, 400, None)["code"] is None


def test_refusals_leave_the_server_serving_and_no_blocks_held(server):
    idle = server.metrics()["servelm:kv_cache_usage_perc"]
    for path, body, param, _ in CASES:
        assert_error(post(server, path, body), 400, param)
    r = post(server, "/completions", {"prompt": [7] * 100, "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    deadline = time.time() + 5
    while time.time() < deadline:
        m = server.metrics()
        if m["servelm:num_requests_running"] == 0 and m["servelm:kv_cache_usage_perc"] == idle:
            break
        time.sleep(0.05)
    m = server.metrics()
    assert m["servelm:num_requests_running"] == 0 and m["servelm:num_requests_waiting"] == 0
    assert m["servelm:kv_cache_usage_perc"] == idle


def test_openai_client_sees_strict_types_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="hi", extra_body={"max_tokens": "10"})
    assert exc.value.body["param"] == "max_tokens"
