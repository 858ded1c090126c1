"""Where one decode step of the default model goes, kernel by kernel: 16 requests (the W2
concurrency) decoding at 256-384 tokens of context, in-process through `LLM` and the engine, so
that the C layer loop (kernels/decode_stack.c) runs as it does when serving.

    .venv/bin/python -m benchmarks.decode_step                  # per-kernel breakdown
    .venv/bin/python -m benchmarks.decode_step --no-timers      # step times only
    .venv/bin/python -m benchmarks.decode_step --cold           # + each matmul on cold weights
    .venv/bin/python -m benchmarks.decode_step --rounds 6 --b-kernels /work/main/servelm/kernels
    .venv/bin/python -m benchmarks.decode_step --rounds 6 --ab=-DATTN_PREFETCH=0

Per step, in ms: the engine step (wall and CPU time over all threads), the model runner's part,
the C call (decode_stack_bf16), the logits head (q8) and what lies around them (scheduling,
planning, sampling, Python). With timers (the default) decode_stack.c is built with
-DSTACK_TIMING, which times each kernel call from the C loop (about 540 clock reads a step);
without them, the source as served. A B side (`--ab` flags, or `--b-kernels` another folder's
decode_stack.c and paged_prefill.c) runs in the same process, rounds alternating with the A
side (this checkout's, as built by default), and each pair of round medians is printed.
`--cold` then times each layer's projections as the stack calls them (16 rows, the model's own
weights) once with the weight flushed from every cache (clflush: it comes from DRAM) and once
right after, and prints the read rate each reaches. Every figure is a median over the steps
(or layers) of a round, or of all rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.workloads import cpu_kind
from servelm import LLM, SamplingParams
from servelm.engine.requests import child_requests
from servelm.kernels import variants
from servelm.kernels.build import load_library
from servelm.kernels.paged_prefill import SOURCE as PREFILL_SOURCE
from servelm.worker.decode_stack import SOURCE

# decode_stack.c's timing slots, in its order (enum T_NORM ...)
SLOTS = ["norm", "qkv", "rotary", "kv store", "attention", "o", "gate_up", "silu", "down"]
PROJS = ["qkv", "o", "gate_up", "down"]
Q4_BYTES_PER_WEIGHT = (16 * 32 / 2 + 16 * 2 * 2) / (16 * 32)  # quant_matmul.c's q4 layout


def timed(record: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[name] += time.perf_counter() - t0

    return wrapper


def one_round(llm: LLM, batch: int, context: int, steps: int, reader) -> list[dict]:
    engine = llm.engine
    runner = engine.executor
    stack = runner.decode_stack
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    stamp = time.time()
    for i in range(batch):
        prompt = [100 + (i * 7 + j) % 40000 for j in range(context)]
        for req in child_requests(f"r{i}-{stamp}", prompt, params, []):
            engine.add_request(req)
    while (  # the prompts (and first tokens), untimed
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    record: dict[str, float] = defaultdict(float)
    fn, execute, logits = stack.fn, runner.execute, runner.model.compute_logits
    stack.fn = timed(record, "C call", fn)
    runner.execute = timed(record, "model runner", execute)
    runner.model.compute_logits = timed(record, "head (q8)", logits)
    kernels = (ctypes.c_double * len(SLOTS))()
    rows = []
    try:
        while engine.has_unfinished_requests():
            record.clear()
            if reader is not None:
                reader(kernels)  # (clears them)
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            record["step"] = time.perf_counter() - t0
            record["step, CPU time (all threads)"] = time.process_time() - c0
            if reader is not None:
                reader(kernels)
                record.update({f"  {n}": kernels[i] for i, n in enumerate(SLOTS)})
            rows.append({k: v * 1000 for k, v in record.items()})
    finally:
        stack.fn, runner.execute = fn, execute
        del runner.model.compute_logits  # the class's method again
    return rows[:-1]  # the last step finishes requests (and may hold fewer)


def cold_matmuls(llm: LLM, batch: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each projection of every layer on `batch` rows, its weight flushed (cold) or just read
    (warm): microseconds and GB/s of weight read, medians over layers and rounds."""
    flush = load_library(Path(__file__).with_name("cache_flush.c")).cache_flush
    flush.argtypes, flush.restype = [ctypes.c_void_p, ctypes.c_int64], None
    stack = llm.engine.executor.decode_stack
    q4 = stack.model.layers[0].self_attn.qkv_proj.int4.kernel.fns["q4"]
    spec = stack.model.spec
    shapes = {
        "qkv": (spec.q_size + 2 * spec.kv_size, spec.hidden_size),
        "o": (spec.hidden_size, spec.q_size),
        "gate_up": (2 * spec.intermediate_size, spec.hidden_size),
        "down": (spec.hidden_size, spec.intermediate_size),
    }
    x = torch.randn(batch, max(k for _, k in shapes.values())).to(torch.bfloat16) * 0.1
    y = torch.empty(batch, max(n for n, _ in shapes.values()), dtype=torch.bfloat16)
    times: dict[str, dict[str, list[float]]] = {p: {"cold": [], "warm": []} for p in PROJS}
    for _ in range(rounds):
        for layer in range(len(stack.layers)):
            for i, name in enumerate(PROJS):
                proj = stack.projs[4 * layer + i]
                if proj.num_parts != 1 or proj.parts[0].kind != 0:
                    continue  # (the default model: one q4 part each)
                n, k = shapes[name]
                w, nbytes = proj.parts[0].w, int(n * k * Q4_BYTES_PER_WEIGHT)
                xk = x[:, :k].contiguous()
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        flush(w, nbytes)
                    t0 = time.perf_counter()
                    q4(xk.data_ptr(), w, y.data_ptr(), batch, n, k)
                    times[name][kind].append(time.perf_counter() - t0)
    out = {}
    for name in PROJS:
        n, k = shapes[name]
        nbytes = n * k * Q4_BYTES_PER_WEIGHT
        out[name] = {}
        for kind, ts in times[name].items():
            if ts:
                t = statistics.median(ts)
                out[name][f"{kind} us"] = t * 1e6
                out[name][f"{kind} GB/s"] = nbytes / t / 1e9
        out[name]["MB"] = nbytes / 1e6
    return out


def side(stack, flags: tuple[str, ...], timers: bool, kernels: Path | None = None):
    """(the stack's C function, its timing reader or None, paged_prefill_bf16_many's address)
    for decode_stack.c and paged_prefill.c built with `flags`, from the folder `kernels` (say
    another checkout's servelm/kernels) or this one's. Timers where asked and its source has
    them."""
    stack_source = kernels / SOURCE.name if kernels else SOURCE
    prefill_source = kernels / PREFILL_SOURCE.name if kernels else PREFILL_SOURCE
    timers = timers and "STACK_TIMING" in stack_source.read_text()
    lib = load_library(stack_source, (*flags, "-DSTACK_TIMING=1") if timers else flags)
    fn = lib.decode_stack_bf16
    fn.argtypes, fn.restype = stack.fn.argtypes, None
    reader = None
    if timers:
        reader = lib.decode_stack_timings
        reader.argtypes = [ctypes.c_void_p]
    # (from the build the engine takes this CPU's prefill attention from: prefill_fallback)
    prefill = load_library(prefill_source, (*flags, *(variants.prefill_fallback() or ())))
    return fn, reader, ctypes.cast(prefill.paged_prefill_bf16_many, ctypes.c_void_p).value


def layer_weights(spec) -> dict[str, int]:
    """The weights of one layer's projections, by the C layer loop's timing slot."""
    return {
        "qkv": (spec.q_size + 2 * spec.kv_size) * spec.hidden_size,
        "o": spec.hidden_size * spec.q_size,
        "gate_up": 2 * spec.intermediate_size * spec.hidden_size,
        "down": spec.hidden_size * spec.intermediate_size,
    }


def report(rows: list[dict], stack) -> dict[str, float]:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    for k in rows[0]:
        print(f"  {k:55s} {med[k]:8.2f}   (mean {mean[k]:7.2f})")
    print(
        f"  {'outside the C call: runner - C call':55s} {med['model runner'] - med['C call']:8.2f}"
    )
    if "  qkv" in rows[0]:
        inside = sum(mean[f"  {n}"] for n in SLOTS)
        print(f"  {'C call - sum of timed kernels (mean)':55s} {mean['C call'] - inside:8.2f}")
        print("  in-step weight read rate (GB/s, median time):")
        for name, weights in layer_weights(stack.model.spec).items():
            nbytes = weights * Q4_BYTES_PER_WEIGHT * len(stack.layers)
            print(f"    {name:8s} {nbytes / 1e6:6.1f} MB  {nbytes / med['  ' + name] / 1e6:6.1f}")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-timers", action="store_true", help="the stack as served, no C timers")
    ap.add_argument("--cold", action="store_true", help="also each matmul on cold weights")
    ap.add_argument(
        "--ab",
        default=None,
        help="compiler flags (space-separated) for a B side: decode_stack.c and paged_prefill.c "
        "built with them, rounds alternating with the A side (as built by default)",
    )
    ap.add_argument(
        "--b-kernels",
        default=None,
        help="a folder (another checkout's servelm/kernels) whose decode_stack.c and "
        "paged_prefill.c make the B side, rounds alternating with this checkout's",
    )
    ap.add_argument("--json", default=None, help="write every step's figures here")
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False, num_threads=args.num_threads)
    stack = llm.engine.executor.decode_stack
    if stack is None:
        raise SystemExit("this engine runs no C layer loop (decode_stack)")
    timers = not args.no_timers
    sides = {"A": side(stack, (), timers)}
    if args.ab is not None or args.b_kernels:
        b_dir = Path(args.b_kernels) if args.b_kernels else None
        sides["B"] = side(stack, tuple((args.ab or "").split()), timers, b_dir)
    rows: dict[str, list[dict]] = {name: [] for name in sides}
    summary: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else reversed(sides):
            fn, reader, prefill_many = sides[name]
            stack.fn, stack.kernels.prefill_many = fn, prefill_many
            got = one_round(llm, args.batch, args.context, args.steps, reader)
            rows[name] += got
            print(f"round {r} side {name}: {len(got)} decode steps of {args.batch} tokens")
            summary[name].append(report(got, stack))
    print(
        f"all rounds: {cpu_kind()}, context {args.context}-{args.context + args.steps}, "
        f"{torch.get_num_threads()} threads; ms per step (median, mean)"
    )
    for name in sides:
        print(f"side {name} " + f"{args.ab or ''} {args.b_kernels or ''}" * (name == "B"))
        report(rows[name], stack)
    if len(sides) == 2:
        print(
            "pairs, median ms per step (A, B): "
            + ", ".join(
                f"step {a['step']:.1f}/{b['step']:.1f} C {a['C call']:.1f}/{b['C call']:.1f}"
                for a, b in zip(summary["A"], summary["B"], strict=True)
            )
        )
    if args.cold:
        print(f"  each matmul alone, {args.batch} rows (medians over layers):")
        for name, figures in cold_matmuls(llm, args.batch, max(1, args.rounds)).items():
            print("    " + name + ": " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_kind(), "rows": rows}))


if __name__ == "__main__":
    main()
