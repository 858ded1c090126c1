"""What `LLM.generate` takes besides a string or a list of ids (vLLM's dict prompts), and what it
refuses by name before anything runs: priorities the scheduler would ignore, sampling params
changed since they were made, token ids outside the vocabulary, a grammar that does not
compile. After each refusal the next call answers as before."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams
from servelm.engine.sampling_params import InvalidParamError, StructuredOutput

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TEXT = "a b c"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=512, num_threads=1)


@pytest.fixture(scope="module")
def expected(llm):
    (out,) = llm.generate(TEXT, GREEDY)
    return out.prompt_token_ids, out.outputs[0].token_ids


def answers_as_before(llm, expected) -> None:
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(TEXT, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected


def test_vllm_dict_prompts_alone_and_in_a_list(llm, expected):
    ids, tokens = expected
    text_prompt, tokens_prompt = {"prompt": TEXT}, {"prompt_token_ids": ids}
    for prompts in (text_prompt, tokens_prompt, [text_prompt, tokens_prompt, TEXT]):
        outs = llm.generate(prompts, GREEDY)
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == [expected] * len(
            outs
        )
    assert [o.prompt for o in outs] == [TEXT, None, TEXT]  # (vLLM's: text only where given)


@pytest.mark.parametrize(
    "prompt, error, says",
    [
        (b"a b", TypeError, "got bytes"),  # (a Sequence of ints: once taken for token ids)
        ({"prompt": 5}, TypeError, "'prompt' must be a string"),
        ({"prompt_token_ids": "a b"}, TypeError, "must be a list of token ids"),
        ({"prompt": "a", "multi_modal_data": {}}, ValueError, "'multi_modal_data'"),
        ({}, ValueError, "empty dict"),
    ],
)
def test_other_prompts_are_refused(llm, expected, prompt, error, says):
    with pytest.raises(error, match=says):
        llm.generate(prompt, GREEDY)
    answers_as_before(llm, expected)


def test_priority_under_fcfs_or_one_short_is_refused(llm, expected):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[5, 1])
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([TEXT, TEXT], GREEDY, priority=[0])
    outs = llm.generate([TEXT], GREEDY, priority=[0])  # the default priority: nothing ignored
    assert outs[0].outputs[0].token_ids == expected[1]
    answers_as_before(llm, expected)


@pytest.mark.parametrize(
    "field, value",
    [("n", 0), ("temperature", -1.0), ("logprobs", 50), ("max_tokens", 3.5), ("stop", 5)],
)
def test_params_changed_after_they_were_made_are_checked_again(llm, expected, field, value):
    params = SamplingParams(temperature=0, max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(InvalidParamError, match=f"sampling params 1: {field}") as exc:
        llm.generate([TEXT, TEXT], [GREEDY, params])
    assert exc.value.param == field
    answers_as_before(llm, expected)


@pytest.mark.parametrize(
    "field, value", [("logit_bias", {0: 1.0, 10**6: 5.0}), ("stop_token_ids", [3, 10**6])]
)
def test_token_ids_outside_the_vocabulary_are_refused_before_any_runs(llm, expected, field, value):
    vocab = llm.info.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=4, **{field: value})
    says = rf"sampling params 1: {field}: token ids must be in \[0, {vocab}\), got {10**6}"
    with pytest.raises(InvalidParamError, match=says):
        llm.generate([TEXT, TEXT], [GREEDY, params])
    answers_as_before(llm, expected)
    edge = {field: {vocab - 1: 1.0} if field == "logit_bias" else [vocab - 1]}
    llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2, **edge))  # the last id is in


@pytest.mark.parametrize(
    "spec, says",
    [
        (StructuredOutput("regex", "[a-"), "unclosed character class"),
        (StructuredOutput("json", "{not json"), "not valid JSON"),
    ],
)
def test_a_grammar_that_does_not_compile_raises_the_engines_reason(llm, expected, spec, says):
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=spec)
    with pytest.raises(ValueError, match=says):
        llm.generate([TEXT, TEXT], [GREEDY, params])
    answers_as_before(llm, expected)


def test_a_json_schema_may_be_a_dict(llm):
    schema = {"type": "string", "enum": ["yes", "no"]}
    spec = StructuredOutput("json", schema)  # (vLLM's structured outputs take it so)
    (out,) = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=8, structured_output=spec))
    assert out.outputs[0].text in ('"yes"', '"no"')
    assert out.outputs[0].finish_reason == "stop"
