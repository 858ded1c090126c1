"""Plain dataclasses that cross layer boundaries: scheduler -> runner -> scheduler -> client."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from servelm.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """What the model runner needs for one request in one step.

    `token_ids` are the tokens whose KV this step computes, at positions
    `num_computed_tokens ... num_computed_tokens + len(token_ids) - 1`. The runner samples a
    next token only when `sample` is true (the request's last known token is in this step).
    `block_ids` is the KV manager's own list (shared, not copied; read it, never change it).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    sample: bool
    # For penalties and min_tokens: the full prompt and output so far (shared, not copied).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()


def scheduled_request(
    *,
    request_id: str,
    token_ids: list[int],
    num_computed_tokens: int,
    block_ids: list[int],
    sampling_params: SamplingParams,
    sample: bool,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    eos_token_ids: frozenset[int],
) -> ScheduledRequest:
    """`ScheduledRequest(...)` by keyword, at the cost of a positional call.

    The scheduler builds one per request per step. On CPython 3.11 calling a class with keyword
    arguments packs them into a dict and unpacks it again for `__init__` (about 0.25 us more
    than positional arguments); calling a function with keywords does not. Same fields, same
    order (a test checks), so call sites keep their keywords.
    """
    return ScheduledRequest(
        request_id,
        token_ids,
        num_computed_tokens,
        block_ids,
        sampling_params,
        sample,
        prompt_token_ids,
        output_token_ids,
        eos_token_ids,
    )


@dataclass
class GrammarBitmask:
    """The tokens each constrained request may sample this step (`servelm.structured.matcher`):
    row i of `bits` (numpy int32, [rows, ceil(vocab / 32)]) is `request_ids[i]`'s; bit j of
    word w allows token 32 * w + j."""

    request_ids: list[str]
    bits: Any


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]
    # Requests that finished or were preempted since the last step: the runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmask | None = None  # set by the engine core after scheduling

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class Logprobs:
    """Logprobs for one token: the sampled (or, scoring a prompt, the given) token's, its rank
    and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Requests with prompt_logprobs: (t, entries), entries[i] the logprob of prompt token t + i
    # given the tokens before it (this step's rows of the prompt; t >= 1).
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


class ErrorKind(StrEnum):
    """Whose fault it is that the engine ended a request with an error: the server answers the
    request's own with a 400 (the same request would fail again), the engine's with a 500."""

    REQUEST = "request"  # what it asks cannot be served: no room for its prompt, a bad grammar
    ENGINE = "engine"  # the engine failed it (a sampled token its grammar rejects)


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request after one step (what the API process turns into text)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[Logprobs] | None = None
    queued_time: float | None = None  # seconds between arrival and first schedule
    error: str | None = None
    error_kind: ErrorKind | None = None  # with `error`: whose fault (unset: the engine's)
    # With the request's first output, when it asked for prompt_logprobs: one entry per prompt
    # token, the first None (nothing precedes it).
    prompt_logprobs: list[Logprobs | None] | None = None


def new_token_output(
    *, request_id: str, token_id: int, num_prompt_tokens: int, num_cached_tokens: int
) -> EngineCoreOutput:
    """The `EngineCoreOutput` of one new token, by keyword at the cost of a positional call
    (once per generated token; see `scheduled_request`)."""
    return EngineCoreOutput(
        request_id, [token_id], None, None, num_prompt_tokens, num_cached_tokens
    )


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens, since the previous stats
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # since the previous stats
