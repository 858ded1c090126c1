"""The sampler's greedy choice is argmax's: the first of tied largest logits, a NaN where a row
has one, the first token of a row of -inf."""

from __future__ import annotations

import torch

from servelm.engine.outputs import ScheduledRequest
from servelm.engine.sampling_params import SamplingParams
from servelm.worker.sampler import SamplingBatch, sample

VOCAB = 49152  # the default model's: the size the sampler's reduction is tuned at


def test_greedy_tokens_are_argmax_on_ties_nan_and_minus_inf():
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
    tokens, _ = sample(logits.clone(), SamplingBatch(reqs, [None] * len(reqs), [], None))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[1:5] == [700, 1234, 0, VOCAB - 1]
