"""SimExecutor: the engine's executor with the GPU replaced by a step-time model.

It answers `execute(SchedulerOutput)` like the real model runner, sampling a dummy token for
every request whose prompt is complete, and prices the step with the roofline:

    per scheduled request   new = len(token_ids), prior = num_computed_tokens
    one new token            -> decode_tokens += 1
    more (a prompt chunk, first or later, or a recompute after preemption)
                             -> prefill_tokens += new
    context read += prior;   attention pairs += pairs_for_request(new, prior)

A one-token prompt chunk counts as a decode: the roofline prices both the same (it only sums
them), so the split matters for token counts in reports, not for time.

`last_step_s` is what the simulator advances the replica's clock by. The executor keeps no
per-request state, so finished and preempted requests need no clean-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, mul

from servelm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from servelm.sim.roofline import DeviceProfile, ModelCost, StepCost, step_cost

DUMMY_TOKEN = 0  # never an EOS the simulator sets up; requests run to max_tokens
_TOKEN_IDS = attrgetter("token_ids")
_PRIOR = attrgetter("num_computed_tokens")
_REQUEST_ID = attrgetter("request_id")
_SAMPLE = attrgetter("sample")


@dataclass
class StepComposition:
    """What one step computed; the inputs of the step-time model."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens_read: int = 0
    attention_pairs: int = 0
    sampled_tokens: int = 0
    num_requests: int = 0

    def priced(self, profile: DeviceProfile, cost: ModelCost) -> StepCost:
        """What the roofline model says this step costs on `profile`."""
        return step_cost(
            profile,
            cost,
            self.prefill_tokens,
            self.decode_tokens,
            self.context_tokens_read,
            self.attention_pairs,
            self.sampled_tokens,
            self.num_requests,
        )


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
        reqs = scheduler_output.requests
        ids = map(_REQUEST_ID, reqs)
        sampled = dict.fromkeys(compress(ids, map(_SAMPLE, reqs)), DUMMY_TOKEN)
        step = self.last = compose(scheduler_output, len(sampled))
        if not step.num_requests:
            self.last_step_s = 0.0
            return ModelRunnerOutput(sampled)
        cost = step.priced(self.profile, self.cost)
        self.last_step_s = cost.total_s
        totals = self.totals
        totals.steps += 1
        totals.busy_s += cost.total_s
        totals.prefill_tokens += step.prefill_tokens
        totals.decode_tokens += step.decode_tokens
        return ModelRunnerOutput(sampled)


def compose(scheduler_output: SchedulerOutput, sampled: int | None = None) -> StepComposition:
    """The step-time inputs of one scheduled step (also used to label real, timed steps).

    `sampled`: how many requests sample a token this step, if the caller already counted them.
    """
    reqs = scheduler_output.requests
    n = len(reqs)
    # Runs once per step over every scheduled request: C-level map/sum, no Python loop, and
    # no per-request lists in the common all-decode step.
    total_new = sum(map(len, map(_TOKEN_IDS, reqs)))
    context = sum(map(_PRIOR, reqs))
    if total_new == n:  # every request computes one token: pairs_for_request(1, prior)
        decode, pairs = n, context + n
    else:  # sum of new*prior + new*(new+1)/2, the triangle summed exactly in integers
        news = list(map(len, map(_TOKEN_IDS, reqs)))
        priors = list(map(_PRIOR, reqs))
        decode = news.count(1)
        pairs = sum(map(mul, news, priors)) + (sum(map(mul, news, news)) + total_new) // 2
    if sampled is None:
        sampled = sum(map(_SAMPLE, reqs))
    return StepComposition(total_new - decode, decode, context, pairs, sampled, n)
