"""The sampler's greedy choice is argmax's: the first of tied largest logits, a NaN where a row
has one, the first token of a row of -inf."""

from __future__ import annotations

import pytest
import torch

from servelm.engine.outputs import ScheduledRequest
from servelm.engine.sampling_params import SamplingParams
from servelm.kernels.cpu_ops import CpuOps
from servelm.worker.sampler import SamplingBatch, sample

VOCAB = 49152  # the default model's: the size the sampler's reduction is tuned at


@pytest.mark.parametrize("with_c", [False, True], ids=["torch", "cpu_ops"])
def test_greedy_tokens_are_argmax_on_ties_nan_and_minus_inf(with_c):
    # (with_c: the pick in cpu_ops.c, as the engine makes it where the C kernels run)
    ops = CpuOps.load() if with_c else None
    if with_c and ops is None:
        pytest.skip("no C compiler here")
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, [700, 30000]] = 50.0  # a tie: the first
    logits[2, 1234] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 99.0  # the last token
    reqs = [
        ScheduledRequest(
            f"r{i}", [1], 0, [0], SamplingParams(temperature=0), True, [1], [], frozenset()
        )
        for i in range(len(logits))
    ]
    tokens, _ = sample(logits.clone(), SamplingBatch(reqs, [None] * len(reqs), [], None), ops)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[1:5] == [700, 1234, 0, VOCAB - 1]


def test_sampled_tokens_are_the_same_with_the_c_pick():
    # temperature > 0 draws by argmax(p / E): the C pick must draw the same tokens from the
    # same generators
    ops = CpuOps.load()
    if ops is None:
        pytest.skip("no C compiler here")
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=t) for t in (0.7, 1.0, 0.0, 1.3)] * 2
    reqs = [
        ScheduledRequest(f"r{i}", [1], 0, [0], p, True, [1], [], frozenset())
        for i, p in enumerate(params)
    ]

    def draw(with_ops):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(reqs))]
        return sample(logits.clone(), SamplingBatch(reqs, gens, [], None), with_ops)[0]

    assert draw(ops) == draw(None)
    assert len(set(draw(ops))) > 1
