"""The prefill-attention kernel (AMX tiles, AVX-512 BF16 vectors in their layout, or float32 in
AVX-512 or AVX2 vectors) against a float64 reference and torch's SDPA path: each path in its build
(tests/kernels/variants.py)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from servelm.kernels import variants
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.kernels.variants import prefill_fallback
from servelm.worker.attention import TorchPagedAttention
from tests.kernels.test_paged_decode import scattered_tables
from tests.kernels.variants import PREFILL, flags, native, params

# each test runs in the builds that have the kernel (all but c)
with_the_kernel = pytest.mark.parametrize("variant", params(PREFILL), indirect=True)
# the bf16 output's own rounding (~1e-2 at |x| ~ 2) plus, on tiles, P rounded to bf16
TOLERANCE = 1.6e-2


def reference(q, k_cache, v_cache, table, block, ctx, scale):
    """q [n, Hq, D] at the last n of ctx positions, causal, in float64."""
    n, hq, hkv = q.shape[0], q.shape[1], k_cache.shape[1]
    slots = torch.tensor([table[t // block] * block + t % block for t in range(ctx)])
    k = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)  # [ctx, Hq, D]
    v = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_kernel(kernel, q, caches, table, block, ctx, scale):
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    blocks = torch.tensor(table, dtype=torch.int64)
    return kernel(q, caches[0], caches[1], blocks, block, ctx, scale, out)


@with_the_kernel
@pytest.mark.parametrize(
    "d,hq,hkv,block", [(64, 9, 3, 16), (128, 8, 2, 16), (32, 6, 2, 32), (64, 4, 4, 32)]
)
def test_prefill_matches_reference(variant, d, hq, hkv, block):
    # n == ctx: a fresh prompt; n < ctx: a chunk after cached tokens (a prefix-cache hit or a
    # later chunk). Sizes cover one token, part of a 16-query tile, whole 32-key chunks and the
    # rests of both, a context ending in the first half of its last chunk, and a long one.
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, block, flags(variant))
    g = torch.Generator().manual_seed(d + hq)
    num_blocks = 160
    caches = [torch.randn(num_blocks * block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    scale = d**-0.5
    for n, ctx in [(1, 1), (7, 7), (16, 16), (40, 40), (1, 300), (5, 300), (37, 100),
                   (100, 1100), (33, 1041)]:  # fmt: skip
        (table,) = scattered_tables([ctx], num_blocks * 16 // block, seed=ctx)
        table = [b % num_blocks for b in table]
        # q as a strided view into a fused projection output, as the model hands it over
        qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).bfloat16() * 2
        q = qkv[:, :hq]
        got = run_kernel(kernel, q, caches, table, block, ctx, scale)
        want = reference(q, *caches, table, block, ctx, scale)
        err = (got.double() - want).abs().max().item()
        assert err < TOLERANCE, (n, ctx, err)


@with_the_kernel
def test_slots_past_the_context_are_never_read(variant):
    # The last block's slots past the context hold poison (a reused block's old rows, here
    # NaN): keys there are masked, values there packed as zeros, so the output stays finite.
    d, hq, hkv, block, ctx = 64, 9, 3, 16, 37  # 37: the last chunk's second half is past it
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, block, flags(variant))
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(8 * block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    table = [5, 2, 7]
    for cache in caches:
        cache[7 * block + ctx % block : 8 * block] = float("nan")
    q = torch.randn(ctx, hq, d, generator=g).bfloat16()
    got = run_kernel(kernel, q, caches, table, block, ctx, d**-0.5)
    want = reference(q, *caches, table, block, ctx, d**-0.5)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() < TOLERANCE


def many_chunks(kernel, chunks, seed, d=64, hq=9, hkv=3):
    """Inputs for paged_prefill_bf16_many (the C layer loop's call) for `chunks` [(new tokens,
    context)], and a function that runs it into a fresh output and returns that."""
    block = 16
    g = torch.Generator().manual_seed(seed)
    num_blocks = 200
    caches = [torch.randn(num_blocks * block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    total = sum(n for n, _ in chunks)
    qkv = torch.randn(total, hq + 2 * hkv, d, generator=g).bfloat16() * 2
    tables = [torch.tensor(t, dtype=torch.int64)
              for t in scattered_tables([ctx for _, ctx in chunks], num_blocks, seed=seed + 1)]  # fmt: skip
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    ptrs = ctypes.c_void_p * len(chunks)
    i64s = ctypes.c_int64 * len(chunks)
    fn = kernel.fn_many
    fn.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_float, ctypes.c_int64]  # fmt: skip
    fn.restype = None

    def run() -> torch.Tensor:
        out = torch.zeros(total, hq, d, dtype=torch.bfloat16)
        fn(len(chunks), ptrs(*(qkv[s].data_ptr() for s in starts)),
           ptrs(*(t.data_ptr() for t in tables)), i64s(*(n for n, _ in chunks)),
           i64s(*(c for _, c in chunks)), ptrs(*(out[s].data_ptr() for s in starts)),
           qkv.stride(0), caches[0].data_ptr(), caches[1].data_ptr(), block, hq, hkv, d,
           d**-0.5, out.stride(0))  # fmt: skip
        return out

    return qkv, caches, tables, starts, run


@with_the_kernel
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2), (64, 4, 4), (32, 32, 1), (32, 6, 3)])
def test_many_chunks_in_one_call_give_each_chunks_own_result_bit_for_bit(variant, d, hq, hkv):
    # paged_prefill_bf16_many (the C layer loop's call): decode tokens and short chunks (one
    # tile a head: packed and attended in one item; with AVX-512 BF16 vectors, up to 8 lanes,
    # with the products turned) beside longer chunks (their packing, then their tiles, shared
    # out), each the bits of the chunk alone.
    block = 16
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, block, flags(variant))
    chunks = [(1, 300), (1, 1), (40, 40), (5, 64), (6, 70), (1, 33), (2, 77), (3, 100), (21, 500)]
    qkv, caches, tables, starts, run = many_chunks(kernel, chunks, 3, d, hq, hkv)
    for _ in range(2):  # (the second call reuses the packed-V buffer)
        out = run()
        for (n, ctx), s, table in zip(chunks, starts, tables, strict=True):
            alone = torch.empty(n, hq, d, dtype=torch.bfloat16)
            kernel(qkv[s : s + n, :hq], *caches, table, block, ctx, d**-0.5, alone)
            assert torch.equal(out[s : s + n], alone), (n, ctx)


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2), (32, 6, 3), (96, 4, 4)])
def test_float32_paths_in_16_and_8_lanes_give_the_same_bits(d, hq, hkv):
    # An AVX-512 CPU without BF16 attends in 16 lanes, an AVX2 one in 8: every lane's
    # arithmetic and the softmax's update points are the same, so a prompt's tokens, a chunk
    # after cached ones and decode tokens (paged_prefill_bf16_many) come out the same to the
    # bit on both kinds, and so does greedy text. With a window and soft-capping too.
    for name in ("avx512-nobf16", "avx2"):
        if variants.unavailable(variants.get(name)):
            pytest.skip(f"this host cannot run {name}")
    wide, narrow = (PagedPrefillKernel.load(torch.bfloat16, d, 16, flags(name))
                    for name in ("avx512-nobf16", "avx2"))  # fmt: skip
    chunks = [
        (1, 300),
        (1, 1),
        (40, 40),
        (5, 64),
        (6, 70),
        (1, 33),
        (3, 100),
        (21, 500),
        (100, 700),
        (33, 641),
    ]  # fmt: skip (200 blocks of 16 in all)
    runs = [many_chunks(kernel, chunks, 3, d, hq, hkv) for kernel in (wide, narrow)]
    assert torch.equal(runs[0][-1](), runs[1][-1]())
    qkv, caches, tables, starts, _ = runs[0]
    for (n, ctx), s, table in zip(chunks, starts, tables, strict=True):
        for window, softcap in [(None, None), (50, None), (None, 30.0), (17, 5.0)]:
            got = [kernel(qkv[s : s + n, :hq], *caches, table, 16, ctx, d**-0.5,
                          torch.empty(n, hq, d, dtype=torch.bfloat16), window=window,
                          softcap=softcap) for kernel in (wide, narrow)]  # fmt: skip
            assert torch.equal(*got), (n, ctx, window, softcap)


@with_the_kernel
def test_many_chunks_called_from_two_threads_at_once_keep_their_own_buffers(variant):
    # Two engines in one process run their steps from their own threads: each call packs V
    # into a buffer of its calling thread, grown as its contexts grow, so neither frees or
    # overwrites what the other's call is reading.
    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, 16, flags(variant))
    jobs = [many_chunks(kernel, [(1, 40 + 60 * i), (30, 200 + 40 * i)], seed=10 + i)
            for i in range(2)]  # fmt: skip
    alone = [job[-1]() for job in jobs]
    failures = []

    def worker(i: int) -> None:
        for _ in range(60):
            if not torch.equal(jobs[i][-1](), alone[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@with_the_kernel
def test_attention_layer_with_and_without_the_kernel_agree(variant):
    # One step mixing a decode, a chunk after 50 cached tokens and a fresh 21-token prompt,
    # through TorchPagedAttention with the kernel and with SDPA + masks: the same outputs.
    d, hq, hkv, block = 64, 9, 3, 16
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, block, flags(variant))
    g = torch.Generator().manual_seed(2)
    seqs = [(30, 1, [3, 4]), (50, 19, [0, 1, 2, 9, 10]), (0, 21, [5, 6])]
    t = sum(new for _, new, _ in seqs)
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16()
    v = torch.randn(t, hkv, d, generator=g).bfloat16()
    base = [torch.randn(12 * block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    outs = []
    for prefill in (kernel, None):
        caches = [tuple(c.clone() for c in base)]
        attn = TorchPagedAttention(caches, d**-0.5, block, prefill_kernel=prefill)
        attn.plan(seqs, torch.device("cpu"), torch.bfloat16)
        masks = [chunk.causal is not None for chunk in attn.meta.prefills]
        assert masks == ([False, False] if prefill else [True, False])  # no mask for the kernel
        outs.append(attn(0, q, k, v).float())
    assert (outs[0] - outs[1]).abs().max().item() < TOLERANCE


def test_load_declines_what_it_cannot_run():
    assert PagedPrefillKernel.load(torch.float32, 64, 16) is None
    assert PagedPrefillKernel.load(torch.bfloat16, 48, 16) is None  # not a multiple of 32
    assert PagedPrefillKernel.load(torch.bfloat16, 64, 8) is None  # half a key tile per block


@with_the_kernel
def test_bad_shapes_are_refused(variant):
    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, 16, flags(variant))
    cache = torch.zeros(64, 3, 64, dtype=torch.bfloat16)
    blocks = torch.tensor([0, 1], dtype=torch.int64)
    q = torch.zeros(5, 9, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ok = (q, cache, cache, blocks, 16, 20, 0.125, out)
    kernel(*ok)
    for bad in (
        (q, cache, cache, blocks, 16, 40, 0.125, out),  # context longer than its blocks
        (q, cache, cache, blocks, 16, 4, 0.125, out),  # more queries than context
        (q[:, :8], cache, cache, blocks, 16, 20, 0.125, out[:, :8]),  # 8 heads over 3
        (q, cache, cache, blocks, 16, 20, 0.125, out[:4]),
    ):
        with pytest.raises(ValueError, match="shapes disagree"):
            kernel(*bad)


def test_each_build_has_its_path_or_none(variant):
    # The other tests run where a build has the kernel; this one fails if a build that should
    # have it lost it (that would send every prefill back to SDPA without a word), or if one
    # that has no path for it claims one.
    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, 16, flags(variant))
    path = PREFILL.get(variant)
    assert (kernel.name if kernel else None) == (f"paged_prefill_bf16 ({path})" if path else None)


def test_the_engines_build_takes_this_cpus_path():
    # an AMX CPU refused its tiles, whose own build then has no path, takes the avx512 build's
    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, 16)
    path = PREFILL.get(native()) or (PREFILL["avx512"] if prefill_fallback() is not None else None)
    assert (kernel.name if kernel else None) == (f"paged_prefill_bf16 ({path})" if path else None)
