"""Prompt logprobs of the default model as served (bfloat16, int4 projections, the C layer
kernels where the host has them): the same to the bit whether the prompt is scored in one step
or in chunks of 48 tokens (batch invariance), and near transformers' float32 ones (what bfloat16
and int4 weights allow; tests/server/test_prompt_logprobs_default.py holds float32 to 1e-3)."""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_served_dtype_scores_alike_in_chunks_and_near_transformers(default_model_dir):
    from transformers import AutoModelForCausalLM

    text = " ".join(
        f"Item {i}: the warehouse on street {i * 7 % 13} ships {i % 5 + 1} crates."
        for i in range(12)
    )
    scored = []
    for budget in (2048, 48):
        llm = LLM(str(default_model_dir), kv_cache_memory="256MiB", max_num_batched_tokens=budget)
        ids = llm.tokenizer.encode(text)
        out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=5))[0]
        scored.append([(lp.logprob, lp.rank, lp.top) for lp in out.prompt_logprobs[1:]])
        del llm
    assert len(ids) > 3 * 48
    assert scored[0] == scored[1]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    diffs = [abs(lp - float(ref[p][ids[p + 1]])) for p, (lp, _, _) in enumerate(scored[0])]
    assert max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.03, (
        max(diffs),
        sum(diffs) / len(diffs),
    )
