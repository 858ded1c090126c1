"""Where a loaded server's engine steps spend their time, against this CPU's measured peaks.

    .venv/bin/pip install py-spy==0.4.2      # the sampling profiler (not a servelm dependency)
    .venv/bin/python -m benchmarks.profile_step [--workload W2] [--out profile.json]

Serves the default model with `--step-trace`, drives it with `servelm bench` at a workload's
shape (W2: 64 requests of 256 prompt / 128 output tokens at concurrency 16; W3: 32 of
1,024 / 64 at 8) and samples the engine process with py-spy (native frames, so the C kernels
show by name) while it runs. Reports:

- the peaks measured here first: torch's bf16 matmul (oneDNN; AMX tiles where the CPU has them)
  in GFLOP/s and a streaming read in GB/s, both on every core;
- per kind of step (decode-only, with prompt tokens): count, wall time, tokens, and what the
  step reached of those peaks: FLOPs (2 x parameters x tokens, plus 4 x head_dim x heads x
  layers per attention pair) per second against the matmul peak, and the bytes it must read
  (the weights in the form served, plus the KV cache it attends) per second against the read
  peak;
- the engine process's samples by where they were: each C kernel, oneDNN, OpenMP waiting,
  Python, and waiting for requests.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

WORKLOADS = {
    "W2": dict(input_len=256, output_len=128, requests=64, concurrency=16),
    "W3": dict(input_len=1024, output_len=64, requests=32, concurrency=8),
}

# leaf-most frame that matches -> where a sample was (first match wins, from the stack's top)
PLACES = [
    ("C q4/q8 matmul", re.compile(r"q4_|q8_|gemm_int|gemm_block|int_tile|quantize_rows|amx")),
    ("C gguf matmul", re.compile(r"gguf_")),
    ("C prefill attention", re.compile(r"paged_prefill|prefill_")),
    ("C decode attention", re.compile(r"paged_decode|decode_attn")),
    ("C norm/rotary/SiLU", re.compile(r"rms|rotary|silu|add_rms")),
    ("oneDNN / torch kernels", re.compile(r"dnnl|mkldnn|at::native|at::internal|aten|mkl_")),
    # (waiting only: GOMP_parallel, a region's entry, is every kernel's ancestor)
    ("OpenMP wait", re.compile(r"gomp_\w*(barrier|wait)|futex|sched_yield|do_spin|do_wait")),
    ("waiting for requests (zmq poll)", re.compile(r"zmq_poll|poll \(zmq|epoll|\bpoll\b")),
]


def peaks(seconds: float = 2.0) -> dict[str, float]:
    import torch

    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    torch.mm(a, b)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        n += 1
    flops = n * 2 * 2048**3 / (time.perf_counter() - t0)
    x = torch.ones(256 * 2**20 // 4, dtype=torch.float32)  # 256 MiB, far past the caches
    x.sum()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.sum()
        n += 1
    read = n * x.numel() * 4 / (time.perf_counter() - t0)
    return {"bf16_matmul_gflops": flops / 1e9, "read_gbps": read / 1e9}


def model_numbers(model_dir: Path) -> dict[str, float]:
    from servelm.model.config import load_spec

    spec = load_spec(model_dir)
    h, layers = spec.hidden_size, spec.num_layers
    per_layer = (
        h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h + 3 * h * spec.intermediate_size
    )
    params = layers * per_layer + spec.vocab_size * h  # the head's matmul counts too
    return {
        "params": params,
        "attn_flops_per_pair": 4 * spec.head_dim * spec.num_heads * layers,
        "kv_bytes_per_token": spec.kv_bytes_per_token(2),
        # int4 projections (Q4_1: 0.5 byte + 4 bytes per 32 weights) and the Q8_0 head
        "weight_bytes": layers * per_layer * (0.5 + 4 / 32) + spec.vocab_size * h * (1 + 2 / 32),
    }


def summarize_trace(path: Path, model: dict, peak: dict) -> dict:
    from servelm.engine.step_trace import read_step_trace

    kinds: dict[str, dict[str, float]] = {}
    for comp, seconds in read_step_trace(path):
        kind = "with prompt tokens" if comp.prefill_tokens else "decode only"
        k = kinds.setdefault(kind, Counter())
        tokens = comp.prefill_tokens + comp.decode_tokens
        k["steps"] += 1
        k["seconds"] += seconds
        k["tokens"] += tokens
        k["flops"] += (
            2 * model["params"] * tokens + model["attn_flops_per_pair"] * comp.attention_pairs
        )
        k["bytes"] += model["weight_bytes"] + model["kv_bytes_per_token"] * (
            comp.context_tokens_read + tokens
        )
    out = {}
    for kind, k in kinds.items():
        out[kind] = {
            "steps": int(k["steps"]),
            "ms_per_step": 1000 * k["seconds"] / k["steps"],
            "tokens_per_step": k["tokens"] / k["steps"],
            "gflops": k["flops"] / k["seconds"] / 1e9,
            "fraction_of_matmul_peak": k["flops"] / k["seconds"] / 1e9 / peak["bf16_matmul_gflops"],
            "gbps": k["bytes"] / k["seconds"] / 1e9,
            "fraction_of_read_peak": k["bytes"] / k["seconds"] / 1e9 / peak["read_gbps"],
        }
    return out


def summarize_samples(path: Path) -> dict[str, dict[str, float]]:
    """py-spy's raw output with --threads: 'thread;frame;...;leaf count' per line, root first.
    Shares per thread: the main thread (the one running the engine loop's Python) and the
    OpenMP workers (the rest)."""
    lines = []
    main_threads = set()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            frames = stack.split(";")
            lines.append((frames[0], frames[1:], int(count)))
            if any("_loop" in f and "core_process" in f for f in frames):
                main_threads.add(frames[0])
    out: dict[str, Counter] = {"main thread": Counter(), "other threads": Counter()}
    leaves: Counter = Counter()
    for thread, frames, n in lines:
        group = "main thread" if thread in main_threads else "other threads"
        out[group][_place(frames[::-1])] += n
        leaves[frames[-1].split(" (")[0]] += n
    total = sum(leaves.values())
    print(
        "  top leaf frames: "
        + ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in leaves.most_common(12))
    )
    return {
        group: {name: n / sum(c.values()) for name, n in c.most_common()}
        for group, c in out.items()
        if c
    }


def _place(frames: list[str]) -> str:
    """Where a sample was, from its frames leaf first."""
    for frame in frames:
        hit = next((name for name, rx in PLACES if rx.search(frame)), None)
        if hit:
            return hit
    return "Python (interpreter, torch dispatch, sampling)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from servelm.store.default import ensure_default_model
    from tests.live_server import LiveServer

    peak = peaks()
    print(
        f"peaks here: {peak['bf16_matmul_gflops']:.0f} GFLOP/s bf16 matmul, "
        f"{peak['read_gbps']:.1f} GB/s read",
        flush=True,
    )
    model_dir = Path(ensure_default_model(None))
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        trace, samples = Path(tmp) / "trace.jsonl", Path(tmp) / "samples.txt"
        srv = LiveServer(model_dir, "--step-trace", str(trace))
        try:
            bench = [
                sys.executable,
                "-m",
                "servelm.cli",
                "bench",
                "--base-url",
                srv.url,
                "--endpoint",
                "completions",
                "--input-len",
                str(w["input_len"]),
                "--output-len",
                str(w["output_len"]),
                "--len-dist",
                "fixed",
                "--no-server-metrics",
            ]
            warm = ["--num-requests", "8", "--concurrency", "4"]
            subprocess.run(bench + warm, check=True, capture_output=True)
            bench += ["--num-requests", str(w["requests"]), "--concurrency", str(w["concurrency"])]
            trace.write_text("")
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--native",
                    "--threads",
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--pid",
                    str(srv.engine_pid()),
                    "-o",
                    str(samples),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            t0 = time.perf_counter()
            done = subprocess.run(bench, check=True, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        finally:
            srv.stop()
        model = model_numbers(model_dir)
        steps = summarize_trace(trace, model, peak)
        where = summarize_samples(samples)
    tokens = w["requests"] * w["output_len"]
    result = {
        "workload": args.workload,
        **w,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "peaks": peak,
        "model": model,
        "steps": steps,
        "engine_samples": where,
        "bench_tail": done.stdout[-1500:],
    }
    print(f"{args.workload}: {tokens / wall:.0f} output tok/s (wall {wall:.1f} s, bench included)")
    for kind, s in steps.items():
        print(
            f"  {kind}: {s['steps']} steps, {s['ms_per_step']:.1f} ms, {s['tokens_per_step']:.1f} "
            f"tokens; {s['gflops']:.0f} GFLOP/s = {100 * s['fraction_of_matmul_peak']:.1f} % of "
            f"the matmul peak; {s['gbps']:.1f} GB/s = {100 * s['fraction_of_read_peak']:.1f} % "
            "of the read peak"
        )
    for group, shares in where.items():
        print(f"  engine {group}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in shares.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
