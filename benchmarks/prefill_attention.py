"""Prefill attention per layer: servelm's C kernel (AMX tiles, or AVX2) against torch's SDPA path, side by side.

    .venv/bin/python benchmarks/prefill_attention.py [--repeat 100] [--variant avx512-nobf16]
        [--b-variant avx2]

The default model's heads (9 query heads over 3 KV heads of 64), a paged cache of 16-token
blocks scattered over the pool. For each (new tokens, context) it times the kernel and what the
engine ran before it (gather the context's blocks, SDPA with an offset causal mask, or causal
SDPA when nothing was cached), prints microseconds, the ratio, and the largest difference
between the two outputs. `--variant`: the kernel of another build (its flags); `--b-variant`:
that build's kernel in SDPA's place, the two timed in turn.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from servelm.kernels import variants
from servelm.kernels.paged_prefill import PagedPrefillKernel

HQ, HKV, D, BLOCK = 9, 3, 64, 16
CASES = [(108, 1108), (1108, 1108), (256, 256), (1024, 1024), (32, 4096)]


def timed(fn, repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def compare(kernel, k_cache, v_cache, n: int, ctx: int, g, repeat: int, other=None) -> str:
    pool_blocks = k_cache.shape[0] // BLOCK
    blocks = torch.randperm(pool_blocks, generator=g)[: -(-ctx // BLOCK)]
    q = torch.randn(n, HQ + 2 * HKV, D, generator=g).bfloat16()[:, :HQ]
    out = torch.empty(n, HQ, D, dtype=torch.bfloat16)
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    mask = torch.zeros(n, ctx).bfloat16().masked_fill_(~allowed, float("-inf"))

    def with_kernel():
        return kernel(q, k_cache, v_cache, blocks, BLOCK, ctx, D**-0.5, out)

    out_b = torch.empty_like(out)

    def with_other():  # another build's kernel
        return other(q, k_cache, v_cache, blocks, BLOCK, ctx, D**-0.5, out_b)

    def with_sdpa():  # what the engine ran before: gather the blocks, SDPA with a mask
        k, v = (
            c.view(-1, BLOCK, HKV, D).index_select(0, blocks).view(-1, HKV, D)[:ctx]
            for c in (k_cache, v_cache)
        )
        causal = n == ctx
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=None if causal else mask,
            is_causal=causal,
            scale=D**-0.5,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    b = with_sdpa if other is None else with_other
    diff = (with_kernel().float() - b().float()).abs().max().item()
    tk, ts = timed(with_kernel, repeat), timed(b, repeat)
    if other is not None:  # and again, the other first
        ts, tk = min(ts, timed(b, repeat)), min(tk, timed(with_kernel, repeat))
    return f"{n:>6} {ctx:>8} {tk:>10.0f} {ts:>9.0f} {ts / tk:>5.2f}x {diff:>9.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--variant", default=None, help="a kernel variant's build (avx2, ...)")
    ap.add_argument("--b-variant", default=None, help="another build's kernel in SDPA's place")
    args = ap.parse_args()

    def load(name):
        flags = variants.flags(variants.get(name)) if name else None
        found = PagedPrefillKernel.load(torch.bfloat16, D, BLOCK, flags)
        if found is None:
            raise SystemExit(f"no prefill kernel in build {name or 'native'} here")
        return found

    kernel = load(args.variant)
    other = load(args.b_variant) if args.b_variant else None
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(512 * BLOCK, HKV, D, generator=g).bfloat16() for _ in range(2))
    b = f"{args.b_variant} us" if other else "SDPA us"
    print(f"{kernel.name}{f' against {other.name}' if other else ''}")
    print(f"{'new':>6} {'context':>8} {'kernel us':>10} {b:>9} {'ratio':>6} {'max diff':>9}")
    for n, ctx in CASES:
        print(compare(kernel, k_cache, v_cache, n, ctx, g, args.repeat, other))


if __name__ == "__main__":
    main()
