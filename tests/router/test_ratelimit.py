"""Gateway limits: token buckets, usage correction, OpenAI's headers; 429s through a real router."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from servelm.router.ratelimit import ApiKey, RateLimited, RateLimiter, format_duration
from tests.router.conftest import MODEL, Proc, router


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
    assert limiter.estimate_tokens(body) == 600
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


def test_format_duration_matches_openai() -> None:
    assert [format_duration(s) for s in (0.02, 1.5, 59.0, 360.0)] == ["20ms", "1.5s", "59s", "6m0s"]


@pytest.fixture(scope="module")
def gated(cluster: list[Proc], log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "sk-small", "name": "small", "rpm": 100, "tpm": 600},
                    {"key": "sk-big", "name": "big", "rpm": 1000, "tpm": 1_000_000},
                ]
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
