"""The C decode-attention kernel against the float64 reference and torch's SDPA path, in every
build this host can run (the AVX2 path and the generic loops: tests/kernels/variants.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from servelm.kernels.build import compiler
from servelm.kernels.paged_decode import PagedDecodeKernel
from servelm.worker.attention import TorchPagedAttention, build_metadata
from tests.kernels.variants import DECODE_VECTOR, flags, native, params

BLOCK = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the output's own rounding

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")


def make_cache(num_blocks, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(num_blocks * BLOCK, hkv, d, generator=g).to(dtype) for _ in range(2))]


def scattered_tables(lens, num_blocks, seed=0):
    """Each sequence's blocks, drawn at random from the pool (as a busy cache hands them out)."""
    perm = np.random.default_rng(seed).permutation(num_blocks).tolist()
    tables = []
    for n in lens:
        need = -(-n // BLOCK)
        tables.append(perm[:need])
        perm = perm[need:]
    return tables


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Attention of each decode query over its context, in float64, one sequence at a time."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    out = []
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)])
        k = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(16, 4, 2), (64, 9, 3), (128, 8, 8)])
def test_decode_matches_reference_and_sdpa(variant, dtype, d, hq, hkv):
    # Lengths cover one token, part of a block, whole blocks and blocks plus a remainder.
    lens = [1, 3, 16, 17, 64, 255]
    num_blocks = 64
    tables = scattered_tables(lens, num_blocks)
    kernel = PagedDecodeKernel.load(dtype, d, flags(variant))
    assert kernel is not None
    scale = d**-0.5
    g = torch.Generator().manual_seed(1)
    # q, k and v as views into one fused projection output, as the model hands them over.
    qkv = torch.randn(len(lens), hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    seqs = [(n - 1, 1, table) for n, table in zip(lens, tables, strict=True)]

    outs = {}
    for name, decode_kernel in (("kernel", kernel), ("sdpa", None)):
        caches = make_cache(num_blocks, hkv, d, dtype)
        attn = TorchPagedAttention(caches, scale, BLOCK, decode_kernel=decode_kernel)
        attn.meta = build_metadata(seqs, BLOCK, torch.device("cpu"), dtype)
        outs[name] = attn(0, q, k, v)
        # The new token's K/V landed in its slot.
        for b, (n, table) in enumerate(zip(lens, tables, strict=True)):
            slot = table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
            assert torch.equal(caches[0][0][slot], k[b]) and torch.equal(caches[0][1][slot], v[b])
    want = reference(q, *caches[0], tables, lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(outs["kernel"].double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(outs["sdpa"].double(), want, atol=tol, rtol=tol)


@needs_compiler
def test_decode_rows_of_a_mixed_step_match_sdpa(variant):
    # One prefill chunk (on top of cached tokens) between two decode tokens.
    dtype, d, hq, hkv = torch.float32, 64, 9, 3
    seqs = [(40, 1, [3, 7, 9]), (20, 12, [1, 5]), (99, 1, [0, 2, 4, 6, 8, 10, 11])]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(14, hq + 2 * hkv, d, generator=g)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    outs = []
    for decode_kernel in (PagedDecodeKernel.load(dtype, d, flags(variant)), None):
        attn = TorchPagedAttention(make_cache(12, hkv, d, dtype), 0.125, BLOCK, decode_kernel)
        attn.meta = build_metadata(seqs, BLOCK, torch.device("cpu"), dtype)
        assert not attn.meta.all_decode
        outs.append(attn(0, q, k, v))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_the_vector_path_is_in_the_builds_for_avx2_without_avx512(variant):
    # A build that lost it would send every decode step back to the generic loops unnoticed.
    kernel = PagedDecodeKernel.load(torch.bfloat16, 64, flags(variant))
    assert kernel.name.endswith("(AVX2)") == (variant in DECODE_VECTOR)
    assert not PagedDecodeKernel.load(torch.float32, 64, flags(variant)).name.endswith("(AVX2)")
    d16 = PagedDecodeKernel.load(torch.bfloat16, 16, flags(variant))
    assert not d16.name.endswith("(AVX2)")  # D % 32


@needs_compiler
def test_the_engines_build_takes_this_cpus_path():
    kernel = PagedDecodeKernel.load(torch.bfloat16, 64)
    assert kernel.name.endswith("(AVX2)") == (native() in DECODE_VECTOR)


@needs_compiler
@pytest.mark.parametrize("variant", params(DECODE_VECTOR), indirect=True)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 9])  # 9: more than the path takes
@pytest.mark.parametrize("d,hkv", [(64, 3), (128, 2), (32, 1)])
@pytest.mark.parametrize("batch", [1, 5])  # one sequence: its heads split between threads
def test_the_vector_path_matches_the_reference_and_the_generic_loops(variant, group, d, hkv, batch):
    # Lengths: one token, short and partial groups of 8 keys, a whole block, many blocks.
    lens = [1, 7, 9, 16, 300][:batch] if batch > 1 else [137]
    hq, num_blocks, scale = group * hkv, 40, d**-0.5
    tables = scattered_tables(lens, num_blocks, seed=group)
    g = torch.Generator().manual_seed(group)
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    k_cache, v_cache = make_cache(num_blocks, hkv, d, torch.bfloat16, seed=group)[0]
    block_tables = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.long)
    for b, table in enumerate(tables):
        block_tables[b, : len(table)] = torch.tensor(table)
    context = torch.tensor(lens, dtype=torch.long)
    args = (q, None, None, k_cache, v_cache, None, block_tables, BLOCK, context, max(lens), scale)
    vector = PagedDecodeKernel.load(torch.bfloat16, d, flags(variant))
    generic = PagedDecodeKernel.load(torch.bfloat16, d, flags("c"))
    out, plain = vector(*args), generic(*args)
    want = reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    # The same sums in another order: at most a bfloat16 rounding step apart.
    torch.testing.assert_close(out.float(), plain.float(), atol=1e-2, rtol=1e-2)


def test_no_kernel_for_other_dtypes_or_head_sizes():
    assert PagedDecodeKernel.load(torch.float16, 64) is None
    assert PagedDecodeKernel.load(torch.bfloat16, 80) is None


@needs_compiler
def test_shapes_that_disagree_are_refused_before_any_memory_is_touched():
    kernel = PagedDecodeKernel.load(torch.float32, 64)
    cache = torch.zeros(4 * BLOCK, 3, 64)
    q, kv = torch.zeros(2, 9, 64), torch.zeros(2, 3, 64)
    tables, lens = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, dtype=torch.long)
    slots = torch.zeros(2, dtype=torch.long)
    args = (cache, cache, slots, tables, BLOCK, lens, 1, 0.125)
    assert kernel(q, kv, kv, *args).shape == (2, 9, 64)
    for bad in (
        (q, kv, kv, cache, cache, slots, tables[:1], BLOCK, lens, 1, 0.125),  # a row short
        (q, kv, kv, cache, cache, slots[:1], tables, BLOCK, lens, 1, 0.125),
        (q[..., :32], kv, kv, *args),  # another head size
        (q, kv[:, :2], kv, *args),  # another number of KV heads
        (q[:, :8], kv, kv, *args),  # 8 query heads do not share 3 KV heads evenly
    ):
        with pytest.raises(ValueError, match="shapes disagree"):
            kernel(*bad)
