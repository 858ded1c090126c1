"""What the live dashboard costs the engine (issue #36: under 1 % of step time under W2 load).

    .venv/bin/python -m benchmarks.dashboard_cost [--model DIR] [--rounds 4] [--requests 16]
        [--output-len 128] [--skip-live] [--out dashboard_cost.json]

1. Offline, no model: building one snapshot (servelm/engine/dashboard.py) and encoding the step
   message that carries it, on a real Scheduler whose pool is half full (64 running requests
   sharing a 256-token prefix), for pools of 2,900 blocks (the default model in 1 GiB here), 16,384 and
   65,536 blocks (a GPU's), aggregated to at most 4,096 cells.
2. Live: one `servelm serve` of the default model with --step-trace under W2's shape (256-token
   prompts, 128 out, concurrency 16), in rounds that alternate without and with a dashboard
   client reading /dashboard/feed (the machine drifts within minutes: the rounds bracket each
   other). Per round: output tokens/s and the mean step time from the trace; with the page, the
   snapshots the engine built and what building them took, measured inside the engine
   (`build_seconds` of each), over the engine's step time in the round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_latency import Server
from benchmarks.workloads import cpu_kind
from servelm.engine.dashboard import COST_SHARE, build_snapshot
from servelm.engine.messages import EngineCoreOutputs, encode
from servelm.engine.outputs import ModelRunnerOutput
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler, SchedulerConfig
from servelm.server.dashboard import SNAPSHOT_INTERVAL


def offline(num_blocks: int, repeats: int = 30) -> dict[str, Any]:
    """Build + encode times of one snapshot of a half-full pool of `num_blocks` blocks."""
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=64,
                                  max_num_batched_tokens=1 << 22, max_model_len=1 << 20))  # fmt: skip
    per_request = num_blocks * 16 // 2 // 64  # tokens of its own: the pool half full
    system = list(range(1000, 1256))  # 16 shared blocks
    for k in range(64):
        body = [k % 500 + 1] * per_request
        s.add_request(Request(f"cmpl-{k:024d}-0", system + body, SamplingParams(max_tokens=8)))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({r.request_id: 7 for r in out.requests}))
    build, enc, size = [], [], 0
    for _ in range(repeats):
        snap = build_snapshot(s)
        t0 = time.perf_counter()
        size = len(encode("step", EngineCoreOutputs([], None, snap)))
        enc.append(time.perf_counter() - t0)
        build.append(snap.build_seconds)
    return {
        "num_blocks": num_blocks,
        "blocks_in_use": snap.blocks_in_use,
        "blocks_per_cell": snap.blocks_per_cell,
        "build_ms": round(1000 * statistics.median(build), 3),
        "encode_ms": round(1000 * statistics.median(enc), 3),
        "message_kib": round(size / 1024, 1),
        # at 4 snapshots a second (the default), the share of one second of engine time ...
        "share_at_4_per_s": round(4 * (statistics.median(build) + statistics.median(enc)), 5),
        # ... and as the engine paces them (never more often than keeps building under 0.5 %)
        "share_paced": round(
            (statistics.median(build) + statistics.median(enc))
            / max(SNAPSHOT_INTERVAL, statistics.median(build) / COST_SHARE),
            5,
        ),
    }


class FeedReader(threading.Thread):
    """Reads /dashboard/feed until stopped; keeps each engine snapshot once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.snapshots: dict[float, dict[str, Any]] = {}
        self.events = 0

    def run(self) -> None:
        while not self.stop.is_set():  # as a page does: the server ends each stream after 15 s
            with httpx.stream("GET", self.url + "/dashboard/feed", timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events += 1
                        engine = json.loads(line[6:]).get("engine")
                        if engine:
                            engine.pop("steps", None)
                            self.snapshots[engine["time"]] = engine
                    if self.stop.is_set():
                        return


def live(
    model_dir: Path, rounds: int, requests: int, output_len: int, log_dir: Path
) -> list[dict[str, Any]]:
    from servelm.bench import BenchConfig, Load, WorkloadSpec, run_benchmark

    trace = log_dir / "steps.jsonl"
    server = Server(model_dir, ["--step-trace", str(trace)], log_dir / "server.log")
    server.wait_ready(300)
    rows = []
    try:
        for k in range(rounds):
            watched = k % 2 == 1
            reader = FeedReader(server.url) if watched else None
            if reader is not None:
                reader.start()
                time.sleep(1.0)  # connected, first snapshot in
            t0 = time.time()
            config = BenchConfig(
                base_url=server.url, model=server.model_name, endpoint="completions",
                workload=WorkloadSpec(input_len=256, output_len=output_len), tokenizer=str(model_dir),
                loads=(Load(concurrency=16),), num_requests=requests, seed=k,
            )  # fmt: skip
            run = asyncio.run(run_benchmark(config)).runs[0]
            t1 = time.time()
            if reader is not None:
                reader.stop.set()
            steps = []
            for line in trace.read_text().splitlines():
                row = json.loads(line)
                if "seconds" in row and t0 <= row["time"] <= t1:
                    steps.append(row["seconds"])
            step_total = sum(steps)
            record = {
                "round": k,
                "dashboard": watched,
                "output_tok_s": round(run.summary["output_throughput"], 2),
                "steps": len(steps),
                "mean_step_ms": round(1000 * step_total / max(len(steps), 1), 3),
            }
            if reader is not None:
                snaps = [s for s in reader.snapshots.values() if t0 <= s["time"] <= t1]
                build = sum(s["build_seconds"] for s in snaps)
                record.update(
                    snapshots=len(snaps),
                    snapshots_per_s=round(len(snaps) / (t1 - t0), 2),
                    build_ms_mean=round(1000 * build / max(len(snaps), 1), 3),
                    engine_share=round(build / step_total, 5) if step_total else None,
                )
            rows.append(record)
            print(json.dumps(record), flush=True)
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the servelm default model)")
    p.add_argument("--rounds", type=int, default=4, help="alternating: without, with, ...")
    p.add_argument("--requests", type=int, default=16, help="requests per round")
    p.add_argument("--output-len", type=int, default=128, help="W2's is 128")
    p.add_argument("--skip-live", action="store_true", help="offline measurements only")
    p.add_argument("--out", help="write every number here (JSON)")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"cpu": cpu_kind()}
    result["offline"] = [offline(n) for n in (2_900, 16_384, 65_536)]
    for row in result["offline"]:
        print(json.dumps(row), flush=True)
    if not args.skip_live:
        if args.model:
            model_dir = Path(args.model)
        else:
            from servelm.store.default import ensure_default_model

            model_dir = Path(ensure_default_model())
        with tempfile.TemporaryDirectory(prefix="dashboard-cost-") as tmp:
            result["live"] = live(model_dir, args.rounds, args.requests, args.output_len, Path(tmp))
        on = [r for r in result["live"] if r["dashboard"]]
        off = [r for r in result["live"] if not r["dashboard"]]
        if on and off:
            result["summary"] = {
                "engine_share_max": max(r["engine_share"] or 0 for r in on),
                "mean_step_ms_off": statistics.mean(r["mean_step_ms"] for r in off),
                "mean_step_ms_on": statistics.mean(r["mean_step_ms"] for r in on),
                "output_tok_s_off": statistics.mean(r["output_tok_s"] for r in off),
                "output_tok_s_on": statistics.mean(r["output_tok_s"] for r in on),
            }
            print(json.dumps(result["summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
