"""Serving latency of `servelm serve` at low and high concurrency: TTFT and inter-token latency.

    .venv/bin/python benchmarks/serve_latency.py [--model DIR] [--concurrency 1,16]
        [--input-len 256] [--output-len 64] [--num-requests 32] [--warmup 2]
        [--out serve_latency.json] [--serve-arg=--num-threads=1 ...]

Starts `servelm serve` on a free loopback port (the default model unless `--model` is given),
runs `servelm bench` (its programmatic API: a closed loop of a chat-like workload with exact
prompt lengths, EOS ignored so every answer has `--output-len` tokens) at each concurrency in
turn, prints TTFT, ITL (gap between streamed chunks) and TPOT percentiles per level together with
the server's own TTFT median from /metrics, writes a JSON file, and stops the server.

The JSON holds `setup` (model, dtype, device, flags, CPU count, load average before and after),
`levels` (the printed numbers) and `bench` (the full `servelm.bench/1` result, every request).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from servelm.bench import BenchConfig, BenchResult, Load, WorkloadSpec, run_benchmark
from servelm.bench.ready import wait_healthy

MODEL_NAME = "bench-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The engine's start-up line, the one place benchmarks read what was loaded: "weights loaded in
# 0.79 s: 0.312 GiB (torch.bfloat16, cpu, int4 weights for 120 projections)", the int4
# part only when some projection has an int4 copy (and ", kept from the last start" when the
# store had them packed already).
WEIGHTS_LINE = re.compile(
    r"weights loaded in [\d.]+ s: (?P<gib>[\d.]+) GiB \(torch\.(?P<dtype>\w+), (?P<device>[\w:]+)"
    r"(?:, int4 (?:decode )?weights for (?P<int4>\d+) projections(?:, kept from the last start)?)?\)"
)


class Server:
    """`servelm serve` in a child process, logging to a file; stop() ends it (SIGTERM, then kill).

    `peer`, a command line with `{port}` in it (and optionally `{model}`, the model folder),
    starts another OpenAI-compatible server instead, e.g. llama.cpp's
    `llama-server -m model.gguf --port {port}`: it is ready once GET /v1/models answers, and
    it serves whatever model name it lists (`model_name`)."""

    def __init__(self, model_dir: Path, extra: list[str], log: Path, peer: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        if peer is None:
            cmd = [sys.executable, "-m", "servelm.cli", "serve", str(model_dir)]
            cmd += ["--port", str(self.port), "--served-model-name", MODEL_NAME, *extra]
            self.ready_path, self.model_name = "/health", MODEL_NAME
        else:
            cmd = shlex.split(peer.format(port=self.port, model=model_dir))
            self.ready_path, self.model_name = "/v1/models", None
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.url + self.ready_path, self.proc, timeout_s, 0.5, self.tail)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def weights(self) -> dict[str, Any]:
        """dtype, device and int4 projections from the server's start-up line (`WEIGHTS_LINE`)."""
        found = WEIGHTS_LINE.search(self.tail(100_000))
        if not found:
            return {"dtype": None, "device": None, "int4_projections": None}
        return {
            "dtype": found["dtype"],
            "device": found["device"],
            "int4_projections": int(found["int4"] or 0),
        }

    def children(self) -> list[int]:
        """Child pids of the server (Linux /proc; empty elsewhere or once it has exited)."""
        try:
            path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            return [int(pid) for pid in path.read_text().split()]
        except (OSError, ValueError):
            return []

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server, then end any child it left behind (its engine-core process
        outlives a SIGTERM-ed `servelm serve` at the time of writing)."""
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in children:
            _end(pid)


def _end(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    sig = signal.SIGTERM
    while True:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.2)


def level_row(run: Any) -> dict[str, Any]:
    s = run.summary
    server = run.server or {}
    return {
        "concurrency": run.load.concurrency,
        "completed": s["completed"],
        "failed": s["failed"],
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "ttft_ms": {q: s["ttft_ms"][q] for q in ("p50", "p99")},
        "itl_ms": {q: s["itl_ms"][q] for q in ("p50", "p99")},
        "tpot_ms": {q: s["tpot_ms"][q] for q in ("p50", "p99")},
        "server_ttft_p50_ms": server.get("ttft_p50_ms"),
    }


def finite(value: Any) -> Any:
    """Strict JSON: NaN or infinity (a server gauge can report one) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def run_record(model_dir: Path, serve_flags: list[str], load_before: tuple) -> dict[str, Any]:
    """What every benchmark's JSON starts with: when, which model and flags, on what machine."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": str(model_dir),
        "serve_flags": serve_flags,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Strict JSON (NaN and infinity as null), the folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(data), indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}")


def print_table(rows: list[dict[str, Any]]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    head = ("conc", "ok", "fail", "req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    head += ("TPOT p50", "TPOT p99", "srv TTFT p50")
    widths = (5, 4, 5, 7, 7, 9, 9, 8, 8, 9, 9, 13)
    cells = [
        (
            str(r["concurrency"]), str(r["completed"]), str(r["failed"]),
            f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
            ms(r["ttft_ms"]["p50"]), ms(r["ttft_ms"]["p99"]),
            ms(r["itl_ms"]["p50"]), ms(r["itl_ms"]["p99"]),
            ms(r["tpot_ms"]["p50"]), ms(r["tpot_ms"]["p99"]), ms(r["server_ttft_p50_ms"]),
        )
        for r in rows
    ]  # fmt: skip
    print_columns(head, widths, cells, "   (ms)")


def print_columns(head, widths, rows, note: str = "") -> None:
    """A right-aligned text table: a header line (plus `note`), then one line per row."""
    print("".join(h.rjust(w) for h, w in zip(head, widths, strict=True)) + note)
    for cells in rows:
        print("".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the servelm default model)")
    p.add_argument("--concurrency", default="1,16", help="comma list (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument("--num-requests", type=int, default=32, help="per level (default: 32)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before each level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("serve_latency.json"))
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra flag for servelm serve, repeatable: --serve-arg=--num-threads=1",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    args = p.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency must be a comma list of integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs at least one level, each >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (kill, timeout) unwinds like Ctrl-C, so the server below is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.model:
        model_dir = Path(args.model)
    else:
        from servelm.store.default import ensure_default_model

        model_dir = Path(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="serve-latency-"))
    load_before = os.getloadavg()
    server = Server(model_dir, args.serve_arg, work / "serve.log")
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.startup_timeout)
        startup_s = time.perf_counter() - t0
        print(f"servelm serve ready in {startup_s:.0f} s at {server.url} (log: {server.log})")
        config = BenchConfig(
            base_url=server.url,
            model=MODEL_NAME,
            workload=WorkloadSpec(input_len=args.input_len, output_len=args.output_len),
            tokenizer=str(model_dir),
            loads=tuple(Load(concurrency=c) for c in args.levels),
            num_requests=args.num_requests,
            warmup=args.warmup,
            seed=args.seed,
        )
        result: BenchResult = asyncio.run(run_benchmark(config))
    finally:
        server.stop()
    load_after = os.getloadavg()
    rows = [level_row(run) for run in result.runs]
    setup = {
        **run_record(model_dir, args.serve_arg, load_before),
        **server.weights(),
        "loadavg_after": load_after,
        "startup_s": startup_s,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_requests": args.num_requests,
        "warmup": args.warmup,
    }
    print(
        f"{model_dir.name} ({setup['dtype']}, {setup['device']}), {args.input_len} in / "
        f"{args.output_len} out, {args.num_requests} requests per level; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} CPUs"
    )
    print_table(rows)
    write_json(args.out, {"setup": setup, "levels": rows, "bench": result.to_dict()})
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
