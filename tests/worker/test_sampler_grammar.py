"""The sampler's grammar masks: constrained rows sample only allowed tokens, other rows are
bit for bit what they were."""

from __future__ import annotations

import numpy as np
import torch

from servelm.engine.outputs import ScheduledRequest
from servelm.engine.sampling_params import SamplingParams, StructuredOutput
from servelm.worker.sampler import SamplingBatch, apply_grammar_masks, sample

VOCAB = 100


def bits_allowing(tokens: list[int]) -> torch.Tensor:
    words = np.zeros((VOCAB + 31) // 32, dtype=np.uint32)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def request(rid: str, params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], 0, [0], params, True, [1], [], frozenset({2}))


def test_masks_touch_only_their_rows():
    logits = torch.randn(3, VOCAB)
    bits = torch.stack([bits_allowing([5, 31, 63, 99])])
    masked = apply_grammar_masks(logits, [1], bits)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == [5, 31, 63, 99]
    assert torch.equal(masked[1, allowed], logits[1, allowed])


def test_constrained_rows_sample_allowed_tokens_greedy_and_not():
    spec = StructuredOutput("regex", "x")
    reqs = [
        request("plain", SamplingParams(temperature=0)),
        request("greedy", SamplingParams(temperature=0, structured_output=spec)),
        request("hot", SamplingParams(temperature=1.0, seed=3, structured_output=spec)),
    ]
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(3, VOCAB)
        bits = torch.stack([bits_allowing([7, 40]), bits_allowing([2, 64, 65])])
        batch = SamplingBatch(reqs, [None, None, gen], [1, 2], bits)
        tokens, _ = sample(logits, batch)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in (7, 40) and tokens[2] in (2, 64, 65)


def test_logprobs_of_a_constrained_row_list_allowed_tokens_only():
    spec = StructuredOutput("regex", "x")
    reqs = [request("r", SamplingParams(temperature=0, logprobs=5, structured_output=spec))]
    batch = SamplingBatch(reqs, [None], [0], torch.stack([bits_allowing([3, 70])]))
    tokens, lps = sample(torch.randn(1, VOCAB), batch)
    assert tokens[0] in (3, 70)
    assert {t for t, _ in lps[0].top} == {3, 70}
