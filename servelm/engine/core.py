"""EngineCore: the step loop (schedule -> execute -> update), usable in-process or in a process.

It knows nothing of text, HTTP or torch: requests arrive as token ids and leave as token ids.
The executor that runs the model is handed in, so the same loop drives the real model runner
and anything else that answers `execute(SchedulerOutput) -> ModelRunnerOutput`.

A request with a `structured_output` waits outside the scheduler while its grammar compiles
(on the compiler's thread, `servelm.structured`), then joins the waiting queue; each step the
core hands the runner the token masks of the constrained requests that sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from servelm.engine.outputs import (
    EngineCoreOutput,
    ErrorKind,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelm.engine.request import Request
from servelm.engine.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from servelm.structured.matcher import StructuredOutputs

# With nothing to run but grammars compiling, a step waits this long for one (not a busy loop).
COMPILE_WAIT_SECONDS = 0.01


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.executor = executor
        self.structured = structured

    def add_request(self, request: Request) -> None:
        """ValueError: the request cannot be served as it is (its own fault, not the engine's)."""
        if request.sampling_params.structured_output is None:
            self.scheduler.add_request(request)
        elif self.structured is None:
            raise ValueError("this engine cannot constrain output (no tokenizer for grammars)")
        else:
            self.structured.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        aborted = self.scheduler.abort_requests(request_ids)
        if self.structured is not None and self.structured.compiling:
            aborted += self.structured.abort(request_ids)
        return [_final(r, "abort") for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(
            self.structured is not None and self.structured.compiling
        )

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        """Run one forward over whatever the scheduler picks; return new tokens and stats."""
        outputs = self._admit_compiled() if self.structured is not None else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:
                self.executor.execute(scheduler_output)  # let the runner drop finished state
        else:
            if self.structured is not None:
                scheduler_output.grammar_bitmask = self.structured.bitmask(scheduler_output)
            runner_output = self.executor.execute(scheduler_output)
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        return outputs, self.scheduler.make_stats()

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready join the scheduler; failed ones end with an error."""
        structured = self.structured
        if not structured.compiling:
            return []
        idle = not self.scheduler.has_unfinished_requests()
        ready, failed = structured.take_compiled(COMPILE_WAIT_SECONDS if idle else 0.0)
        # Both the request's fault: its grammar, or a prompt the context or KV pool has no room
        # for (the scheduler refuses those with ValueError, as it would have at add_request).
        outputs = [_failed(r, why) for r, why in failed]
        for request in ready:
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                request.grammar = None
                outputs.append(_failed(request, str(exc)))
        return outputs

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()


def _final(request: Request, reason: str) -> EngineCoreOutput:
    """The last output of a request that ends without a new token."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def _failed(request: Request, why: str) -> EngineCoreOutput:
    """The last output of a request refused for its own fault (`ErrorKind.REQUEST`)."""
    out = _final(request, "error")
    out.error, out.error_kind = why, ErrorKind.REQUEST
    return out
