"""Tests for servelm.bench.workload: determinism, length distributions, exact token counts."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from servelm.bench.client import Target, build_payload
from servelm.bench.workload import (
    PromptBuilder,
    WorkloadSpec,
    build_workload,
    load_dataset,
    load_tokenizer,
    sample_length,
    word_vocabulary,
)


def count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_presets_and_overrides() -> None:
    assert WorkloadSpec.from_preset("chat").input_len == 500
    rag = WorkloadSpec.from_preset("rag")
    assert (rag.input_len, rag.output_len, rag.prefix_len) == (6000, 250, 0)
    spec = WorkloadSpec.from_preset("shared-prefix", prefix_len=64, input_len=None)
    assert (spec.prefix_len, spec.input_len) == (64, 100)
    with pytest.raises(ValueError):
        WorkloadSpec.from_preset("nope")
    with pytest.raises(ValueError):
        WorkloadSpec(len_dist="zipf")


def test_same_seed_same_prompts(trained_bpe: Tokenizer) -> None:
    spec = WorkloadSpec(input_len=60, output_len=20, len_dist="uniform")
    first = build_workload(spec, seed=7, tokenizer=trained_bpe)
    again = build_workload(spec, seed=7, tokenizer=trained_bpe)
    other = build_workload(spec, seed=8, tokenizer=trained_bpe)
    a = [first.request(i) for i in range(5)]
    assert a == [again.request(i) for i in range(5)]
    assert [r.prompt for r in a] != [other.request(i).prompt for i in range(5)]
    # request i does not depend on the order requests are drawn in
    assert first.request(3) == again.request(3)
    # separate streams (sweep levels, warm-up) do not repeat each other's prompts
    assert first.request(0, "level0").prompt != first.request(0, "level1").prompt


@pytest.mark.parametrize("fixture", ["word_tokenizer", "trained_bpe"])
@pytest.mark.parametrize("n", [1, 7, 64, 500])
def test_prompts_have_exact_token_counts(fixture: str, n: int, request) -> None:
    tokenizer = request.getfixturevalue(fixture)
    builder = PromptBuilder(tokenizer)
    rng = random.Random(n)
    text, real = builder.build(rng, n)
    assert real == n
    assert count(tokenizer, text) == n


def test_workload_records_real_counts(trained_bpe: Tokenizer) -> None:
    spec = WorkloadSpec(input_len=80, output_len=16, len_dist="lognormal", len_spread=0.4)
    workload = build_workload(spec, seed=1, tokenizer=trained_bpe)
    for i in range(10):
        req = workload.request(i)
        assert req.prompt_tokens == count(trained_bpe, req.prompt)
        assert req.output_tokens >= 1


def test_word_vocabulary_is_single_tokens(trained_bpe: Tokenizer) -> None:
    words = word_vocabulary(trained_bpe)
    assert len(words) >= 16 and words == sorted(set(words))
    assert all(count(trained_bpe, " " + w) == 1 for w in words)


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert {sample_length(rng, 500, "fixed", 0.5) for _ in range(10)} == {500}
    uniform = [sample_length(rng, 500, "uniform", 0.5) for _ in range(2000)]
    assert min(uniform) >= 250 and max(uniform) <= 750
    assert statistics.mean(uniform) == pytest.approx(500, rel=0.03)
    lognormal = [sample_length(rng, 250, "lognormal", 0.5) for _ in range(5000)]
    assert min(lognormal) >= 1
    assert statistics.mean(lognormal) == pytest.approx(250, rel=0.05)
    assert statistics.median(lognormal) < 250  # right-skewed
    assert sample_length(rng, 0, "uniform", 0.5) == 0


def test_shared_prefix_is_common_to_every_request(trained_bpe: Tokenizer) -> None:
    spec = WorkloadSpec.from_preset("shared-prefix", prefix_len=40, input_len=10)
    workload = build_workload(spec, seed=3, tokenizer=trained_bpe)
    a, b = workload.request(0, "level0"), workload.request(1, "level1")
    assert a.system == b.system and a.system is not None
    assert count(trained_bpe, a.system) == 40
    assert a.prompt != b.prompt
    assert a.prompt_tokens == 40 + count(trained_bpe, a.prompt)
    chat = build_payload(Target("http://x/v1", "m"), a)
    assert chat["messages"][0] == {"role": "system", "content": a.system}
    completion = build_payload(Target("http://x/v1", "m", endpoint="completions"), a)
    assert completion["prompt"].startswith(a.system)


def test_payload_pins_output_length(word_tokenizer: Tokenizer) -> None:
    workload = build_workload(WorkloadSpec(input_len=5, output_len=9), 0, word_tokenizer)
    body = build_payload(Target("http://x/v1", "m"), workload.request(0))
    assert body["max_tokens"] == 9 and body["min_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    plain = build_payload(Target("http://x/v1", "m", ignore_eos=False), workload.request(0))
    assert "ignore_eos" not in plain and "min_tokens" not in plain


def test_dataset(tmp_path: Path, word_tokenizer: Tokenizer) -> None:
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "alpha bravo charlie", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "delta echo"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = WorkloadSpec(output_len=7, dataset=str(path))
    no_tokenizer = build_workload(spec, seed=0)
    first, second, third = (no_tokenizer.request(i) for i in range(3))
    assert (first.prompt, first.output_tokens, first.prompt_tokens) == (rows[0]["prompt"], 5, None)
    assert second.messages == rows[1]["messages"] and second.output_tokens == 7
    assert third.prompt == first.prompt  # the file cycles
    counted = build_workload(spec, seed=0, tokenizer=word_tokenizer)
    assert [counted.request(i).prompt_tokens for i in range(2)] == [3, 2]
    with pytest.raises(ValueError, match="completions"):
        build_payload(Target("http://x/v1", "m", endpoint="completions"), second)


@pytest.mark.parametrize(
    "line", ['{"text": "x"}', "not json", '{"prompt": "x", "max_tokens": 0}', "[1, 2]"]
)
def test_dataset_rejects_bad_lines(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_dataset(path)


def test_load_tokenizer_from_folder(tmp_path: Path, word_tokenizer: Tokenizer) -> None:
    word_tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("alpha zulu").ids == word_tokenizer.encode("alpha zulu").ids
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_default_tokenizer_comes_from_the_model_store(
    tmp_path: Path, word_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import servelm.store.default

    word_tokenizer.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(servelm.store.default, "ensure_default_model", lambda: tmp_path)
    assert load_tokenizer(None).get_vocab() == word_tokenizer.get_vocab()
