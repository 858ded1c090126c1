"""One request as the engine sees it: token ids, progress, status and finish reason.

Invariant: `num_computed_tokens <= num_tokens`; the request needs a forward pass while
`num_computed_tokens < num_tokens` (prefill, chunked prefill, recompute after preemption and
plain decode are all the same catch-up).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from servelm.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """Why a request ended, as the OpenAI API spells it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    # Isolates this request's prefix-cache entries: its block hashes chain from the salt, so only
    # requests with the same salt share KV blocks (vLLM's `cache_salt`: a tenant's prompts cannot
    # be probed by another's time to first token).
    cache_salt: str | None = None
    # Set by the engine.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 = not admitted yet
    status: RequestStatus = RequestStatus.WAITING
    stop_token_id: int | None = None
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admission, for queue-time metrics
    # Hashes of this request's full blocks, filled as blocks fill (owned by the KV manager).
    block_hashes: list[bytes] = field(default_factory=list)
    # Cap on generated tokens; set by the engine from max_tokens and max_model_len.
    max_output_tokens: int = 0
    # Where the output is in its grammar (a `structured.matcher.GrammarMatcher`), for a request
    # with a structured_output; None otherwise and once it finished.
    grammar: Any = None
    # prompt_logprobs: entries of prompt tokens 1, 2, ... as the runner scores them, until they
    # are sent with the first output (then None, and a recompute after preemption adds nothing).
    prompt_logprobs: list | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) across the prompt / output boundary without copying both."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _STATUS_TO_REASON.get(self.status)

    def is_finished(self) -> bool:
        return self.status.finished
