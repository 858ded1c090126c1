"""SimExecutor: the engine's executor with the GPU replaced by a step-time model.

It answers `execute(SchedulerOutput)` like the real model runner, sampling a dummy token for
every request whose prompt is complete, and prices the step's composition (`engine.step_trace`,
the same numbers a real engine's step trace records) with the roofline.

`last_step_s` is what the simulator advances the replica's clock by. The executor keeps no
per-request state, so finished and preempted requests need no clean-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from servelm.engine.step_trace import StepComposition, compose, sampled_request_ids
from servelm.sim.roofline import DeviceProfile, ModelCost, StepCost, step_cost

DUMMY_TOKEN = 0  # never an EOS the simulator sets up; requests run to max_tokens


def price(step: StepComposition, profile: DeviceProfile, cost: ModelCost) -> StepCost:
    """What the roofline model says a step of this composition costs on `profile`."""
    return step_cost(
        profile,
        cost,
        step.prefill_tokens,
        step.decode_tokens,
        step.context_tokens_read,
        step.attention_pairs,
        step.sampled_tokens,
        step.num_requests,
    )


@dataclass
class ExecutorTotals:
    """Sums over every step this executor priced (for reports and sanity checks)."""

    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    sampled_tokens: int = 0  # tokens generated, each request's first (from its prompt) included


class SimExecutor:
    """Prices each step with `step_cost(profile, cost, ...)` and samples `DUMMY_TOKEN`."""

    def __init__(self, profile: DeviceProfile, cost: ModelCost) -> None:
        self.profile = profile
        self.cost = cost
        self.last = StepComposition()
        self.last_step_s = 0.0
        self.totals = ExecutorTotals()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sampled = dict.fromkeys(sampled_request_ids(scheduler_output), DUMMY_TOKEN)
        step = self.last = compose(scheduler_output, len(sampled))
        if not step.num_requests:
            self.last_step_s = 0.0
            return ModelRunnerOutput(sampled)
        cost = price(step, self.profile, self.cost)
        self.last_step_s = cost.total_s
        totals = self.totals
        totals.steps += 1
        totals.busy_s += cost.total_s
        totals.prefill_tokens += step.prefill_tokens
        totals.decode_tokens += step.decode_tokens
        totals.sampled_tokens += step.sampled_tokens
        return ModelRunnerOutput(sampled)
