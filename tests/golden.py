"""Compare servelm's greedy output with Hugging Face transformers', the rule vLLM's tests use.

Token for token; at the first position where the two differ, each side's token must be among
the other's top-5 at that position (a near-tie that float rounding may flip), and the
comparison stops there.
"""

from __future__ import annotations

import torch

TOP = 5
# A greedy step whose two best logprobs lie closer than this is a near-tie: rounding anywhere
# may pick either token. Logits are float32, so exact ties are rare; the golden tests count
# them (NEAR_TIES, printed in pytest's summary) so that a failure there can be read as one.
NEAR_TIE = 1e-6
NEAR_TIES = {"steps": 0, "near ties": 0}


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], list[set[int]]]:
    ids = torch.tensor([prompt_ids])
    # Like ignore_eos: no stopping at eos, and (unlike min_new_tokens) no masking of it either.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    tops = [set(step[0].topk(TOP).indices.tolist()) for step in out.logits]
    return tokens, tops


def assert_close_greedy(ours, ours_tops: list[set[int]], theirs, their_tops: list[set[int]]) -> int:
    """Returns how many leading tokens agreed exactly."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            continue
        assert a in their_tops[i] and b in ours_tops[i], (
            f"diverged at {i}: servelm {a} (not in HF top-{TOP} {their_tops[i]}) / "
            f"HF {b} (ours top-{TOP} {ours_tops[i]})"
        )
        return i
    return len(ours)


def our_tops(completion) -> list[set[int]]:
    return [{t for t, _ in lp.top} for lp in completion.logprobs]


def count_near_ties(completion) -> int:
    """How many of a greedy completion's steps had their two best logprobs within NEAR_TIE
    (its logprobs must hold at least the top 2); added to NEAR_TIES."""
    ties = 0
    for lp in completion.logprobs:
        best = sorted((value for _, value in lp.top), reverse=True)
        ties += len(best) > 1 and best[0] - best[1] < NEAR_TIE
    NEAR_TIES["steps"] += len(completion.logprobs)
    NEAR_TIES["near ties"] += ties
    return ties


def compare_with_hf(
    llm, hf_model, prompts: list[list[int]], max_tokens: int, params_cls
) -> list[int]:
    params = params_cls(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    results = llm.generate(prompts, params)
    agreed = []
    for prompt, res in zip(prompts, results, strict=True):
        comp = res.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == max_tokens
        count_near_ties(comp)
        theirs, tops = hf_greedy(hf_model, prompt, max_tokens)
        agreed.append(assert_close_greedy(comp.token_ids, our_tops(comp), theirs, tops))
    return agreed
