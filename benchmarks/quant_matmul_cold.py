"""Time the C q4 and q8 matmuls one projection at a time at the default model's shapes
(SmolLM2-135M: q/k/v fused, o, gate/up fused, down as q4; the logits head as q8), with the
weights coming from memory: each weight exists in enough distinct copies (`--mb` in all) that
cycling through them leaves none in the caches, as in a decode step, whose every weight is read
once. Prints microseconds per call, and GB/s of weight read (decode batches) or GFLOP/s (2
operations a weight and row; prompt batches).

    .venv/bin/python benchmarks/quant_matmul_cold.py                       # as this checkout builds
    .venv/bin/python benchmarks/quant_matmul_cold.py --vs /tmp/old/quant_matmul.c --rounds 6
    .venv/bin/python benchmarks/quant_matmul_cold.py --flags=-DAMX_PREFETCH=4 --vs-flags=-DAMX_PREFETCH=0

With `--vs` (another copy of quant_matmul.c, in a folder with its headers) or `--vs-flags`, the
second build is timed against the first in alternating pairs, A B A B, each pair's ratio
printed, so that a comparison holds on a shared machine whose speed drifts; each figure is the
fastest of its side's rounds (on two shared cores a round that meets another process is several
times slower, so the median is not robust either).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.workloads import cpu_kind
from servelm.kernels.build import load_library
from servelm.kernels.quant_matmul import SOURCE, QuantMatmul

# (name, kind, output rows, input columns): SmolLM2-135M-Instruct's projections and head
SHAPES = [
    ("qkv", "q4", 960, 576),
    ("o", "q4", 576, 576),
    ("gate_up", "q4", 3072, 576),
    ("down", "q4", 576, 1536),
    ("head", "q8", 49152, 576),
]


def load(source: Path, flags: tuple[str, ...]) -> QuantMatmul:
    lib = load_library(source, flags)
    if lib is None:
        raise SystemExit(f"{source} does not build here (no C compiler, or not x86)")
    kernel = QuantMatmul(lib)
    kernel.batch_invariant(True)
    return kernel


def weights(kind: str, rows: int, cols: int, megabytes: float, g: torch.Generator):
    """Distinct copies of one random weight on its grid, packed, at least `megabytes` in all."""
    if kind == "q4":
        q = torch.randint(0, 16, (rows, cols), generator=g)
        scale = (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float()
        low = (-torch.rand(rows, cols // 32, generator=g) * 0.08).half().float()
        packed = QuantMatmul.pack_q4(q, scale, low)
    else:
        q = torch.randint(-127, 128, (rows, cols), generator=g)
        scale = (torch.rand(rows, cols // 32, generator=g) * 0.01).half().float()
        packed = QuantMatmul.pack_q8(q, scale)
    copies = max(3, int(megabytes * 1e6 / packed.numel()) + 1)
    return [packed.clone() for _ in range(copies)]


def per_call(kernel: QuantMatmul, kind: str, x, ws, rows: int, calls: int) -> float:
    """Seconds per call, over `calls` calls cycling through the copies."""
    fn = kernel.q4 if kind == "q4" else kernel.q8
    t0 = time.perf_counter()
    for i in range(calls):
        fn(x, ws[i % len(ws)], rows)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,16", help="decode batches: GB/s")
    ap.add_argument("--prompt-rows", default="256,512", help="prompt batches: GFLOP/s")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--mb", type=float, default=150, help="megabytes of distinct copies")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flags", default="", help="extra build flags, space separated")
    ap.add_argument("--vs", type=Path, help="another quant_matmul.c to time against")
    ap.add_argument("--vs-flags", default=None, help="its build flags (default: --flags)")
    ap.add_argument("--head-prompt", action="store_true", help="the head at prompt rows too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = tuple(args.flags.split())
    sides = {"A": load(SOURCE, flags)}
    if args.vs is not None or args.vs_flags is not None:
        vs_flags = flags if args.vs_flags is None else tuple(args.vs_flags.split())
        sides["B"] = load(args.vs or SOURCE, vs_flags)
    g = torch.Generator().manual_seed(0)
    batches = [(int(b), False) for b in args.batch.split(",") if b]
    batches += [(int(b), True) for b in args.prompt_rows.split(",") if b]
    print(
        f"{cpu_kind()}: {args.threads} threads, {args.mb:.0f} MB of copies, "
        f"best of {args.rounds} rounds"
    )
    if len(sides) == 2:
        print(f"A: {SOURCE} {' '.join(flags)}\nB: {args.vs or SOURCE} {args.vs_flags or ''}")
    for name, kind, rows, cols in SHAPES:
        if name not in args.shapes.split(","):
            continue
        ws = weights(kind, rows, cols, args.mb, g)
        for batch, prompt in batches:
            if prompt and kind == "q8" and not args.head_prompt:
                continue
            x = torch.randn(batch, cols, generator=g).bfloat16()
            # about 2x the copies in calls for decode (a few ms), one pass for prompts
            calls = len(ws) if prompt else max(2 * len(ws), 20)
            for kernel in sides.values():  # warm-up: page faults, the thread pool
                per_call(kernel, kind, x, ws, rows, len(ws))
            times = {s: [] for s in sides}
            for r in range(args.rounds):
                for s in list(sides)[:: 1 if r % 2 == 0 else -1]:
                    times[s].append(per_call(sides[s], kind, x, ws, rows, calls))
            line = f"{name:8s} {kind} {rows:5d}x{cols:<5d} B={batch:<4d}"
            for s, ts in times.items():
                t = min(ts)
                rate = (
                    f"{2 * rows * cols * batch / t / 1e9:6.0f} GFLOP/s"
                    if prompt
                    else f"{ws[0].numel() / t / 1e9:5.1f} GB/s"
                )
                line += f" | {s} {t * 1e6:8.1f} us {rate}"
            if len(sides) == 2:
                pairs = [a / b for a, b in zip(times["A"], times["B"], strict=True)]
                line += " | A/B " + " ".join(f"{p:.2f}" for p in pairs)
            print(line, flush=True)


if __name__ == "__main__":
    main()
