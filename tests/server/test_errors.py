"""Every error is OpenAI-shaped with the right status, and the server keeps serving afterwards."""

import asyncio

import httpx
import openai
import pytest

from tests.live_server import LiveServer

MSG = [{"role": "user", "content": "hi"}]


def post(server, path, body, timeout=30, **kw):
    return httpx.post(server.base_url + path, json=body, timeout=timeout, **kw)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def still_serving(server):
    r = post(server, "/completions", {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "top_p": 1.5}, "top_p"),
        ({"messages": MSG, "n": 1000}, "n"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
        ({"messages": MSG, "presence_penalty": 5}, "presence_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": "not a list"}, "messages"),
    ],
)
def test_invalid_values_are_400_naming_the_param(server, body, param):
    assert_error(post(server, "/chat/completions", body), 400, param)
    still_serving(server)


@pytest.mark.parametrize(
    "path,body,param,says",
    [
        ("/completions", {"prompt": "hi", "seed": 2**63}, "seed", "64 bits"),
        ("/completions", {"prompt": "hi", "priority": 2**70}, "priority", "64 bits"),
        ("/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens", "64 bits"),
        ("/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
        ("/completions", {"prompt": "hi", "logit_bias": {"abc": 5}}, "logit_bias", "'abc'"),
        ("/completions", {"prompt": "hi", "logit_bias": {"10000000": 5}}, "logit_bias", "[0, "),
        ("/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ("/completions", {"prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
        ("/completions", {"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
        # hostile but well-formed bodies (QA round 3: each was a 500 or held the event loop)
        ("/completions", {"prompt": "hi", "best_of": -5}, "best_of", "at least n"),
        ("/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "at least n"),
        ("/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "[0, "),
        ("/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(300_000)]}, "stop",
         "at most 64 stop strings"),
        ("/completions", {"prompt": ["word"] * 1_000_000}, "prompt", "at most 64 prompts"),
        ("/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format", "invalid schema"),
        ("/completions", {"prompt": "hi", "guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        # known only with the vocabulary (were 500s from the engine's compile)
        ("/completions", {"prompt": "hi", "guided_grammar": 'start: "a" <|no_such_token|>'},
         "guided_grammar", "no_such_token"),
        ("/chat/completions", {"messages": MSG, "guided_grammar": 'start: "a" <[99999999]>'},
         "guided_grammar", "99999999"),
        ("/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice", "force"),
        ("/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
         "'wizard'"),
        ("/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages", "'image_url'"),
        ("/chat/completions", {"messages": [{"role": "user"}]}, "messages", "content is required"),
        ("/chat/completions", {"messages": [{"role": "system", "content": None}, *MSG]},
         "messages", "messages.0.content is required for a 'system' message"),
    ],
)  # fmt: skip
def test_what_servelm_cannot_honour_or_carry_is_400(server, path, body, param, says):
    assert says in assert_error(post(server, path, body), 400, param)["message"]
    still_serving(server)


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
        (b'{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
        (b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
        (b'{"prompt": "\\ud800 and more"}', "prompt"),
        (b'{"prompt": ["fine", "x\\udfff"]}', "prompt"),
        (b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
        (b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),  # a key: was a 500
        (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    ],
)
def test_non_finite_numbers_and_lone_surrogates_are_400(server, raw, param):
    # Python's JSON parser takes NaN, Infinity and "\ud800" escapes (no client library sends
    # them, but any HTTP client can); none may reach the sampler or the tokenizer.
    path = "/chat/completions" if b"messages" in raw else "/completions"
    r = httpx.post(server.base_url + path, content=raw, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    err = assert_error(r, 400, param)
    assert "finite" in err["message"] or "Unicode" in err["message"] or "[-100" in err["message"]
    still_serving(server)


def test_malformed_json_is_400(server):
    r = httpx.post(
        server.base_url + "/chat/completions",
        content=b'{"messages": [',
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400)
    still_serving(server)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_sent_as_another_type_is_400_saying_so(server, content_type):
    # curl -d's default type, or none: the message says what to send, not "got an object"
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"prompt": "hi", "max_tokens": 1}'
    r = httpx.post(server.base_url + "/completions", content=body, headers=headers, timeout=30)
    err = assert_error(r, 400)
    assert "Content-Type: application/json" in err["message"], err
    still_serving(server)


def test_unknown_model_is_404(server):
    err = assert_error(
        post(server, "/chat/completions", {"model": "gpt-17", "messages": MSG}), 404, "model"
    )
    assert "gpt-17" in err["message"]
    still_serving(server)


def test_prompt_longer_than_context_is_400_with_both_numbers(server):
    prompt = [3 + i % 300 for i in range(600)]
    err = assert_error(
        post(server, "/completions", {"prompt": prompt, "max_tokens": 5}), 400, "prompt"
    )
    assert "512" in err["message"] and "600" in err["message"]
    still_serving(server)


def test_bad_token_ids_are_400(server):
    assert_error(post(server, "/completions", {"prompt": [1, 2, 10**9]}), 400, "prompt")
    still_serving(server)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-2)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    srv = LiveServer(tiny_model_dir, "--kv-cache-memory", "4MiB", "--api-key", "sekrit")
    yield srv
    srv.stop()


def test_api_key_required(keyed_server):
    url = keyed_server.base_url + "/chat/completions"
    assert_error(httpx.post(url, json={"messages": MSG}), 401)
    assert_error(
        httpx.post(url, json={"messages": MSG}, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(httpx.get(keyed_server.base_url + "/models"), 401)
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert httpx.get(keyed_server.url + "/metrics").status_code == 200
    ok = httpx.post(
        url, json={"messages": MSG, "max_tokens": 2}, headers={"Authorization": "Bearer sekrit"}
    )
    assert ok.status_code == 200
    c = openai.OpenAI(base_url=keyed_server.base_url, api_key="bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_keyed_document_says_bearer_and_401(keyed_server):
    auth = {"Authorization": "Bearer sekrit"}
    doc = httpx.get(keyed_server.url + "/openapi.json", headers=auth).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}] and "401" in chat["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]  # probes stay open


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    srv = LiveServer(
        tiny_model_dir,
        "--kv-cache-memory",
        "4MiB",
        "--max-queued-requests",
        "2",
        "--max-num-seqs",
        "1",
    )
    yield srv
    srv.stop()


def test_full_queue_is_503_with_retry_after(tight_server):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": [5] * 300, "max_tokens": 30, "ignore_eos": True}
            return await asyncio.gather(
                *(c.post(tight_server.base_url + "/completions", json=body) for _ in range(12))
            )

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 503 in codes and 200 in codes, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert_error(rejected, 503)
    assert int(rejected.headers["retry-after"]) >= 1
    still_serving(tight_server)


def test_a_wrong_method_says_which_are_allowed_and_load_balancers_may_probe_with_head(server):
    r = httpx.delete(server.base_url + "/chat/completions", timeout=30)
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"  # RFC 9110 requires it on a 405
    head = httpx.head(server.url + "/health", timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_a_grammar_too_large_for_the_engine_is_a_400_without_a_backtrace(server):
    # the API process's check passes it; only the engine's compile with the vocabulary's tables
    # fails (llguidance panics past 65,525 symbols): the request's fault, not a 500
    body = {"prompt": "hi", "max_tokens": 2, "guided_choice": [f"c{i}" for i in range(100_000)]}
    err = assert_error(post(server, "/completions", body, timeout=120), 400)
    assert err["message"].startswith("grammar failed to compile") and "\n" not in err["message"]
    still_serving(server)
