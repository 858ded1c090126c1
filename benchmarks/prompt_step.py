"""Time whole prompt steps of the default model in-process, and what its matmuls reach.

    SERVELM_KERNEL_VARIANT=avx512-nobf16 .venv/bin/python -m benchmarks.prompt_step --tokens 256
    .venv/bin/python -m benchmarks.prompt_step --int4-activations int8

Runs `--repeat` prompts of `--tokens` tokens, one at a time with one token generated (the
prompt step; prefix caching off, so every prompt is computed whole), and prints the fastest
and the median milliseconds and the rate of its int4 projections in GOP/s if they took the
whole step (2 operations a weight and token: a floor on what the matmuls themselves reach),
then the same in CPU time per thread: on a shared machine, what the step costs without the
time other processes take the cores (run it with OMP_WAIT_POLICY=passive, so that threads
waiting at a barrier sleep rather than spin).
Where the time goes inside the step's one C call, `perf` (software clock, user space, no
root needed) shows by function:

    perf record -e cpu-clock -o /tmp/p.data -- .venv/bin/python -m benchmarks.prompt_step
    perf report -i /tmp/p.data --sort dso,sym | head -40

`--timers` builds the C layer loop with -DSTACK_TIMING (as `benchmarks/decode_step.py` does)
and adds the step's milliseconds kernel by kernel (medians), with each projection's rate in
GOP/s.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from benchmarks.decode_step import SLOTS, layer_weights, side
from benchmarks.workloads import cpu_kind
from servelm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--timers", action="store_true", help="kernel by kernel (-DSTACK_TIMING)")
    ap.add_argument("--int4-activations", default="auto", help="as `servelm serve` takes it")
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False, int4_activations=args.int4_activations)
    runner = llm.engine.executor
    reader, kernels, per_kernel = None, None, []
    if args.timers:
        stack = runner.decode_stack
        if stack is None:
            raise SystemExit("this engine runs no C layer loop (decode_stack)")
        stack.fn, reader, stack.kernels.prefill_many = side(stack, (), True)
        kernels = (ctypes.c_double * len(SLOTS))()
    params = SamplingParams(temperature=0, max_tokens=1)
    times, cpu = [], []
    threads = torch.get_num_threads()
    for i in range(args.repeat + 1):  # the first warms up
        prompt = [100 + (i * 31 + j) % 40000 for j in range(args.tokens)]
        if reader is not None:
            reader(kernels)  # (clears them)
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - t0)
        cpu.append((time.process_time() - c0) / threads)
        if reader is not None:
            reader(kernels)
            per_kernel.append(list(kernels))
    times, cpu = times[1:], cpu[1:]
    from servelm.model.layers.linear import Linear

    int4 = sum(
        m.in_features * m.out_features
        for m in runner.model.modules()
        if isinstance(m, Linear) and getattr(m, "int4", None) is not None
    )
    rate = 2 * int4 * args.tokens / min(times) / 1e9
    print(f"{cpu_kind()}, {threads} threads")
    print(f"{args.tokens}-token prompt step ({runner.int4_layers} int4 projections): "
          f"fastest {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms "
          f"of {args.repeat}; int4 matmuls over the whole fastest step: {rate:.0f} GOP/s; "
          f"CPU time per thread: fastest {min(cpu) * 1e3:.1f} ms, median "
          f"{statistics.median(cpu) * 1e3:.1f} ms")  # fmt: skip
    if per_kernel:
        spec = runner.model.spec
        weights = layer_weights(spec)
        layers = spec.num_layers
        print(f"kernel by kernel, ms (median of {args.repeat}), {threads} threads:")
        for i, name in enumerate(SLOTS):
            ms = statistics.median(row[i] for row in per_kernel[1:]) * 1e3
            line = f"  {name:10s} {ms:7.2f}"
            if name in weights:
                line += f"  {2 * weights[name] * layers * args.tokens / ms / 1e6:6.0f} GOP/s"
            print(line)
        total = statistics.median(sum(row) for row in per_kernel[1:]) * 1e3
        print(
            f"  {'sum':10s} {total:7.2f} of the step's median {statistics.median(times) * 1e3:.2f}"
        )


if __name__ == "__main__":
    main()
