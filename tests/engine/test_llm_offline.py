"""The offline API refuses what it cannot run before running anything, and a call that fails
or is interrupted part-way leaves the LLM as it found it: the next call answers as before."""

from __future__ import annotations

import signal

import pytest

from servelm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=4096)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], GREEDY)]


def again(llm, expected) -> None:
    got = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], GREEDY)]
    assert got == expected


@pytest.mark.parametrize(
    "prompts, params, error, says",
    [
        ([""], GREEDY, ValueError, "prompt 0 is empty"),
        (["a b", []], GREEDY, ValueError, "prompt 1 is empty"),
        (["a b", [1, 10**6]], GREEDY, ValueError, "token ids must be in"),
        ([[1, -1]], GREEDY, ValueError, "token ids must be in"),
        ([[1.5, 2]], GREEDY, TypeError, "list of token ids"),
        (["a", "b"], [GREEDY], ValueError, "2 prompts but 1 sampling params"),
        (["a"], {"max_tokens": 3}, TypeError, "must be a SamplingParams"),
        (["a b", "word " * 5000], GREEDY, ValueError, "maximum context length"),
    ],
)
def test_bad_input_is_refused_and_the_next_call_answers_as_before(
    llm, expected, prompts, params, error, says
):
    with pytest.raises(error, match=says):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    again(llm, expected)


def test_an_interrupted_call_leaves_nothing_behind(llm, expected):
    # Ctrl-C in a notebook: KeyboardInterrupt lands mid-generation
    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["once", "upon"], long)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not llm.engine.has_unfinished_requests()
    again(llm, expected)


def test_a_generator_of_prompts_is_taken(llm, expected):
    got = llm.generate((p for p in ["a b c", "d e"]), GREEDY)
    assert [o.outputs[0].token_ids for o in got] == expected
