"""EngineCore: the step loop (schedule -> execute -> update), usable in-process or in a process.

It knows nothing of text, HTTP or torch: requests arrive as token ids and leave as token ids.
The executor that runs the model is handed in, so the same loop drives the real model runner
and anything else that answers `execute(SchedulerOutput) -> ModelRunnerOutput`.
"""

from __future__ import annotations

from typing import Protocol

from servelm.engine.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelm.engine.request import Request
from servelm.engine.scheduler import Scheduler, SchedulerConfig


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, config: SchedulerConfig, executor: Executor) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.executor = executor

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return [
            EngineCoreOutput(
                request_id=r.request_id,
                new_token_ids=[],
                finish_reason="abort",
                num_prompt_tokens=r.num_prompt_tokens,
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in self.scheduler.abort_requests(request_ids)
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        """Run one forward over whatever the scheduler picks; return new tokens and stats."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            outputs: list[EngineCoreOutput] = []
            if scheduler_output.finished_request_ids:
                self.executor.execute(scheduler_output)  # let the runner drop finished state
        else:
            runner_output = self.executor.execute(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return outputs, self.scheduler.make_stats()

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()
