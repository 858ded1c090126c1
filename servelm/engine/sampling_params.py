"""Sampling parameters of one request, and their validation.

Validation raises `InvalidParamError` (never `assert`) so the server can map it to a 400 that
names the offending parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_N = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
INT64 = (-(2**63), 2**63 - 1)  # the integers the engine's messages carry (msgpack int64)


# What a `StructuredOutput` may constrain to: its `value` is a JSON schema (as JSON text), a
# regular expression, a JSON list of strings, or a Lark / GBNF grammar (`servelm.structured`).
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class InvalidParamError(ValueError):
    """A request parameter has a value we cannot serve; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a language: `kind` is one of STRUCTURED_KINDS, `value` its text.

    Any layer may set it (the server for `response_format`, for a forced tool call); the engine
    compiles it off the step loop and masks every sampled token to what the language allows.
    A Lark grammar may embed JSON schemas (`%json{...}`), which is how a tool call's
    `<tool_call>{...}</tool_call>` markup is constrained around the tool's parameters.
    """

    kind: str
    value: str


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match OpenAI's where they exist.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `max_tokens=None` means "until the context is full". `logprobs=k` returns the sampled
    token's logprob plus the k most likely alternatives at each step. `logit_bias` adds a value
    to a token's logit before sampling (token ids below the vocabulary size: the server checks).
    `prompt_logprobs=k` scores the prompt too: for every prompt token after the first, its
    logprob given the tokens before it (raw log-softmax, float32) plus the k most likely tokens
    there. `max_tokens=0` generates nothing: the prompt is only run (and scored, if asked).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only text of this language (min_tokens does not hold off the end it reaches).
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise InvalidParamError(name, f"{name} must be a finite number.")
        if self.seed is not None and not INT64[0] <= self.seed <= INT64[1]:
            raise InvalidParamError("seed", "seed must fit in a signed 64-bit integer.")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParamError(
                    "logit_bias",
                    f"logit_bias maps token ids (>= 0) to values in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}]; got {token}: {bias}.",
                )
        if not 1 <= self.n <= MAX_N:
            raise InvalidParamError("n", f"n must be between 1 and {MAX_N}, got {self.n}.")
        if self.temperature < 0:
            raise InvalidParamError(
                "temperature", f"temperature must be non-negative, got {self.temperature}."
            )
        if not 0 < self.top_p <= 1:
            raise InvalidParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise InvalidParamError(
                "top_k", f"top_k must be -1 (off) or positive, got {self.top_k}."
            )
        if not 0 <= self.min_p <= 1:
            raise InvalidParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParamError(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
            )
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParamError(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
            )
        if self.repetition_penalty <= 0:
            raise InvalidParamError(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}.",
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidParamError(
                "max_tokens", f"max_tokens must be non-negative, got {self.max_tokens}."
            )
        if self.min_tokens < 0:
            raise InvalidParamError(
                "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParamError(
                "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}."
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidParamError(
                "prompt_logprobs",
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}.",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParamError("stop_token_ids", "stop_token_ids must be token ids (>= 0).")
        if any(not s for s in self.stop):
            raise InvalidParamError("stop", "stop strings must not be empty.")
        so = self.structured_output
        if so is not None and (so.kind not in STRUCTURED_KINDS or not so.value):
            raise InvalidParamError(
                "structured_output",
                f"structured_output needs a kind in {', '.join(STRUCTURED_KINDS)} and a value; "
                f"got {so.kind!r}.",
            )
