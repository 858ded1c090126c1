"""Every bit of a 64-bit seed counts: torch's CPU generator keeps only the low 32, so seeds 1 and
2**32 + 1 drew the same tokens (worker/model_runner.py `seed32`)."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=512)


def tokens(llm, seed: int) -> list[int]:
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True)
    return llm.generate("Once upon a time", params)[0].outputs[0].token_ids


def test_seeds_that_differ_above_32_bits_draw_differently(llm):
    base = tokens(llm, 7)
    assert tokens(llm, 7) == base  # a seed repeats its draws
    for other in (7 + (1 << 32), 7 - (1 << 32), 7 + (1 << 63) - (1 << 62)):
        assert tokens(llm, other) != base, other
