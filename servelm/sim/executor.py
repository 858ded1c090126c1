"""SimExecutor: the engine's executor with the GPU replaced by a step-time model.

It answers `execute(SchedulerOutput)` like the real model runner, sampling a dummy token for
every request whose prompt is complete, and prices the step with the roofline:

    per scheduled request   new = len(token_ids), prior = num_computed_tokens
    decode  (prior >= prompt length, one new token)   -> decode_tokens += 1
    prefill (a prompt chunk, first or later, or a recompute after preemption)
                                                      -> prefill_tokens += new
    context read += prior;   attention pairs += pairs_for_request(new, prior)

`last_step_s` is what the simulator advances the replica's clock by. The executor keeps no
per-request state, so finished and preempted requests need no clean-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from servelm.sim.roofline import DeviceProfile, ModelCost, step_cost

DUMMY_TOKEN = 0  # never an EOS the simulator sets up; requests run to max_tokens


@dataclass
class StepComposition:
    """What one step computed; the inputs of the step-time model."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens_read: int = 0
    attention_pairs: int = 0
    sampled_tokens: int = 0
    num_requests: int = 0


@dataclass
class ExecutorTotals:
    """Sums over every step this executor priced (for reports and sanity checks)."""

    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class SimExecutor:
    """Prices each step with `step_cost(profile, cost, ...)` and samples `DUMMY_TOKEN`."""

    def __init__(self, profile: DeviceProfile, cost: ModelCost) -> None:
        self.profile = profile
        self.cost = cost
        self.last = StepComposition()
        self.last_step_s = 0.0
        self.totals = ExecutorTotals()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        prefill = decode = context = pairs = 0
        sampled: dict[str, int] = {}
        # Hot loop (once per request per step): locals only, no helper calls.
        for r in scheduler_output.requests:
            prior = r.num_computed_tokens
            new = len(r.token_ids)
            if new == 1 and prior >= len(r.prompt_token_ids):
                decode += 1
            else:
                prefill += new
            context += prior
            pairs += new * prior + new * (new + 1) // 2  # pairs_for_request(new, prior)
            if r.sample:
                sampled[r.request_id] = DUMMY_TOKEN
        n = len(scheduler_output.requests)
        self.last = StepComposition(prefill, decode, context, pairs, len(sampled), n)
        if n == 0:
            self.last_step_s = 0.0
            return ModelRunnerOutput(sampled)
        cost = step_cost(
            self.profile, self.cost, prefill, decode, context, pairs, len(sampled), n
        )
        self.last_step_s = cost.total_s
        totals = self.totals
        totals.steps += 1
        totals.busy_s += cost.total_s
        totals.prefill_tokens += prefill
        totals.decode_tokens += decode
        return ModelRunnerOutput(sampled)
