"""SamplingParams validation and the seeds of a request's choices."""

import math

import pytest

from servelm.engine.requests import child_requests
from servelm.engine.sampling_params import INT64, InvalidParamError, SamplingParams


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"min_p": math.nan}, "min_p"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"logit_bias": {3: -100.5}}, "logit_bias"),
    ],
)
def test_refused_values_name_their_parameter(kw, param):
    with pytest.raises(InvalidParamError) as exc:
        SamplingParams(**kw)
    assert exc.value.param == param


def test_choice_seeds_wrap_within_64_bits():
    low, high = INT64
    params = SamplingParams(n=3, seed=high, logit_bias={3: 100.0, 4: -100.0})
    seeds = [r.sampling_params.seed for r in child_requests("r", [1, 2], params, [])]
    assert seeds == [high, low, low + 1]
    assert all(r.sampling_params.logit_bias == {3: 100.0, 4: -100.0}
               for r in child_requests("r", [1, 2], params, []))  # fmt: skip


def test_a_models_unusable_defaults_are_left_out(tiny_model_dir, tmp_path, caplog):
    # a folder's generation_config.json with bad values: requests relying on the defaults get
    # the usable ones, not a 500 (a string) or a 400 blaming the client (top_k -5)
    import json
    import shutil

    from servelm.engine.requests import default_sampling_params
    from servelm.text.tokenizer import TextTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    odd = {"temperature": "hot", "top_k": -5, "top_p": 0.9, "repetition_penalty": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(odd))
    with caplog.at_level("WARNING", logger="servelm"):
        params = default_sampling_params(TextTokenizer(tmp_path))
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 0.9)
    assert params.repetition_penalty == 1.0
    assert "temperature = 'hot' is not a usable default" in caplog.text
    assert default_sampling_params(TextTokenizer(tmp_path), temperature=0).temperature == 0
