"""What callers of the offline API get back: text, token ids, finish reason, counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.engine.outputs import Logprobs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token, its logprob (the first None)
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text
