"""The last layer computes only the rows a step samples from (`attention.py`, `kept_rows`)."""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.kernels.paged_decode import PagedDecodeKernel
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.worker.attention import TorchPagedAttention, build_metadata

CPU = torch.device("cpu")
D, HQ, HKV, BLOCK = 64, 9, 3, 16
# (cached, new, blocks): a decode, a prompt chunk that does not finish its prompt, a fresh
# prompt that does, one new token of a prompt that is not finished yet (it attends as a
# decode does), and another decode
SEQS = [(30, 1, [3, 4]), (50, 19, [0, 1, 2, 9, 10]), (0, 21, [5, 6]), (40, 1, [7, 8, 11]),
        (16, 1, [12, 13])]  # fmt: skip
SAMPLE = [True, False, True, False, True]


def test_the_kept_rows_are_the_sampled_last_tokens_and_every_decode_row():
    meta = build_metadata(SEQS, BLOCK, CPU, sample=SAMPLE)
    # rows: 0 decode | 1-19 chunk | 20-40 prompt | 41 one token | 42 decode
    assert meta.kept_rows.tolist() == [0, 40, 41, 42]
    assert meta.decode_kept.tolist() == [0, 2, 3]  # the decode rows 0, 41, 42 among them
    assert meta.decode_runs == [(0, 0, 1, 0), (41, 1, 3, 2)]  # rows 41-42: one run
    assert [chunk.kept for chunk in meta.prefills] == [-1, 1]
    assert meta.sample_rows.tolist() == [0, 1, 3]  # the sampling requests' places among them
    every = build_metadata(SEQS, BLOCK, CPU)
    assert every.kept_rows.tolist() == [0, 19, 40, 41, 42]
    assert every.sample_rows.tolist() == [0, 1, 2, 3, 4]
    assert every.decode_runs == [(0, 0, 1, 0), (41, 1, 3, 3)]
    decodes = [(5, 1, [0]), (9, 1, [1])]  # a decode step keeps every row: no list at all
    meta = build_metadata(decodes, BLOCK, CPU, sample=[True, False])
    assert meta.kept_rows is None and meta.sample_rows.tolist() == [0]
    assert meta.decode_runs == [(0, 0, 2, 0)]  # every row kept: places are the rows


def attention_both_ways(decode, prefill):
    """Attention of one layer for SEQS over random caches: every row, and the kept rows alone;
    with the K/V each call left in the caches."""
    g = torch.Generator().manual_seed(0)
    t = sum(new for _, new, _ in SEQS)
    q = torch.randn(t, HQ, D, generator=g).bfloat16()
    k = torch.randn(t, HKV, D, generator=g).bfloat16()
    v = torch.randn(t, HKV, D, generator=g).bfloat16()
    base = [torch.randn(16 * BLOCK, HKV, D, generator=g).bfloat16() for _ in range(2)]
    outs, caches = [], []
    for kept_only in (False, True):
        cache = [tuple(c.clone() for c in base)]
        attn = TorchPagedAttention(cache, D**-0.5, BLOCK, decode, prefill)
        attn.plan(SEQS, CPU, torch.bfloat16, SAMPLE)
        outs.append(attn(0, q, k, v, kept_only=kept_only))
        caches.append(cache[0])
    return outs[0][attn.kept_rows], outs[1], caches


def test_torch_attention_of_the_kept_rows_alone():
    every, kept, caches = attention_both_ways(None, None)
    assert kept.shape == (4, HQ, D)
    assert (every.float() - kept.float()).abs().max().item() < 1e-2  # SDPA's own rounding
    # every token's K/V is stored, the chunk's that samples nothing too
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


def test_the_c_kernels_give_the_kept_rows_bit_for_bit():
    decode = PagedDecodeKernel.load(torch.bfloat16, D)
    prefill = PagedPrefillKernel.load(torch.bfloat16, D, BLOCK)
    if decode is None or prefill is None:
        pytest.skip("no C attention kernels on this machine")
    every, kept, caches = attention_both_ways(decode, prefill)
    assert torch.equal(every, kept)  # a query's result does not depend on the others
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


def test_the_model_returns_the_kept_rows_as_the_whole_step_computes_them(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", device="cpu")
    runner = llm.engine.executor
    model, attn = runner.model, runner.attn
    ids = torch.arange(5, 5 + sum(new for _, new, _ in SEQS))
    pos = torch.cat([torch.arange(done, done + new) for done, new, _ in SEQS])
    outs = []
    with torch.inference_mode():
        for sample in (SAMPLE, None):
            for layer_k, layer_v in attn.kv_caches:
                torch.manual_seed(1)
                layer_k.normal_()
                layer_v.normal_()
            attn.plan(SEQS, CPU, torch.float32, sample)
            kept = attn.kept_rows
            outs.append(model(ids, pos, attn))
    assert kept.tolist() == [0, 19, 40, 41, 42]  # every prompt samples in the second
    assert outs[0].shape == (4, outs[1].shape[1])
    torch.testing.assert_close(outs[0], outs[1][[0, 2, 3, 4]], rtol=1e-5, atol=1e-5)


def test_chunked_prompts_generate_as_whole_ones(tiny_model_dir):
    # Steps of 8 tokens: most of a 40-token prompt's steps sample nothing, and the last layer
    # computes no rows there.
    prompt = [3 + (7 * i) % 200 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = []
    for budget in (8, 512):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", device="cpu",
                  max_num_batched_tokens=budget, enable_prefix_caching=False)  # fmt: skip
        outs.append([o.outputs[0].token_ids for o in llm.generate([prompt, prompt[:9]], params)])
        llm.engine.check_integrity()
    assert outs[0] == outs[1]
