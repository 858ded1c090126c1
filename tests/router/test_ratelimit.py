"""Gateway limits: token buckets, usage correction, OpenAI's headers; 429s through a real router."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from servelm.router.ratelimit import ApiKey, RateLimited, RateLimiter, format_duration
from tests.router.conftest import MODEL, Proc, router, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buckets_refill_and_usage_corrects_the_charge() -> None:
    clock = Clock()
    limiter = RateLimiter(
        [ApiKey("a", "sk-a", rpm=2, tpm=1000)], default_max_tokens=100, clock=clock
    )
    key = limiter.authenticate("Bearer sk-a")
    assert key is not None and limiter.authenticate("Bearer nope") is None
    body = {"prompt": "x" * 400, "max_tokens": 500}  # about 100 + 500 tokens
    assert limiter.estimate_tokens("/v1/completions", body) == 600
    adm = limiter.admit(key, 600)
    assert adm.headers["x-ratelimit-remaining-tokens"] == "400"
    assert adm.headers["x-ratelimit-remaining-requests"] == "1"
    limiter.settle(adm, 150)  # the answer was short: 450 tokens come back
    assert key.tokens is not None and key.tokens.level == pytest.approx(850)
    limiter.admit(key, 10)
    with pytest.raises(RateLimited) as exc:  # two requests per minute used up
        limiter.admit(key, 10)
    assert exc.value.limit == "requests"
    assert exc.value.headers["Retry-After"] == "30"  # one request back every 30 s
    clock.now = 30.0
    limiter.admit(key, 10)


def test_token_limit_rejects_with_headers_and_charges_nothing() -> None:
    clock = Clock()
    limiter = RateLimiter([ApiKey("a", "sk-a", tpm=600)], clock=clock)
    key = limiter.authenticate("Bearer sk-a")
    limiter.admit(key, 500)
    with pytest.raises(RateLimited) as exc:
        limiter.admit(key, 200)  # 100 left, 200 asked: 10 s at 10 tokens/s
    h = exc.value.headers
    assert exc.value.limit == "tokens" and h["Retry-After"] == "10"
    assert h["x-ratelimit-limit-tokens"] == "600" and h["x-ratelimit-remaining-tokens"] == "100"
    assert h["x-ratelimit-reset-tokens"] == "50s"
    assert "x-ratelimit-limit-requests" not in h  # no request limit on this key
    with pytest.raises(RateLimited, match="too large"):
        limiter.admit(key, 601)


def test_reload_keeps_levels_of_unchanged_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-a", "name": "a", "tpm": 1000}]}))
    limiter = RateLimiter()
    limiter.load_file(path)
    limiter.admit(limiter.authenticate("Bearer sk-a"), 400)
    path.write_text(
        json.dumps(
            {"keys": [{"key": "sk-a", "name": "a", "tpm": 1000}, {"key": "sk-b", "name": "b"}]}
        )
    )
    limiter.load_file(path)
    assert limiter.authenticate("Bearer sk-a").tokens.level <= 601
    assert limiter.authenticate("Bearer sk-b").tokens is None  # unlimited


def test_a_keys_file_without_keys_locks_everyone_out(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"keys": []}')
    limiter = RateLimiter()
    assert not limiter.enabled  # no keys file: an open router
    limiter.load_file(path)
    assert limiter.enabled and limiter.authenticate("Bearer anything") is None
    with pytest.raises(OSError):
        RateLimiter().load_file(tmp_path / "missing.json")


def test_estimates_read_the_body_as_the_replica_does_and_are_never_negative() -> None:
    limiter = RateLimiter(default_max_tokens=100)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    prompt = limiter.estimate_tokens("/v1/chat/completions", {**chat, "max_tokens": 0})
    for path, body, output in [
        # completions ignore max_completion_tokens; chat reads it before max_tokens
        ("/v1/completions", {"max_tokens": 7, "max_completion_tokens": -(10**9)}, 7),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 9, "max_tokens": 7}, 9),
        # a value the replica would refuse counts as left out: the default
        ("/v1/chat/completions", {**chat, "max_completion_tokens": -(10**9)}, 100),
        ("/v1/chat/completions", {**chat, "max_tokens": -5}, 100),
        ("/v1/chat/completions", {**chat, "max_tokens": True}, 100),
        ("/v1/chat/completions", {**chat, "max_tokens": 2.5}, 100),
        ("/v1/chat/completions", {**chat, "max_tokens": "50"}, 100),
        ("/v1/chat/completions", {**chat, "max_tokens": 7, "n": -3}, 7),
        ("/v1/chat/completions", {**chat, "max_tokens": 7, "n": 3}, 21),
    ]:
        body = body if "messages" in body else {"messages": chat["messages"], **body}
        assert limiter.estimate_tokens(path, body) == prompt + output, body
    # a completions batch: every prompt, n times each
    batch = {"prompt": ["abcd"] * 32, "n": 8, "max_tokens": 40}
    assert limiter.estimate_tokens("/v1/completions", batch) == 32 + 32 * 8 * 40
    ids = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 10}
    assert limiter.estimate_tokens("/v1/completions", ids) == 5 + 2 * 10
    assert limiter.estimate_tokens("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}) == 4
    # counting tokens generates nothing
    assert limiter.estimate_tokens("/tokenize", {"prompt": "x" * 400, "max_tokens": 9}) == 0
    assert limiter.estimate_tokens("/detokenize", {"tokens": [1, 2, 3]}) == 0


def test_a_cut_stream_pays_what_it_got_and_no_bucket_goes_above_its_limit() -> None:
    clock = Clock()
    limiter = RateLimiter([ApiKey("a", "sk-a", rpm=2, tpm=600)], clock=clock)
    key = limiter.authenticate("Bearer sk-a")
    adm = limiter.admit(key, 100)
    limiter.settle(adm, None, 50)  # less seen than estimated, no usage: the estimate stays
    assert key.tokens.level == 500
    limiter.settle(adm, None, 900)  # more streamed than estimated: charged what was seen
    assert key.tokens.level == -300
    limiter.admit(key, 0)  # in debt, a request of no tokens (/tokenize) still passes ...
    with pytest.raises(RateLimited) as exc:  # ... as long as the rpm limit allows it
        limiter.admit(key, 0)
    assert exc.value.limit == "requests"
    limiter.settle(adm, -(10**9))  # whatever comes back, a bucket holds at most its limit
    assert key.tokens.level == 600


def test_format_duration_matches_openai() -> None:
    assert [format_duration(s) for s in (0.02, 1.5, 59.0, 360.0)] == ["20ms", "1.5s", "59s", "6m0s"]


@pytest.fixture(scope="module")
def gated(cluster: list[Proc], log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "default_max_tokens": 16,
                "keys": [
                    {"key": "sk-small", "name": "small", "rpm": 100, "tpm": 600},
                    {"key": "sk-big", "name": "big", "rpm": 1000, "tpm": 1_000_000},
                    # one key per test below, each starting full
                    {"key": "sk-neg", "name": "neg", "tpm": 600},
                    {"key": "sk-batch", "name": "batch", "tpm": 600},
                    {"key": "sk-cut", "name": "cut", "tpm": 300},
                    {"key": "sk-tok", "name": "tok", "rpm": 8, "tpm": 100},
                ],
            }
        )
    )
    with router([cluster[0].url], "round-robin", log_dir, "--api-keys-file", str(keys)) as r:
        yield r


def client(r: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_key_over_its_token_budget_gets_429_and_others_do_not(gated: Proc) -> None:
    small, big = client(gated, "sk-small"), client(gated, "sk-big")
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 250,
        "extra_body": {"ignore_eos": True},
    }
    first = small.chat.completions.with_raw_response.create(**ask)
    assert first.headers["x-ratelimit-limit-tokens"] == "600"
    remaining = int(first.headers["x-ratelimit-remaining-tokens"])
    assert 300 < remaining < 350  # 600 - (prompt estimate + 250)
    # a stream without include_usage: the router asks for usage itself and hides it
    chunks = list(small.chat.completions.create(**ask, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    with pytest.raises(openai.RateLimitError) as exc:
        small.chat.completions.create(**ask)
    h = exc.value.response.headers
    assert int(h["retry-after"]) >= 1
    assert int(h["x-ratelimit-remaining-tokens"]) < 250
    for name in ("limit-requests", "remaining-requests", "reset-requests", "reset-tokens"):
        assert f"x-ratelimit-{name}" in h
    assert exc.value.body["code"] == "rate_limit_exceeded"
    for _ in range(3):  # the other key is not affected
        assert big.chat.completions.create(**ask).choices[0].finish_reason == "length"


def test_missing_or_unknown_key_is_401(gated: Proc) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(gated, "sk-wrong").models.list()
    assert [m.id for m in client(gated, "sk-big").models.list()] == [MODEL]


def remaining_tokens(r: Proc, key: str) -> int:
    """The key's tokens left, read from a /tokenize answer (which is charged none)."""
    resp = httpx.post(
        r.url + "/tokenize", headers={"Authorization": f"Bearer {key}"}, json={"prompt": "x"}
    )
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-ratelimit-remaining-tokens"])


def test_a_negative_max_completion_tokens_credits_nothing(gated: Proc) -> None:
    auth = {"Authorization": "Bearer sk-neg"}
    http = httpx.Client(base_url=gated.url, headers=auth, timeout=60)

    def stream(max_tokens: int) -> httpx.Response:
        ask = {"prompt": "x", "max_tokens": max_tokens, "stream": True}
        ask["max_completion_tokens"] = -(10**9)  # completions ignore it (a chat request: 400)
        return http.send(http.build_request("POST", "/v1/completions", json=ask), stream=True)

    with http:
        first = stream(200)  # 600 - (1 + 200) left while it runs
        try:
            assert first.status_code == 200
            assert 380 <= int(first.headers["x-ratelimit-remaining-tokens"]) <= 400
            second = stream(500)  # more than is left: refused, whatever max_completion_tokens says
            second.close()
            assert second.status_code == 429
            assert int(second.headers["x-ratelimit-remaining-tokens"]) <= 400
        finally:
            first.close()
    chat = httpx.post(
        gated.url + "/v1/chat/completions",
        headers=auth,
        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -(10**9)},
    )
    assert chat.status_code == 400  # the replica's refusal; charged nothing, credited nothing
    assert int(chat.headers["x-ratelimit-remaining-tokens"]) <= 600
    assert remaining_tokens(gated, "sk-neg") <= 600


def test_a_batch_is_estimated_per_prompt_and_choice(gated: Proc) -> None:
    with pytest.raises(openai.RateLimitError, match="too large") as exc:
        client(gated, "sk-batch").completions.create(
            model=MODEL,
            prompt=[f"Item {i}:" for i in range(32)],
            n=8,
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
    estimate = re.search(r"about (\d+) tokens", str(exc.value))
    assert estimate and int(estimate.group(1)) >= 32 * 8 * 40


def test_a_stream_cut_before_its_usage_pays_for_what_it_delivered(gated: Proc) -> None:
    # a chat without max_tokens is estimated at default_max_tokens (16) but runs to the end
    # of the context: the client takes 200 chunks and hangs up before the usage chunk
    raw = client(gated, "sk-cut").chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    admitted, t0 = int(raw.headers["x-ratelimit-remaining-tokens"]), time.monotonic()
    assert admitted > 250  # 300 less the estimate
    stream, got = raw.parse(), 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 200:
            break
    stream.close()
    # charged at least the 200 tokens seen: less what refilled since (5 tokens a second),
    # the key is more than 150 below where admission left it
    wait_for(
        lambda: remaining_tokens(gated, "sk-cut") - 5 * (time.monotonic() - t0) < admitted - 150,
        10,
        "the cut stream's charge",
    )


def test_tokenize_and_detokenize_are_charged_requests_not_tokens(gated: Proc) -> None:
    auth = {"Authorization": "Bearer sk-tok"}
    for i in range(8):  # the rpm limit's 8 requests, far more than 100 tokens' worth of prompts
        path, body = (
            ("/tokenize", {"prompt": "y" * 300}) if i % 2 else ("/detokenize", {"tokens": [1, 2]})
        )
        resp = httpx.post(gated.url + path, headers=auth, json=body)
        assert resp.status_code == 200, (i, resp.text)
        assert resp.headers["x-ratelimit-remaining-tokens"] == "100"
    resp = httpx.post(gated.url + "/tokenize", headers=auth, json={"prompt": "y"})
    assert resp.status_code == 429 and "requests per minute" in resp.json()["error"]["message"]
