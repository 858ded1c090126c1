"""What `SamplingParams(...)` and `LLM(**engine_kwargs)` refuse by name, with no model loaded:
a value of the wrong type (once met deep in the engine step, or silently truncated), and an
engine argument the command line's choices and bounds refuse (`EngineArgs` checks the same
ones, with the same constants and argparse types)."""

from __future__ import annotations

import json

import pytest

from servelm.config import EngineArgs
from servelm.engine.sampling_params import InvalidParamError, SamplingParams, StructuredOutput


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 3.5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"structured_output": ("regex", "a")}, "structured_output"),
        ({"structured_output": StructuredOutput("regex", {"a": 1})}, "structured_output"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_by_name(kw, param):
    with pytest.raises(InvalidParamError) as exc:
        SamplingParams(**kw)
    assert exc.value.param == param
    assert param in str(exc.value)


def test_what_the_types_allow_still_passes():
    p = SamplingParams(temperature=0, top_p=1, seed=None, max_tokens=None, stop="x")
    assert p.stop == ["x"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    spec = StructuredOutput("json", {"type": "object"})  # a schema as vLLM takes it
    assert json.loads(spec.value) == {"type": "object"}
    assert StructuredOutput("choice", ["yes", "no"]).value == '["yes", "no"]'


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"quantization": "awq"}, "quantization: 'awq' is not one of auto, none, int4"),
        ({"dtype": "fp16"}, "dtype"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"block_size": 0}, "block_size: not an integer >= 1"),
        ({"max_model_len": 0}, "max_model_len: not an integer >= 1"),
        ({"max_model_len": 512.5}, "max_model_len"),
        ({"num_threads": True}, "num_threads"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"tensor_parallel_size": 65}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"device": "gpu"}, r"device: not a device \(auto, cpu, cuda or cuda:N\)"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory: not a size"),
    ],
)
def test_engine_args_refuse_what_the_command_line_refuses(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineArgs(**kw)


def test_engine_args_take_what_the_command_line_takes():
    args = EngineArgs(device="cuda:1", max_model_len=None, max_prefill_admit_tokens=0)
    assert (args.device, args.max_model_len, args.block_size) == ("cuda:1", None, 16)
    assert EngineArgs(kv_cache_memory="16MiB", gpu_memory_utilization=1).kv_cache_memory == 2**24
