"""Time the C Q4_1 matmuls of one layer of the default model's shape, side by side: the kernel
as this CPU runs it (AMX tiles from 6 rows where the CPU has them; with AVX2 alone, x quantized
to int16) against the same source built without AMX (`-mno-amx-tile`) and without the integer
path, kept on its float vector path (AVX-512 BF16, or AVX2) at every batch, and (with AVX2 or
AVX-512) against x quantized to int8; then, at prompt sizes, the kernel against the matmul the engine would run on a plain
weight: oneDNN's bf16 matmul (torch's packed linear) where this CPU has it, else torch's
float32 matmul on a float32 copy.

    .venv/bin/python benchmarks/quant_matmul.py                 # batches 1,4,5,8,12,16,24,32
    .venv/bin/python benchmarks/quant_matmul.py --batch 16 --copies 60 --prompt-rows 108

Each weight exists in `--copies` distinct copies, cycled through, so that the weights come
from memory rather than from a cache warmed by the previous call, as in a decode step. The two
sides take turns going first within each batch size, and each result is the fastest of
`--rounds`.
Prints microseconds per layer (its four matmuls: qkv, o, gate/up, down) and the ratio; the
prompt table also the kernel's rate in GOP/s (2 operations a weight and row).

Another CPU's build: `SERVELM_KERNEL_VARIANT=avx512-nobf16` (say) builds every side as that
variant. `--narrow` adds, at prompt sizes, the same build with its integer tiles kept 256 bits
wide (`-DQX_WIDE=0`: the AVX2 code, as before AVX-512's wide tiles). `--cpu-time` times each
side by the process's CPU time over the threads instead of the wall clock: on a shared machine
it leaves out the time other processes take the cores (run it with OMP_WAIT_POLICY=passive, so
that threads waiting at a barrier sleep rather than spin).

    SERVELM_KERNEL_VARIANT=avx512-nobf16 OMP_WAIT_POLICY=passive \
        .venv/bin/python benchmarks/quant_matmul.py --batch '' --prompt-rows 256 --narrow --cpu-time
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from servelm.kernels.quant_matmul import QuantMatmul
from servelm.model.layers.linear import _pack, cpu_has_bf16_matmul, packed_linear

# (output rows, input columns) of a SmolLM2-135M layer's projections: q/k/v fused, o,
# gate/up fused, down
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def wall_clock() -> float:
    return time.perf_counter()


def cpu_clock() -> float:
    """The process's CPU seconds per thread: wall seconds where no one else runs."""
    return time.process_time() / torch.get_num_threads()


clock: Callable[[], float] = wall_clock


def time_layer(kernel: QuantMatmul, x_by_cols, weights, copies: int) -> float:
    """Seconds for one pass of the layer's four matmuls, averaged over the copies."""
    t0 = clock()
    for i in range(copies):
        for (rows, cols), packed in zip(LAYER, weights, strict=True):
            kernel.q4(x_by_cols[cols], packed[i], rows)
    return (clock() - t0) / copies


def time_layer_plain(x_by_cols, weights, copies: int) -> float:
    """The same with the plain weights: oneDNN-packed bf16, or float32 (x converted)."""
    t0 = clock()
    for i in range(copies):
        for (_, cols), w in zip(LAYER, weights, strict=True):
            if cpu_has_bf16_matmul():
                packed_linear(x_by_cols[cols], w[i])
            else:
                F.linear(x_by_cols[cols].float(), w[i]).bfloat16()
    return (clock() - t0) / copies


def side_by_side(fns: dict, rounds: int) -> dict[str, float]:
    """The fastest of `rounds` for each of `fns`, which take turns going first."""
    best = {name: float("inf") for name in fns}
    for r in range(rounds):  # the first to run meets colder caches: take turns
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            best[name] = min(best[name], fn())
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,5,8,12,16,24,32")
    ap.add_argument("--copies", type=int, default=30, help="distinct copies of each weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-rows", default="33,108,256,1108", help="'' to skip that table")
    ap.add_argument("--narrow", action="store_true", help="add the 256-bit integer tiles")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time per thread, not wall")
    args = ap.parse_args()
    global clock
    clock = cpu_clock if args.cpu_time else wall_clock
    builds = {
        "default": QuantMatmul.load(),
        "int8": QuantMatmul.load(("-mno-amx-tile", "-DQ4_X_BITS=8")),
        "vector": QuantMatmul.load(("-mno-amx-tile", "-DQ4_INT8=0")),
    }
    if any(k is None for k in builds.values()):
        raise SystemExit("quant_matmul.c does not build here (no C compiler, or not x86)")
    if args.narrow:
        builds["narrow"] = QuantMatmul.load(("-mno-amx-tile", "-DQX_WIDE=0"))
    builds["vector"].sgemm_min_rows = 0  # the C vector path, x in float32, at every batch
    if builds["int8"].activation_bits != 8:  # no integer path in this build (no AVX2)
        del builds["int8"]
    g = torch.Generator().manual_seed(0)
    weights, plain = [], []
    for rows, cols in LAYER:
        q = torch.randint(0, 16, (rows, cols), generator=g)
        scale = (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float()
        low = (-torch.rand(rows, cols // 32, generator=g) * 0.08).half().float()
        weights.append([QuantMatmul.pack_q4(q, scale, low) for _ in range(args.copies)])
        if args.prompt_rows:
            w = q.float().view(rows, -1, 32) * scale[..., None] + low[..., None]
            w, bf16 = w.view(rows, cols), cpu_has_bf16_matmul()  # else float32 copies
            plain.append([_pack(w.bfloat16()) if bf16 else w.clone() for _ in range(args.copies)])
    print(f"one layer's four Q4_1 matmuls, {args.copies} copies of each weight, best of "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads")  # fmt: skip
    int8 = "int8" in builds
    print(
        f"{'rows':>5} {'as run here':>14} {'vector path':>14} {'ratio':>6}"
        + (f" {'int8 x':>14} {'ratio':>6}" if int8 else "")
    )
    for batch in (int(b) for b in args.batch.split(",") if b):
        x_by_cols = {
            c: torch.randn(batch, c, generator=g).bfloat16() for c in {c for _, c in LAYER}
        }
        fns = {
            name: lambda k=kernel, x=x_by_cols: time_layer(k, x, weights, args.copies)
            for name, kernel in builds.items()
            if name != "narrow"
        }
        best = side_by_side(fns, args.rounds)
        here, vector = best["default"] * 1e6, best["vector"] * 1e6
        line = f"{batch:5d} {here:11.0f} us {vector:11.0f} us {vector / here:5.2f}x"
        if int8:
            line += f" {best['int8'] * 1e6:11.0f} us {best['int8'] * 1e6 / here:5.2f}x"
        print(line)
    if not args.prompt_rows:
        return
    reference = "oneDNN bf16" if cpu_has_bf16_matmul() else "torch float32"
    narrow = f" {'256-bit tiles':>14} {'ratio':>6}" if args.narrow else ""
    print(f"\n{'rows':>5} {'as run here':>14} {'GOP/s':>6} {reference:>14} {'ratio':>6}{narrow}")
    ops_per_row = 2 * sum(rows * cols for rows, cols in LAYER)
    for batch in (int(b) for b in args.prompt_rows.split(",")):
        x_by_cols = {
            c: torch.randn(batch, c, generator=g).bfloat16() for c in {c for _, c in LAYER}
        }
        fns = {
            "q4": lambda x=x_by_cols: time_layer(builds["default"], x, weights, args.copies),
            "plain": lambda x=x_by_cols: time_layer_plain(x, plain, args.copies),
        }
        if args.narrow:
            fns["narrow"] = lambda x=x_by_cols: time_layer(
                builds["narrow"], x, weights, args.copies
            )
        best = side_by_side(fns, args.rounds)
        q4, onednn = best["q4"] * 1e6, best["plain"] * 1e6
        rate = ops_per_row * batch / best["q4"] / 1e9
        line = f"{batch:5d} {q4:11.0f} us {rate:6.0f} {onednn:11.0f} us {onednn / q4:5.2f}x"
        if args.narrow:
            line += f" {best['narrow'] * 1e6:11.0f} us {best['narrow'] / best['q4']:5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
