"""The gateway: API keys, and per-key requests- and tokens-per-minute limits with OpenAI's headers.

Each limit is a token bucket holding at most one minute's allowance and refilling continuously
(a limit of 60 RPM gives one request back per second). Admission charges one request and an
estimate of the tokens: prompt (about 4 characters a token) plus prompts x `n` x `max_tokens`
(a Responses request: its `instructions` and `input`, plus `max_output_tokens`; /tokenize,
/detokenize and GET / DELETE of a stored response generate nothing: they are charged no
tokens). When the answer's `usage` arrives (a Responses stream: in its closing event) the
charge is corrected to the real total, so a level can go below zero (a debt paid back by
refill); a stream cut before its usage is charged at least what it delivered.
No level ever goes above its limit. Keys file (JSON):

    {"default_max_tokens": 256,
     "keys": [{"key": "sk-team-a", "name": "team-a", "rpm": 600, "tpm": 100000}, ...]}

`rpm` / `tpm` left out or null = unlimited.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelm.router.prefix import RESPONSES, estimate_prompt_tokens

# counting tokens generates nothing (still one request against an rpm limit)
UNMETERED = frozenset({"/tokenize", "/detokenize"})


def _count(value: Any) -> int | None:
    """`value` if it is an integer >= 0 (JSON's true is not one), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _prompt_count(prompt: Any) -> int:
    """How many prompts a completions request holds: a list of strings or of token lists is a
    batch, each prompt answered `n` times."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


class Bucket:
    def __init__(self, per_minute: float, clock: Callable[[], float]) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._clock = clock
        self._stamp = clock()

    def refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, amount: float) -> None:
        """Take `amount` (give it back when negative): never above the limit, debt allowed."""
        self.level = min(self.capacity, self.level - amount)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        return max(0.0, (amount - self.level) / self.rate) if self.rate > 0 else math.inf

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return self.wait_for(self.capacity)


@dataclass
class ApiKey:
    name: str
    secret: str
    rpm: float | None = None
    tpm: float | None = None
    requests: Bucket | None = field(default=None, repr=False)
    tokens: Bucket | None = field(default=None, repr=False)


@dataclass
class Admission:
    key: ApiKey
    charged: int  # tokens charged at admission
    headers: dict[str, str]


class RateLimited(Exception):
    def __init__(
        self, key: ApiKey, limit: str, message: str, retry_after_s: float, headers: dict[str, str]
    ) -> None:
        super().__init__(message)
        self.key, self.limit, self.message = key, limit, message
        self.headers = {**headers, "Retry-After": str(max(1, math.ceil(retry_after_s)))}


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest, 3):g}s"


class RateLimiter:
    def __init__(
        self,
        keys: list[ApiKey] | None = None,
        default_max_tokens: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default_max_tokens = default_max_tokens
        self._clock = clock
        self._keys: dict[str, ApiKey] = {}
        self._from_file = False
        self.load(keys or [])

    @property
    def enabled(self) -> bool:
        """Keys are checked once a keys file was loaded, even if it lists none (then all are 401)."""
        return self._from_file or bool(self._keys)

    def load(self, keys: list[ApiKey]) -> None:
        """Install a key list; a key whose limits did not change keeps its current levels."""
        new: dict[str, ApiKey] = {}
        for k in keys:
            old = self._keys.get(k.secret)
            if old is not None and (old.rpm, old.tpm) == (k.rpm, k.tpm):
                k.requests, k.tokens = old.requests, old.tokens
            else:
                k.requests = Bucket(k.rpm, self._clock) if k.rpm is not None else None
                k.tokens = Bucket(k.tpm, self._clock) if k.tpm is not None else None
            new[k.secret] = k
        self._keys = new

    def load_file(self, path: str | Path) -> None:
        data = json.loads(Path(path).read_text())
        default = _count(data.get("default_max_tokens", self.default_max_tokens))
        if default is None:
            raise ValueError(f"{path}: default_max_tokens must be an integer >= 0")
        self._from_file = True
        self.default_max_tokens = default
        self.load(
            [
                ApiKey(str(k.get("name") or f"key-{i}"), str(k["key"]), k.get("rpm"), k.get("tpm"))
                for i, k in enumerate(data.get("keys", []))
            ]
        )

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        token = token.strip()
        found = None
        for secret, key in self._keys.items():  # constant time per comparison
            if hmac.compare_digest(secret.encode(), token.encode()):
                found = key
        return found

    def estimate_tokens(self, path: str, body: dict[str, Any]) -> int:
        """Tokens a request may use, read as the replica reads it (never negative): the body is
        the client's and not yet checked, a value the replica would refuse counts as left out."""
        if path in UNMETERED:
            return 0
        if path == "/v1/embeddings":
            return estimate_prompt_tokens({"prompt": body.get("input")})
        n = _count(body.get("n")) or 1
        if path == "/v1/chat/completions":  # completions ignore max_completion_tokens
            max_tokens = _count(body.get("max_completion_tokens") or body.get("max_tokens"))
            prompts = 1
        elif path == RESPONSES:  # one answer (no `n`), its limit under its own name
            max_tokens, prompts, n = _count(body.get("max_output_tokens")), 1, 1
        else:
            max_tokens = _count(body.get("max_tokens"))
            prompts = _prompt_count(body.get("prompt"))
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        return estimate_prompt_tokens(body, path) + prompts * n * max_tokens

    def admit(self, key: ApiKey, tokens: int) -> Admission:
        """Charge one request and `tokens`; raise RateLimited (nothing charged) if over a limit."""
        for b in (key.requests, key.tokens):
            if b is not None:
                b.refill()
        if key.tokens is not None and tokens > key.tokens.capacity:
            raise RateLimited(
                key,
                "tokens",
                f"Request too large for key {key.name}: about {tokens} "
                f"tokens, limit {key.tpm:g} tokens per minute. Lower max_tokens or max_output_tokens (or n, or the prompts per request).",
                60.0,
                self.headers(key),
            )
        if key.requests is not None and key.requests.level < 1:
            raise RateLimited(
                key,
                "requests",
                f"Rate limit reached for key {key.name} on requests per minute: limit {key.rpm:g}.",
                key.requests.wait_for(1),
                self.headers(key),
            )
        if key.tokens is not None and tokens > 0 and key.tokens.level < tokens:  # 0: in debt too
            raise RateLimited(
                key,
                "tokens",
                f"Rate limit reached for key {key.name} on tokens per "
                f"minute: limit {key.tpm:g}, remaining {max(0, int(key.tokens.level))}, "
                f"requested about {tokens}.",
                key.tokens.wait_for(tokens),
                self.headers(key),
            )
        if key.requests is not None:
            key.requests.take(1)
        if key.tokens is not None:
            key.tokens.take(tokens)
        return Admission(key, tokens, self.headers(key))

    def settle(self, admission: Admission, actual_tokens: int | None, seen_tokens: int = 0) -> None:
        """Replace the admission estimate with the real usage. Without one (a stream the client
        cut before its usage chunk) the estimate stays, or `seen_tokens` (what was delivered)
        where that is more: an estimate too low must not be a way around the limit."""
        b = admission.key.tokens
        if b is None or (actual_tokens is None and seen_tokens <= admission.charged):
            return
        if actual_tokens is None:
            actual_tokens = seen_tokens
        b.refill()
        b.take(actual_tokens - admission.charged)
        admission.charged = actual_tokens

    def headers(self, key: ApiKey) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, b in (("requests", key.requests), ("tokens", key.tokens)):
            if b is not None:
                out[f"x-ratelimit-limit-{kind}"] = f"{b.capacity:g}"
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                out[f"x-ratelimit-reset-{kind}"] = format_duration(b.reset_s())
        return out
