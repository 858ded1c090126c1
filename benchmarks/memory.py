"""Engine-process memory under sustained load: is RSS bounded by weights + KV budget + 600 MB,
and flat over the run?

    .venv/bin/python benchmarks/memory.py [--minutes 10] [--concurrency 16] [--model DIR]

Starts `servelm serve`, keeps `--concurrency` streams of 256-token prompts / 128-token answers
going for `--minutes` (every prompt different, so the KV cache keeps being filled, evicted and
reused), and samples the engine process's RSS from /proc every `--every` seconds. Prints the
samples, the bound, and the growth over the second half of the run (RSS first climbs while
the lazily zeroed KV cache is written for the first time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.serve_latency import MODEL_NAME, WEIGHTS_LINE, Server
from servelm.bench import BenchConfig, Load, WorkloadSpec, run_benchmark

ALLOWANCE = 600 * 2**20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def engine_process(pids: list[int]) -> int:
    """The engine core among the server's children (the other is multiprocessing's tracker)."""
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise RuntimeError(f"no engine process among {pids}")


def budget_from_log(text: str) -> tuple[float, float]:
    """(weights GiB, KV GiB) from the engine's start-up log lines."""
    weights = WEIGHTS_LINE.search(text)
    kv = re.search(r"KV cache: .*\(([\d.]+) GiB", text)
    if not weights or not kv:
        raise RuntimeError("start-up log lacks the weights / KV cache lines")
    return float(weights["gib"]), float(kv[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--every", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--out", type=Path, default=Path("memory.json"))
    args = p.parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from servelm.store.default import ensure_default_model

        model_dir = Path(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="memory-"))
    server = Server(model_dir, [], work / "serve.log")
    samples: list[tuple[float, int]] = []
    try:
        server.wait_ready(600)
        engine_pid = engine_process(server.children())
        weights_gib, kv_gib = budget_from_log(server.tail(100_000))
        bound = int((weights_gib + kv_gib) * 2**30) + ALLOWANCE
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, rss_bytes(engine_pid)))
                stop.wait(args.every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        config = BenchConfig(
            base_url=server.url,
            model=MODEL_NAME,
            endpoint="completions",
            workload=WorkloadSpec(input_len=256, output_len=128),
            tokenizer=str(model_dir),
            loads=(Load(concurrency=args.concurrency),),
            num_requests=None,
            duration_s=args.minutes * 60,
            server_metrics=False,
        )
        run = asyncio.run(run_benchmark(config)).runs[0]
        stop.set()
        sampler.join()
        samples.append((time.monotonic() - t0, rss_bytes(engine_pid)))
    finally:
        server.stop()

    mib = 2**20
    for t, rss in samples:
        print(f"{t:7.0f} s  RSS {rss / mib:8.1f} MiB")
    # The KV cache is calloc'd: RSS climbs while its pages are first written, then should stay.
    half = samples[len(samples) // 2][1]
    peak = max(r for _, r in samples)
    print(
        f"{run.summary['completed']} requests completed, {run.summary['failed']} failed in "
        f"{args.minutes:g} min; weights {weights_gib:.3f} GiB + KV {kv_gib:.3f} GiB + 600 MiB = "
        f"bound {bound / mib:.0f} MiB; peak RSS {peak / mib:.0f} MiB "
        f"({'within' if peak <= bound else 'OVER'} the bound); growth over the second half of "
        f"the run {(samples[-1][1] - half) / mib:+.1f} MiB"
    )
    args.out.write_text(
        json.dumps(
            {
                "samples": samples,
                "bound_bytes": bound,
                "weights_gib": weights_gib,
                "kv_gib": kv_gib,
                "summary": run.summary,
            },
            indent=1,
            default=str,
        )
    )
    return 0 if peak <= bound and not run.summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
