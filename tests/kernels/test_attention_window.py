"""Per-layer attention options (issue #34) in every attention path: a sliding window, a scale
of the model's own and tanh soft-capping, in the C decode kernel (every build), the C prefill
kernel (its builds: AMX tiles, AVX-512 BF16, AVX-512, AVX2) and the torch path (SDPA with
per-window masks, or the scores computed in float32 where soft-capping is on), against a
float64 reference.

Blocks wholly before every query's window may have been given back to the pool
(engine/kv_cache), their table entries then naming another request's block: here they name a
block of NaN, which the C kernels must never read (a NaN read and masked still poisons the
values' sums)."""

from __future__ import annotations

import pytest
import torch

from servelm.kernels.build import compiler
from servelm.kernels.paged_decode import PagedDecodeKernel
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.worker.attention import TorchPagedAttention
from tests.kernels.test_paged_decode import scattered_tables
from tests.kernels.variants import PREFILL, flags, params

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
with_the_prefill_kernel = pytest.mark.parametrize("variant", params(PREFILL), indirect=True)
BLOCK = 16
NUM_BLOCKS = 64
POISON = NUM_BLOCKS  # one block past the others, all NaN: a block given back
# (window, scale, soft-cap): a window across a block boundary and one inside a block (and a
# 16-key tile half); Gemma 2's kind of scale (query_pre_attn_scalar ** -0.5) and caps small
# enough to bend these scores
OPTIONS = [(20, None, None), (None, 0.2, 3.0), (7, 0.2, 2.0)]


def reference(q, k_cache, v_cache, table, ctx, scale, window, softcap):
    """q [n, Hq, D], the last n of ctx positions, in float64."""
    n, hq, hkv = q.shape[0], q.shape[1], k_cache.shape[1]
    t = torch.arange(ctx)
    slots = torch.tensor(table)[t // BLOCK] * BLOCK + t % BLOCK
    k = k_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
    v = v_cache[slots].double().repeat_interleave(hq // hkv, dim=1)
    pos, keys = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    allowed = keys <= pos
    if window:
        allowed &= keys > pos - window
    seen = allowed.any(0)  # keys no query sees (in given-back blocks: NaN) are left out
    k, v = k * seen[:, None, None], v.nan_to_num() * seen[:, None, None]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.nan_to_num()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def caches(hkv, d, dtype, seed=0):
    """K and V caches of NUM_BLOCKS blocks of random rows and one more (POISON) of NaN."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        cache = torch.randn((NUM_BLOCKS + 1) * BLOCK, hkv, d, generator=g).to(dtype)
        cache[POISON * BLOCK :] = float("nan")
        out.append(cache)
    return out


def given_back(table, first_query_pos, window):
    """The table with the blocks that the KV cache gives back (wholly before the first query's
    window) pointing at the poisoned block."""
    if not window:
        return list(table)
    first = max(0, first_query_pos - window + 1)
    return [POISON if (j + 1) * BLOCK <= first else b for j, b in enumerate(table)]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(16, 4, 2), (64, 9, 3)])
@pytest.mark.parametrize("window,scale,softcap", OPTIONS)
def test_decode_kernel_window_scale_softcap(variant, dtype, d, hq, hkv, window, scale, softcap):
    lens = [1, 5, 16, 21, 33, 64, 200]  # shorter than, equal to and past the windows
    kernel = PagedDecodeKernel.load(dtype, d, flags(variant))
    scale = scale or d**-0.5
    k_cache, v_cache = caches(hkv, d, dtype, seed=d)
    tables = [
        given_back(t, n - 1, window)
        for t, n in zip(scattered_tables(lens, NUM_BLOCKS, seed=hq), lens, strict=True)
    ]
    block_tables = torch.full((len(lens), max(map(len, tables))), POISON, dtype=torch.long)
    for b, table in enumerate(tables):
        block_tables[b, : len(table)] = torch.tensor(table)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = kernel(
        q, None, None, k_cache, v_cache, None, block_tables, BLOCK,
        torch.tensor(lens), max(lens), scale, window, softcap,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        want = reference(q[b : b + 1], k_cache, v_cache, table, n, scale, window, softcap)[0]
        torch.testing.assert_close(got[b].double(), want, atol=tol, rtol=tol)


@needs_compiler
@with_the_prefill_kernel
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2)])
@pytest.mark.parametrize("window,scale,softcap", OPTIONS)
def test_prefill_kernel_window_scale_softcap(variant, d, hq, hkv, window, scale, softcap):
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, BLOCK, flags(variant))
    scale = scale or d**-0.5
    k_cache, v_cache = caches(hkv, d, torch.bfloat16, seed=d)
    g = torch.Generator().manual_seed(hq)
    # a fresh prompt, chunks after cached tokens (a later chunk, a prefix hit), one token alone
    for n, ctx in [(1, 1), (40, 40), (16, 100), (5, 300), (37, 100), (1, 250), (70, 330)]:
        (table,) = scattered_tables([ctx], NUM_BLOCKS, seed=ctx)
        table = given_back(table, ctx - n, window)
        q = torch.randn(n, hq, d, generator=g).bfloat16() * 2
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        blocks = torch.tensor(table, dtype=torch.int64)
        got = kernel(q, k_cache, v_cache, blocks, BLOCK, ctx, scale, out, window, softcap)
        want = reference(q, k_cache, v_cache, table, ctx, scale, window, softcap)
        assert torch.isfinite(got).all(), (n, ctx)
        err = (got.double() - want).abs().max().item()
        assert err < 1.6e-2, (n, ctx, err)


@needs_compiler
@with_the_prefill_kernel
@pytest.mark.parametrize("window,softcap", [(20, None), (48, 3.0)])
def test_prefill_kernel_query_alone_equals_it_in_a_chunk_with_a_window(variant, window, softcap):
    # Batch invariance: a query's attention does not depend on the chunk it comes in, even where
    # the chunk's first query reaches further back than its own window.
    d, hq, hkv = 64, 9, 3
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, BLOCK, flags(variant))
    k_cache, v_cache = caches(hkv, d, torch.bfloat16, seed=5)
    ctx = 300
    (table,) = scattered_tables([ctx], NUM_BLOCKS, seed=7)
    blocks = torch.tensor(table)
    q_all = torch.randn(ctx, hq, d, generator=torch.Generator().manual_seed(9)).bfloat16()

    def attend(first: int, n: int) -> torch.Tensor:
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        return kernel(
            q_all[first : first + n], k_cache, v_cache, blocks, BLOCK, first + n, 0.1, out,
            window, softcap,
        )  # fmt: skip

    for first, n in [(0, ctx), (5, 60), (37, 16), (100, 200), (299, 1)]:
        chunk = attend(first, n)
        for i in sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))):
            assert torch.equal(attend(first + i, 1)[0], chunk[i]), (first, n, i)


def attention_layer_outputs(prefill, decode, dtype, window, softcap, invariant=False):
    """One step mixing two decodes, a chunk after cached tokens and a fresh prompt, through
    TorchPagedAttention with per-layer options (layer 1 windowed, layer 0 not): each layer's
    output and its float64 reference."""
    d, hq, hkv = 64, 9, 3
    g = torch.Generator().manual_seed(4)
    seqs = [(70, 1, [3, 4, 5, 6, 7]), (50, 19, [0, 1, 2, 9, 10]), (0, 40, [11, 12, 13]),
            (33, 1, [14, 15, 16])]  # fmt: skip
    t = sum(new for _, new, _ in seqs)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    base = [torch.randn(20 * BLOCK, hkv, d, generator=g).to(dtype) for _ in range(2)]
    kv = [tuple(c.clone() for c in base) for _ in range(2)]
    attn = TorchPagedAttention(
        kv, 0.2, BLOCK, decode, prefill, invariant, layer_windows=(None, window), softcap=softcap
    )
    attn.plan(seqs, torch.device("cpu"), dtype)
    outs = [attn(layer, q, k, v).double() for layer in range(2)]
    wants = []
    for layer, w in enumerate((None, window)):  # from the caches as the layer stored them
        rows, row = [], 0
        for done, new, table in seqs:
            rows.append(
                reference(q[row : row + new], *kv[layer], table, done + new, 0.2, w, softcap)
            )
            row += new
        wants.append(torch.cat(rows))
    return outs, wants


@pytest.mark.parametrize("window,softcap", [(20, None), (24, 3.0), (None, 3.0)])
def test_torch_path_window_softcap(window, softcap):
    outs, wants = attention_layer_outputs(None, None, torch.float32, window, softcap)
    for got, want in zip(outs, wants, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("window,softcap", [(20, None), (24, 3.0)])
def test_attention_layer_with_the_decode_kernel(variant, window, softcap):
    kernel = PagedDecodeKernel.load(torch.float32, 64, flags(variant))
    outs, wants = attention_layer_outputs(None, kernel, torch.float32, window, softcap)
    for got, want in zip(outs, wants, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_compiler
@with_the_prefill_kernel
@pytest.mark.parametrize("window,softcap", [(20, None), (24, 3.0)])
@pytest.mark.parametrize("invariant", [False, True])  # decodes as chunks of one, or not
def test_attention_layer_with_the_prefill_kernel(variant, window, softcap, invariant):
    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, BLOCK, flags(variant))
    decode = PagedDecodeKernel.load(torch.bfloat16, 64, flags(variant))
    outs, wants = attention_layer_outputs(
        kernel, decode, torch.bfloat16, window, softcap, invariant
    )
    for got, want in zip(outs, wants, strict=True):
        assert (got - want).abs().max().item() < 1.6e-2
