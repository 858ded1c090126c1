"""Sliding-window models served end to end (issue #34): tiny random-weight Mistral and Qwen2
models made with transformers' own config classes, served by servelm's real loader and engine in
float32, greedy tokens and logprobs equal to transformers' on prompts longer than the window
(tests/model/family_harness.py: batched, prefix-cached, chunked, preempted, C kernels and torch);
and the KV cache of a windowed model holding about window / block_size blocks per sequence
through a long generation while a full-attention model's grow (and, slow, that generation
equal to transformers')."""

from __future__ import annotations

import json

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.model.config import spec_from_dict
from tests.golden import assert_close_greedy, hf_greedy, our_tops
from tests.model.family_harness import _hf_model, check_against_transformers, make_tiny_model

WINDOW = 16  # under prompts of 45-88 tokens and 32 generated


def spec_of(model_dir):
    return spec_from_dict(json.loads((model_dir / "config.json").read_text()))


def test_mistral_with_a_window_matches_transformers(tmp_path):
    model_dir = make_tiny_model(tmp_path, "MistralConfig", sliding_window=WINDOW)
    assert spec_of(model_dir).layer_windows == (WINDOW, WINDOW)
    # Every layer windowed: blocks behind the window go back to the pool, so 4 sequences of up
    # to 120 tokens need about 3 blocks each; 8 blocks still force preemption.
    seen = check_against_transformers(model_dir, tight_blocks=8)
    assert seen["preemptions_torch"] > 0


def test_qwen2_with_windows_on_some_layers_matches_transformers(tmp_path):
    # use_sliding_window with max_window_layers 1: layer 0 full, layers 1-2 windowed (nothing
    # can be given back while layer 0 reads every block)
    model_dir = make_tiny_model(
        tmp_path,
        "Qwen2Config",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    assert spec_of(model_dir).layer_windows == (None, WINDOW, WINDOW)
    check_against_transformers(model_dir, kernels=("auto",))


def held_blocks_during(llm, prompts, max_tokens):
    """Generate greedily; the most KV blocks any one sequence held after any step, and the
    tokens. The engine's own step, observed after each call."""
    engine, most = llm.engine, [0]
    step = engine.step

    def observed_step():
        out = step()
        kv = engine.scheduler.kv
        held = [kv.num_held_blocks(r.request_id) for r in engine.scheduler.running]
        most[0] = max([most[0], *held])
        return out

    engine.step = observed_step
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        results = llm.generate(prompts, params)
    finally:
        engine.step = step
    return most[0], results


def test_a_windowed_models_kv_stops_growing_past_the_window(tmp_path):
    # Two 40-token prompts, 200 tokens each (240 in all, 15 blocks of 16): with a 32-token
    # window each sequence holds at most 32 / 16 + 1 blocks (the window reaches into one more);
    # the same model without a window holds all 15.
    window, block = 32, 16
    windowed = make_tiny_model(tmp_path / "w", "MistralConfig", sliding_window=window)
    full = make_tiny_model(tmp_path / "f", "MistralConfig", sliding_window=None)
    most = {}
    for name, model_dir in (("windowed", windowed), ("full", full)):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB")
        most[name], _ = held_blocks_during(llm, long_prompts(), 200)
        llm.engine.check_integrity()
        assert llm.engine.scheduler.kv.usage() == 0.0
        del llm
    assert most["windowed"] <= window // block + 1, most
    assert most["full"] == -(-240 // block), most


def long_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 380, (40,), generator=g).tolist() for _ in range(2)]


@pytest.mark.slow
def test_a_long_windowed_generation_matches_transformers(tmp_path):
    # 300 tokens past 40-token prompts with a 32-token window: blocks given back all along, the
    # tokens transformers' (to the end, or to a near-tie far past the window)
    window = 32
    model_dir = make_tiny_model(tmp_path, "MistralConfig", sliding_window=window)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB")
    most, results = held_blocks_during(llm, long_prompts(), 300)
    assert most <= window // 16 + 1
    hf = _hf_model(str(model_dir))
    for prompt, res in zip(long_prompts(), results, strict=True):
        theirs, tops = hf_greedy(hf, prompt, 300)
        comp = res.outputs[0]
        agreed = assert_close_greedy(comp.token_ids, our_tops(comp), theirs, tops)
        assert agreed >= 4 * window, agreed
