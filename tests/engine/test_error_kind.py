"""Whose fault an engine error is travels as a field (`EngineCoreOutput.error_kind`), through the
socket's encoding and the output processor to the delta the server answers from: the request's
own (its prompt has no room, its grammar does not compile) is a 400, the engine's a 500."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams
from servelm.engine.core_process import _add
from servelm.engine.messages import EngineCoreOutputs, EngineCoreRequest, decode, encode
from servelm.engine.output_processor import OutputProcessor, TextDelta
from servelm.engine.outputs import EngineCoreOutput, ErrorKind, ModelRunnerOutput
from servelm.engine.request import Request
from servelm.engine.sampling_params import StructuredOutput
from servelm.engine.scheduler import Scheduler, SchedulerConfig
from servelm.server.serving import error_status
from servelm.structured.matcher import GRAMMAR_ERROR, StructuredOutputs

MAX_LEN = 512


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=MAX_LEN, num_threads=1)


def constrained(value: str) -> SamplingParams:
    return SamplingParams(max_tokens=4, structured_output=StructuredOutput("regex", value))


def across_the_socket(llm, outs: list[EngineCoreOutput]) -> list[TextDelta]:
    """The outputs as the API process gets them: msgpack-encoded, decoded, turned into deltas."""
    kind, payload = decode(encode("step", EngineCoreOutputs(outs)))
    assert kind == "step"
    processor = OutputProcessor(llm.tokenizer)
    for out in payload.outputs:
        processor.add_request(out.request_id, SamplingParams())
    return [processor.process(out) for out in payload.outputs]


def engine_ends(llm, request: Request) -> EngineCoreOutput:
    """Add `request` to the LLM's engine core and step until its last output."""
    core = llm.engine
    core.add_request(request)
    for _ in range(500):
        for out in core.step()[0]:
            if out.request_id == request.request_id and out.finish_reason is not None:
                assert not core.has_unfinished_requests()
                return out
    raise AssertionError("the engine never ended the request")


def test_the_engines_refusals_cross_the_socket_as_the_requests_fault(llm):
    ids = llm.tokenizer.encode("a b c")
    eos = frozenset(llm.tokenizer.eos_token_ids)
    # refused as it arrives (the scheduler: an empty prompt) ...
    (empty,) = _add(llm.engine, EngineCoreRequest("empty", [], SamplingParams(), list(eos), 0.0))
    # ... once its grammar failed to compile ...
    bad_grammar = engine_ends(llm, Request("grammar", ids, constrained("[a-"), eos, 0.0))
    # ... and once it compiled, when the scheduler has no room for its prompt
    too_long = engine_ends(llm, Request("long", [5] * MAX_LEN, constrained("[a-c]+"), eos, 0.0))
    deltas = across_the_socket(llm, [empty, bad_grammar, too_long])
    assert [(d.finish_reason, d.error_kind) for d in deltas] == [("error", ErrorKind.REQUEST)] * 3
    assert [error_status(d) for d in deltas] == [400, 400, 400]
    # the messages are what they were
    assert deltas[0].error == "the prompt must not be empty"
    assert deltas[1].error.startswith(GRAMMAR_ERROR)
    assert "unclosed character class" in deltas[1].error
    assert deltas[2].error.startswith(f"This model's maximum context length is {MAX_LEN} tokens")


def test_a_grammar_the_engine_breaks_is_the_engines_fault(llm, tiny_model_dir):
    # A sampled token the grammar rejects: the mask should have ruled it out, so the engine
    # failed the request, not the request itself (a 500).
    tokenizer = llm.tokenizer
    structured = StructuredOutputs(tiny_model_dir / "tokenizer.json", llm.info.spec.vocab_size)
    try:
        request = Request(
            "r", tokenizer.encode("a b c"), constrained("[a-c]+"), frozenset({2}), 0.0
        )
        structured.add(request)
        ready, failed = structured.take_compiled(timeout=30.0)
        assert ready == [request] and not failed
    finally:
        structured.shutdown()
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=16, max_model_len=MAX_LEN))
    scheduler.add_request(request)
    step = scheduler.schedule()
    (z,) = tokenizer.encode("z", add_special_tokens=False)  # outside [a-c]
    (out,) = scheduler.update_from_output(step, ModelRunnerOutput({"r": z}))
    (delta,) = across_the_socket(llm, [out])
    assert delta.finish_reason == "error" and "doesn't satisfy the grammar" in delta.error
    assert delta.error_kind != ErrorKind.REQUEST
    assert error_status(delta) == 500


def test_the_offline_api_raises_the_requests_fault_as_a_value_error(llm):
    # (the scheduler refuses this prompt only once its grammar compiled, inside a step)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * MAX_LEN], constrained("[a-c]+"))
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate("a b c", constrained("[a-c]+"))
    assert set(out.outputs[0].text) <= set("abc")
