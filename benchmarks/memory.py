"""Engine-process memory under sustained load: is RSS bounded by weights + KV budget + 600 MB,
and flat over the run?

    .venv/bin/python -m benchmarks.memory [--minutes 10] [--concurrency 16] [--model DIR] [--mixed]

Starts `servelm serve`, keeps `--concurrency` streams of 256-token prompts / 128-token answers
going for `--minutes` (every prompt different, so the KV cache keeps being filled, evicted and
reused), and samples the engine process's RSS from /proc every `--every` seconds. Prints the
samples, the bound, and the growth over the second half of the run (RSS first climbs while
the lazily zeroed KV cache is written for the first time).

`--mixed`: the shapes of real traffic instead (issue #32): prompts of 56-709 tokens, answers of
16-128, half of them streamed, 12 % cancelled mid-stream (the client goes away), at
`--concurrency` (8 for this workload in the issue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.serve_latency import MODEL_NAME, WEIGHTS_LINE, Server
from servelm.bench import BenchConfig, Load, WorkloadSpec, run_benchmark

ALLOWANCE = 600 * 2**20
MAPPING = re.compile(r"([0-9a-f]+)-([0-9a-f]+) ")  # a mapping's first line in /proc/PID/smaps


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rss_outside_kv_pool(pid: int) -> int:
    """RSS outside the process's largest mapping (the KV pool, mapped once, whose pages are
    first written as blocks are first used): what grows here is the engine's own memory."""
    sizes, current = [], None  # (mapping size, its RSS)
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if header := MAPPING.match(line):
            current = int(header[2], 16) - int(header[1], 16)
        elif line.startswith("Rss:") and current is not None:
            sizes.append((current, int(line.split()[1]) * 1024))
    largest = max(sizes)[1] if sizes else 0
    return sum(rss for _, rss in sizes) - largest


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


async def mixed_load(url: str, minutes: float, concurrency: int, seed: int = 0) -> dict:
    """The mixed workload (see the top of the file) for `minutes`; returns its counts."""
    import httpx

    rng = random.Random(seed)
    words = "the a engine token cache block prompt answer request model server time".split()
    counts = {"completed": 0, "cancelled": 0, "failed": 0}
    deadline = time.monotonic() + minutes * 60

    async def one(client: httpx.AsyncClient) -> None:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(56, 709)))
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(16, 128)}
        cancel_after = rng.randint(1, 8) if rng.random() < 0.12 else None
        if cancel_after is None and rng.random() < 0.5:
            reply = await client.post("/v1/completions", json=body)
            counts["completed" if reply.status_code == 200 else "failed"] += 1
            return
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                counts["failed"] += 1
                return
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if cancel_after is not None and chunks >= cancel_after:
                    counts["cancelled"] += 1  # leaving the block closes the connection
                    return
            counts["completed"] += 1

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            try:
                await one(client)
            except httpx.HTTPError:
                counts["failed"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--every", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--out", type=Path, default=Path("memory.json"))
    p.add_argument("--mixed", action="store_true", help="the mixed workload with cancellations")
    p.add_argument(
        "--serve-arg", action="append", default=[], help="a `servelm serve` flag (repeatable)"
    )
    args = p.parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from servelm.store.default import ensure_default_model

        model_dir = Path(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="memory-"))
    server = Server(model_dir, args.serve_arg, work / "serve.log")
    samples: list[tuple[float, int]] = []
    outside: list[tuple[float, int]] = []  # RSS outside the KV pool
    try:
        server.wait_ready(600)
        engine_pid = engine_process(server.children())
        weights_gib, kv_gib = budget_from_log(server.tail(100_000))
        bound = int((weights_gib + kv_gib) * 2**30) + ALLOWANCE
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                t = time.monotonic() - t0
                samples.append((t, rss_bytes(engine_pid)))
                outside.append((t, rss_outside_kv_pool(engine_pid)))
                stop.wait(args.every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if args.mixed:
            summary = asyncio.run(mixed_load(server.url, args.minutes, args.concurrency))
        else:
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
            summary = asyncio.run(run_benchmark(config)).runs[0].summary
        stop.set()
        sampler.join()
        samples.append((time.monotonic() - t0, rss_bytes(engine_pid)))
        outside.append((samples[-1][0], rss_outside_kv_pool(engine_pid)))
    finally:
        server.stop()

    mib = 2**20
    for (t, rss), (_, other) in zip(samples, outside, strict=True):
        print(f"{t:7.0f} s  RSS {rss / mib:8.1f} MiB, outside the KV pool {other / mib:8.1f} MiB")
    # The KV cache is calloc'd: RSS climbs while its pages are first written, then should stay.
    half = samples[len(samples) // 2][1]
    peak = max(r for _, r in samples)
    cancelled = f", {summary['cancelled']} cancelled" if "cancelled" in summary else ""
    print(
        f"{summary['completed']} requests completed, {summary['failed']} failed{cancelled} in "
        f"{args.minutes:g} min; weights {weights_gib:.3f} GiB + KV {kv_gib:.3f} GiB + 600 MiB = "
        f"bound {bound / mib:.0f} MiB; peak RSS {peak / mib:.0f} MiB "
        f"({'within' if peak <= bound else 'OVER'} the bound); growth over the second half of "
        f"the run {(samples[-1][1] - half) / mib:+.1f} MiB, outside the KV pool "
        f"{(outside[-1][1] - outside[len(outside) // 2][1]) / mib:+.1f} MiB"
    )
    args.out.write_text(
        json.dumps(
            {
                "samples": samples,
                "outside_kv_pool": outside,
                "bound_bytes": bound,
                "weights_gib": weights_gib,
                "kv_gib": kv_gib,
                "summary": summary,
                "workload": "mixed" if args.mixed else "fixed",
            },
            indent=1,
            default=str,
        )
    )
    return 0 if peak <= bound and not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
