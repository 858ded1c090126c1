"""A decode step's attention alone, against the memory it reads: 16 decode tokens (the W2
concurrency) of the default model's heads (9 query heads over 3 KV heads of 64) through
`paged_prefill_bf16_many`, as the C layer loop calls it with batch invariance, over 30 layers
whose K and V pools are separate (so that each layer's context comes from memory, as in a
step), blocks scattered over each pool.

    .venv/bin/python benchmarks/decode_attention.py [--context 320] [--rounds 9]
        [--contiguous] [--variant avx2] [--b-source OTHER/paged_prefill.c] [--b-variant avx2]

Prints, per step of 30 layers (best and median of the rounds, sides alternating):
  attention   the kernel as this checkout builds it (`--variant`: another build's flags)
  in cache    the same, every layer over the first layer's pools (so they stay in cache)
  read only   each context's K and V lines read in block order, nothing computed
              (`context_read.c`): the memory bound
and, with `--b-source`, that file's kernel beside it (same flags), or with `--b-variant` this
file's kernel in another build, with its outputs compared.
The contexts are `--context` tokens less 8 per sequence (320 .. 200 by default).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from servelm.kernels import variants
from servelm.kernels.build import load_library
from servelm.kernels.paged_prefill import SOURCE

B, LAYERS, BLOCK, HQ, HKV, D = 16, 30, 16, 9, 3, 64
_P, _I = ctypes.c_void_p, ctypes.c_int64


def kernel(source: Path, flags: tuple[str, ...]):
    fn = load_library(source, flags).paged_prefill_bf16_many
    fn.argtypes = [_I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_float, _I]
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--contiguous", action="store_true", help="each sequence's blocks in order")
    ap.add_argument("--variant", default=None, help="a kernel variant's flags (avx2, ...)")
    ap.add_argument("--b-source", default=None, help="another paged_prefill.c, beside this one")
    ap.add_argument("--b-variant", default=None, help="this file in another build, beside it")
    args = ap.parse_args()
    # (an AMX CPU refused its tiles runs the avx512 build of this file, as the engine does)
    flags = variants.flags(variants.get(args.variant)) if args.variant else None
    flags = variants.prefill_fallback() or () if flags is None else flags
    per_seq = (args.context + BLOCK - 1) // BLOCK
    blocks = B * per_seq
    g = torch.Generator().manual_seed(0)
    pools = [
        [torch.randn(blocks * BLOCK, HKV, D, generator=g).bfloat16() for _ in range(2)]
        for _ in range(LAYERS)
    ]
    order = torch.arange(blocks) if args.contiguous else torch.randperm(blocks, generator=g)
    tables = order.reshape(B, per_seq).contiguous()
    ctx = torch.tensor([args.context - 8 * b for b in range(B)], dtype=torch.int64)
    q = torch.randn(B, HQ, D, generator=g).bfloat16()
    outs = {}

    def ptrs(tensors):
        return (_P * len(tensors))(*[t.data_ptr() for t in tensors])

    qs, tabs = ptrs(list(q)), ptrs(list(tables))
    ones, lens = (_I * B)(*([1] * B)), (_I * B)(*ctx.tolist())

    def attention(fn, name, hot=False):
        out = torch.empty(B, HQ, D, dtype=torch.bfloat16)
        outs[name] = out
        os_ = ptrs(list(out))

        def run():
            for layer in range(LAYERS):
                k, v = pools[0 if hot else layer]
                fn(B, qs, tabs, ones, lens, os_, HQ * D, k.data_ptr(), v.data_ptr(), BLOCK, HQ,
                   HKV, D, D**-0.5, HQ * D)  # fmt: skip

        return run

    read = load_library(Path(__file__).with_name("context_read.c")).context_read
    read.argtypes, read.restype = [_P, _P, _P, _I, _P, _I, _I, _I], _I

    def read_only():
        for k, v in pools:
            read(k.data_ptr(), v.data_ptr(), tables.data_ptr(), per_seq, ctx.data_ptr(), B,
                 HKV * D, BLOCK)  # fmt: skip

    a = kernel(SOURCE, flags)
    sides = {"attention": attention(a, "attention"), "in cache": attention(a, "hot", hot=True),
             "read only": read_only}  # fmt: skip
    if args.b_source or args.b_variant:
        b_flags = variants.flags(variants.get(args.b_variant)) if args.b_variant else flags
        sides["B: attention"] = attention(kernel(Path(args.b_source or SOURCE), b_flags), "B")
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    nbytes = int(ctx.sum()) * LAYERS * HKV * D * 2 * 2
    print(f"{B} decode tokens, context {int(ctx.min())}-{int(ctx.max())}, {LAYERS} layers, "
          f"{nbytes / 2**20:.0f} MiB of K and V a step, build {args.variant or 'native'}")  # fmt: skip
    for name, ts in times.items():
        best, median = min(ts), statistics.median(ts)
        print(f"  {name:13s} {best * 1e3:7.2f} ms best, {median * 1e3:7.2f} median, "
              f"{nbytes / best / 1e9:5.1f} GB/s")  # fmt: skip
    if args.b_source or args.b_variant:
        print(f"  B's outputs the same as A's: {torch.equal(outs['B'], outs['attention'])}")


if __name__ == "__main__":
    main()
