"""Time engine steps of the default model in-process: decode at several batch sizes, and prefill.

    .venv/bin/python benchmarks/step_time.py --dtype bfloat16 --batch 1,16 --context 256
    .venv/bin/python benchmarks/step_time.py --quantization none,auto   # bf16 vs int4 weights
    .venv/bin/python benchmarks/step_time.py --kernels torch,auto   # torch ops vs C kernels
    .venv/bin/python benchmarks/step_time.py --int4-activations auto,int8

Prints milliseconds per decode step and per prefill of `--prefill` tokens, measured side by side
for each setting in one run. No server, no HTTP: this isolates the model runner and scheduler.
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelm import LLM, SamplingParams


def decode_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    prompts = [[100 + (i * 7 + j) % 40000 for j in range(context)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    engine = llm.engine
    from servelm.engine.requests import child_requests

    for i, p in enumerate(prompts):
        for req in child_requests(f"b{batch}-{i}-{time.time()}", p, params, []):
            engine.add_request(req)
    # Run the prefill (and the first token) before timing.
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[:-1] or times) * 1000


def prefill_ms(llm: LLM, tokens: int) -> float:
    prompt = [100 + j % 40000 for j in range(tokens)]
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument(
        "--quantization", default="auto", help="one or several, comma-separated: auto,none,int4"
    )
    ap.add_argument("--kernels", default="auto", help="one or several, comma-separated: auto,torch")
    ap.add_argument(
        "--int4-activations", default="auto", help="one or several: auto,int16,int8,float32"
    )
    args = ap.parse_args()
    settings = [
        (q, a, i)
        for q in args.quantization.split(",")
        for a in args.kernels.split(",")
        for i in args.int4_activations.split(",")
    ]
    for quantization, kernels, activations in settings:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            quantization=quantization,
            kernels=kernels,
            int4_activations=activations,
            num_threads=args.num_threads,
            enable_prefix_caching=False,
        )
        runner = llm.engine.executor
        label = f"[{quantization}: {runner.int4_layers} int4 projections; {kernels} kernels"
        label += f"; x as {activations}]"
        for b in (int(x) for x in args.batch.split(",")):
            ms = decode_ms(llm, b, args.context, args.steps)
            print(f"{label} decode batch {b:3d} context {args.context}: {ms:7.2f} ms/step")
        prefill_ms(llm, args.prefill)
        print(f"{label} prefill {args.prefill} tokens: {prefill_ms(llm, args.prefill):7.1f} ms")
        del llm


if __name__ == "__main__":
    main()
