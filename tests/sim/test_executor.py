"""SimExecutor: step composition, dummy samples and the priced step time."""

import pytest

from servelm.engine.outputs import ScheduledRequest, SchedulerOutput
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.step_trace import compose
from servelm.planner.catalog import get_model
from servelm.sim.executor import DUMMY_TOKEN, SimExecutor
from servelm.sim.roofline import PROFILES, ModelCost, pairs_for_request, step_time

H100 = PROFILES["h100-80gb"]
LLAMA_8B = ModelCost.from_shape(get_model("llama-3.1-8b"))


def sreq(rid: str, prompt: int, computed: int, new: int, sample: bool) -> ScheduledRequest:
    prompt_ids = list(range(prompt))
    outputs = [7] * max(0, computed + new - prompt)
    tokens = (prompt_ids + outputs)[computed : computed + new]
    return ScheduledRequest(
        rid, tokens, computed, [0], SamplingParams(), sample, prompt_ids, outputs
    )


def test_compose_mixed_step():
    out = SchedulerOutput(
        [
            sreq("a", 100, 0, 64, False),  # first chunk of a prompt
            sreq("b", 100, 64, 36, True),  # last chunk, samples
            sreq("c", 10, 12, 1, True),  # decode with 12 tokens of context
            sreq("d", 10, 30, 1, True),
        ]
    )
    step = compose(out)
    assert (step.prefill_tokens, step.decode_tokens) == (100, 2)
    assert step.context_tokens_read == 64 + 12 + 30
    assert step.attention_pairs == sum(
        pairs_for_request(n, p) for n, p in ((64, 0), (36, 64), (1, 12), (1, 30))
    )
    assert (step.sampled_tokens, step.num_requests) == (3, 4)


def test_execute_samples_and_prices():
    ex = SimExecutor(H100, LLAMA_8B)
    out = SchedulerOutput([sreq("p", 2000, 0, 2000, True), sreq("q", 50, 60, 1, True)])
    result = ex.execute(out)
    assert result.sampled_token_ids == {"p": DUMMY_TOKEN, "q": DUMMY_TOKEN}
    expected = step_time(
        H100, LLAMA_8B, 2000, 1, 60, pairs_for_request(2000, 0) + 61, 2, num_requests=2
    )
    assert ex.last_step_s == pytest.approx(expected)
    assert ex.totals.steps == 1 and ex.totals.prefill_tokens == 2000


def test_empty_step_costs_nothing():
    ex = SimExecutor(H100, LLAMA_8B)
    assert ex.execute(SchedulerOutput([])).sampled_token_ids == {}
    assert ex.last_step_s == 0.0 and ex.totals.steps == 0
