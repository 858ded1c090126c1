"""Sampling parameters of one request, and their validation.

Validation raises `InvalidParamError` (never `assert`) so the server can map it to a 400 that
names the offending parameter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from numbers import Real

MAX_N = 16
MAX_LOGPROBS = 20
# Each stop string is searched for after every token, in the API process's event loop: 300,000
# of them held every other client's answer (and /health) for seconds. OpenAI takes 4.
MAX_STOP = 64
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

    def __post_init__(self) -> None:
        # vLLM's structured outputs take a schema as an object and the choices as a list: the
        # same, as the JSON text the grammar engine reads (and caches by).
        if isinstance(self.value, (dict, list)) and self.kind in ("json", "choice"):
            object.__setattr__(self, "value", json.dumps(self.value))


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match OpenAI's where they exist.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `max_tokens=None` means "until the context is full". `logprobs=k` returns the sampled
    token's logprob plus the k most likely alternatives at each step. `logit_bias` adds a value
    to a token's logit before sampling (token ids below the vocabulary size:
    `check_token_ids`, which `LLM.generate` runs; the server checks its own).
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
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """InvalidParamError naming the first parameter that is of the wrong type or out of
        range. `stop` and `stop_token_ids` become lists here (a string for one stop string).
        Run again after changing a field: `LLM.generate` does."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
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
        if len(self.stop) > MAX_STOP:
            raise InvalidParamError(
                "stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}."
            )
        so = self.structured_output
        if so is not None and (
            so.kind not in STRUCTURED_KINDS or not isinstance(so.value, str) or not so.value
        ):
            raise InvalidParamError(
                "structured_output",
                f"structured_output needs a kind in {', '.join(STRUCTURED_KINDS)} and a value "
                f"(text; a json schema may be a dict); got {so.kind!r}: {so.value!r:.60}.",
            )

    def check_token_ids(self, vocab_size: int) -> None:
        """InvalidParamError naming `logit_bias` or `stop_token_ids` unless each id it holds is
        below `vocab_size`: the sampler indexes the logits with them."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                message = f"{name}: token ids must be in [0, {vocab_size}), got {bad}."
                raise InvalidParamError(name, message)

    def _check_types(self) -> None:
        """Each field of the type its annotation names (an int is a float too, a bool is neither),
        so that a value of another type is refused by name, not met deep in the engine step."""
        for f in fields(self):
            value = getattr(self, f.name)
            kind, _, optional = f.type.partition(" | ")  # "int | None" (annotations are text)
            if value is None and optional == "None":
                continue
            if kind in _TYPE_CHECKS and not _TYPE_CHECKS[kind](value):
                a = _TYPE_WORDS[kind] + (" or None" if optional else "")
                raise InvalidParamError(
                    f.name, f"{f.name} must be {a}, got {type(value).__name__} {value!r:.40}."
                )
        if not (isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)):
            raise InvalidParamError("stop", "stop must be a string or a list of strings.")
        if not (isinstance(self.stop_token_ids, list) and all(map(_is_int, self.stop_token_ids))):
            raise InvalidParamError("stop_token_ids", "stop_token_ids must be a list of integers.")
        if not (
            isinstance(self.logit_bias, dict)
            and all(_is_int(t) and _is_real(v) for t, v in self.logit_bias.items())
        ):
            raise InvalidParamError(
                "logit_bias", "logit_bias must map token ids (integers) to numbers."
            )
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutput):
            raise InvalidParamError(
                "structured_output", "structured_output must be a StructuredOutput or None."
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


# SamplingParams' annotated scalar types: how to check a value, and how to say what it must be
_TYPE_CHECKS = {"int": _is_int, "float": _is_real, "bool": lambda v: isinstance(v, bool)}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "True or False"}
