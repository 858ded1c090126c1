"""Prompt logprobs through the real engine on the tiny random-weight model, against transformers'
float32 log-softmax of the same prompt: whole, in chunks of a small budget, after a cached prefix,
beside plain requests (whose answers must not change), with max_tokens 0 and after preemption."""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.engine.request import Request
from servelm.engine.scheduler import Scheduler, SchedulerConfig

K = 3


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax predicting prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def random_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 380, (n,), generator=g).tolist()


def check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos, lp in enumerate(prompt_logprobs[1:], start=1):
        row = ref[pos - 1]
        assert lp.token_id == prompt[pos]
        assert abs(lp.logprob - float(row[prompt[pos]])) < 1e-4, pos
        assert lp.rank == int((row > row[prompt[pos]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
        for t, v in lp.top:
            assert abs(v - float(row[t])) < 1e-4


@pytest.mark.parametrize("budget", [2048, 16])
def test_prompt_logprobs_match_transformers(tiny_model_dir, hf_model, budget):
    """A 150-token prompt scored in one step, or in chunks of 16 (chunked prefill)."""
    llm = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=budget
    )
    prompt = random_prompt(0, 150)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
    assert len(out.outputs[0].token_ids) == 2
    llm.engine.check_integrity()


def test_cached_prefix_is_scored_and_plain_requests_unchanged(tiny_model_dir, hf_model):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    shared = random_prompt(1, 96)
    first = shared + random_prompt(2, 10)
    second = shared + random_prompt(3, 7)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([first, second], plain)]
    # the shared prefix is cached now; a scoring request must not skip it
    scoring = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([first, second, second], [plain, scoring, plain])
    assert outs[1].num_cached_tokens == 0 and outs[2].num_cached_tokens == 96
    check(outs[1].prompt_logprobs, second, reference(hf_model, second), k=0)
    # the scoring request and its plain twin beside it answer alike, and as without it
    assert [o.outputs[0].token_ids for o in outs] == [alone[0], alone[1], alone[1]]
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None


def test_max_tokens_zero_scores_without_generating(tiny_model_dir, hf_model):
    llm = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32
    )
    prompts = [random_prompt(4, 70), random_prompt(5, 1), random_prompt(6, 2)]
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == []
        assert out.outputs[0].text == ""
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
    # without prompt logprobs it only runs the prompt
    out = llm.generate(prompts[0], SamplingParams(max_tokens=0))[0]
    assert out.outputs[0].token_ids == [] and out.prompt_logprobs is None
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.usage() == 0.0


def test_recompute_after_preemption_adds_no_entries():
    """The scheduler keeps the positions scored before a preemption and takes from the
    recompute only what is new, whatever the chunks."""
    from servelm.engine.outputs import Logprobs, ModelRunnerOutput

    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=5))
    prompt = list(range(10, 22))  # 12 tokens: 11 to score
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))

    def scored(first: int, n: int) -> ModelRunnerOutput:
        entries = [Logprobs(prompt[t], -float(t), 1, []) for t in range(first, first + n)]
        return ModelRunnerOutput({}, prompt_logprobs={"a": (first, entries)})

    so = s.schedule()  # tokens 0..4: positions 1..5 scored
    assert s.update_from_output(so, scored(1, 5)) == []
    s._preempt(s.requests["a"])  # recomputed from 0, in other chunks
    for first, n, final in ((1, 5, False), (6, 5, False), (11, 1, True)):
        so = s.schedule()
        runner = scored(first, n)
        if final:
            runner.sampled_token_ids["a"] = 7
        outs = s.update_from_output(so, runner)
    (out,) = outs
    assert out.prompt_logprobs[0] is None
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == prompt[1:]
    assert [lp.logprob for lp in out.prompt_logprobs[1:]] == [-float(t) for t in range(1, 12)]
