"""Calibrated simulator vs the real server on this machine: TTFT p50 and TPOT p50 per rate.

    .venv/bin/python benchmarks/sim_vs_bench.py                 # writes docs/planning/
    .venv/bin/python benchmarks/sim_vs_bench.py --profile docs/planning/cpu_profile.json

1. `servelm serve` starts the default model on a free loopback port, with `--step-trace`.
2. Calibration (default `--calibration serve`): `servelm bench` loads that server at
   `--calibration-rates` with its own seed; `servelm simulate --calibrate-trace --calibrate-bench`
   fits a CPU profile to the steps the server traced meanwhile, and the time a request spends
   outside them to that bench run. (`--calibration inprocess` instead times the engine alone in
   this process with `servelm simulate --calibrate`, and has no time outside steps; `--profile`
   skips calibrating.)
3. Three Poisson rates are picked ONCE from the simulator's capacity for that profile (requests/s
   at which p90 TTFT stays under --capacity-slo-ttft-ms): light, medium and near capacity.
4. `servelm bench` measures the server at those rates (new seed, new prompts). With serve
   calibration, a second calibration pass (a third seed) follows, and the profile is refitted
   to both passes: a shared machine drifts by 10-30 % within minutes, and calibrating on both
   sides of the measured runs lets the drift weigh on the profile from both sides.
   `servelm simulate --profile` then simulates the same workload, rates, request counts and
   engine settings (KV blocks read from the server's /metrics, max-num-seqs,
   max-num-batched-tokens, max-prefill-admit-tokens, block size, prefix caching, one replica).
5. Prints rate | real/sim TTFT p50 | error | real/sim TPOT p50 | error, writes
   sim_vs_bench.json, bench.json, sim.json and overlay plots (servelm bench's plot function
   with both result files) into --out-dir. The steps the server traced during the measured
   runs are kept too (measured_trace.jsonl), and the profile's price for them is printed next
   to their traced time: drift of the machine, or a bias of the step model, shows there.

Nothing is tuned per rate, and nothing is fitted to the measured runs: one calibration on its
own load, one set of engine settings, three rates.
Prefix caching is off on both sides: bench prompts are random, so it would not hit anyway,
and turning it off removes one difference between the two engines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests/live_server.py

from servelm.config import EngineArgs  # noqa: E402
from servelm.engine.step_trace import read_step_trace, read_trace_engine  # noqa: E402
from servelm.planner.shapes import shape_from_folder  # noqa: E402
from servelm.sim.fit import predict  # noqa: E402
from servelm.sim.profiles import load_profile  # noqa: E402
from servelm.sim.roofline import ModelCost  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

SERVELM = [sys.executable, "-m", "servelm.cli"]
TOLERANCE = 0.25


def sh(cmd: list[str], log: Path) -> str:
    """Run a servelm command, tee its output into `log`, return stdout; raise on failure."""
    print("$", " ".join(cmd[2:] if cmd[:2] == SERVELM[:2] else cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    print(f"  ({time.perf_counter() - t0:.0f} s, exit {proc.returncode})", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def server_num_blocks(server: LiveServer) -> int:
    for key, value in server.metrics().items():
        m = re.search(r"cache_config_info\{.*num_gpu_blocks=(\d+)", key)
        if m and value:
            return int(m.group(1))
    raise RuntimeError("server /metrics has no cache_config_info with num_gpu_blocks")


def traced_lines(trace: Path) -> list[str]:
    """The complete lines of a step trace the server is still appending to."""
    text = trace.read_text() if trace.exists() else ""
    return text.splitlines(keepends=True)[: text.count("\n")]


def trace_since(trace: Path, start: int) -> str:
    """The trace's lines from line `start` on, after its engine line (the fit reads from it
    which steps ran on the decode stack)."""
    engine = json.dumps({"engine": read_trace_engine(trace)}) + "\n"
    return engine + "".join(traced_lines(trace)[start:])


def p50(run: dict, metric: str) -> float | None:
    return (run["summary"].get(metric) or {}).get("p50")


def error(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else (sim - real) / real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "planning"))
    ap.add_argument("--profile", help="use this calibrated profile instead of calibrating")
    ap.add_argument("--calibration", choices=("serve", "inprocess"), default="serve",
                    help="fit to a loaded server's step trace (default) or time the engine "
                    "alone in this process")  # fmt: skip
    ap.add_argument("--calibration-rates", default="2,5,8,11",
                    help="req/s of the calibration load (serve): from light load to about capacity")  # fmt: skip
    ap.add_argument("--calibration-requests", type=int, default=32, help="per calibration rate")
    ap.add_argument("--calibrate-seconds", type=float, default=60.0, help="inprocess only")
    ap.add_argument(
        "--calibrate-clock",
        choices=("wall", "cpu"),
        default="wall",
        help="passed to `servelm simulate --calibrate-clock` (default: wall)",
    )
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=48, help="per rate")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted bench requests per rate")
    ap.add_argument("--rates", help="comma list; default: 0.25, 0.55, 0.85 x simulated capacity")
    ap.add_argument("--fractions", default="0.25,0.55,0.85", help="of the simulated capacity")
    ap.add_argument("--capacity-slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)  # serve's
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    ap.add_argument("--max-prefill-admit-tokens", type=int,
                    default=EngineArgs().prefill_admit_tokens("cpu"))  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 1,
                    help="server torch threads; must match calibration (engine default)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from servelm.store.default import ensure_default_model

    t_start = time.perf_counter()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "sim_vs_bench.log"
    log.write_text("")
    model_dir = ensure_default_model()

    workload = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    engine = ["--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-prefill-admit-tokens", str(args.max_prefill_admit_tokens),
              "--block-size", str(args.block_size)]  # fmt: skip
    trace = out / "step_trace.jsonl"
    trace.unlink(missing_ok=True)

    # 1. the real server, tracing its steps
    server = LiveServer(
        model_dir, *engine, "--num-threads", str(args.num_threads), "--no-prefix-caching",
        "--step-trace", str(trace), "--log-level", "warning", startup_timeout=300,
    )  # fmt: skip
    try:
        num_blocks = server_num_blocks(server)
        sim_engine = [*engine, "--num-blocks", str(num_blocks), "--no-prefix-caching",
                      "--replicas", "1"]  # fmt: skip

        def bench(name: str, sweep: str, requests: int, seed: int) -> Path:
            path = out / name
            sh([*SERVELM, "bench", "--base-url", server.url, "--endpoint", "completions",
                *workload, "--sweep-rate", sweep, "--num-requests", str(requests),
                "--warmup", str(args.warmup), "--seed", str(seed), "--slo-ttft-ms", "0",
                "--slo-tpot-ms", "0", "--out", str(path)], log)  # fmt: skip
            return path

        def calibration_pass(i: int) -> tuple[Path, Path]:
            """A calibration load, its bench results and the steps it traced."""
            start = len(traced_lines(trace))
            results = bench(f"calibration_bench_{i}.json", args.calibration_rates,
                            args.calibration_requests, args.seed + 1000 * i)  # fmt: skip
            time.sleep(0.5)  # the engine writes a step's line just after sending its tokens
            steps = out / f"calibration_trace_{i}.jsonl"
            steps.write_text(trace_since(trace, start))
            return steps, results

        def fit(passes: list[tuple[Path, Path]]) -> None:
            files = [arg for steps, results in passes for arg in
                     ("--calibrate-trace", str(steps), "--calibrate-bench", str(results))]  # fmt: skip
            sh([*SERVELM, "simulate", *sim_engine, *files, "--profile-out", str(profile)], log)

        # 2. calibrate
        profile = Path(args.profile) if args.profile else out / "cpu_profile.json"
        passes = []
        if args.profile is None and args.calibration == "inprocess":
            sh([*SERVELM, "simulate", "--calibrate", "--profile-out", str(profile),
                "--calibrate-seconds", f"{args.calibrate_seconds:g}",
                "--calibrate-clock", args.calibrate_clock], log)  # fmt: skip
        elif args.profile is None:
            passes.append(calibration_pass(1))
            fit(passes)
        profile_args = ["--profile", str(profile)]
        t_cal = time.perf_counter()

        # 3. rates from the simulator's capacity for this profile (one estimate, all rates)
        if args.rates:
            rates = [float(r) for r in args.rates.split(",")]
            capacity = None
        else:
            text = sh([*SERVELM, "simulate", *sim_engine, *profile_args, *workload,
                       "--find-capacity", "--num-requests", "400",
                       "--slo-ttft-ms", f"{args.capacity_slo_ttft_ms:g}",
                       "--slo-threshold", "0.9"], log)  # fmt: skip
            m = re.search(r"capacity of one replica: ([\d.]+) req/s", text)
            if not m:
                raise RuntimeError(f"no capacity in simulate output:\n{text}")
            capacity = float(m.group(1))
            rates = [round(f * capacity, 2) for f in map(float, args.fractions.split(","))]
        sweep = ",".join(f"{r:g}" for r in rates)
        print(f"KV blocks {num_blocks}; simulated capacity {capacity} req/s; rates {sweep}")

        # 4a. measure (keeping the steps the server traced meanwhile, to judge the profile on)
        start = len(traced_lines(trace))
        bench_json = bench("bench.json", sweep, args.num_requests, args.seed)
        time.sleep(0.5)  # the engine writes a step's line just after sending its tokens
        measured_trace = out / "measured_trace.jsonl"
        measured_trace.write_text(trace_since(trace, start))
        t_bench = time.perf_counter()

        # 2b. calibrate again, after the measured runs, and fit both passes: the machine's
        # drift over the measured runs then weighs on the profile from both sides
        if passes:
            passes.append(calibration_pass(2))
            fit(passes)
    finally:
        server.stop()
        trace.unlink(missing_ok=True)  # what is kept was copied out above
    fit_report = json.loads(profile.read_text())
    cal_threads = fit_report.get("fit", {}).get("torch_threads")
    if cal_threads is not None and cal_threads != args.num_threads:
        print(f"warning: calibration used {cal_threads} torch threads, server {args.num_threads}")

    # How well the profile prices the steps the server took during the measured runs: the
    # profile's sum against the traced sum tells machine drift (or a step model's bias) apart
    # from what happens between steps.
    steps = read_step_trace(measured_trace)
    cost = ModelCost.from_shape(shape_from_folder(model_dir))
    fitted = load_profile(profile).profile
    predicted = sum(predict(fitted, cost, step) for step, _ in steps)
    traced = sum(seconds for _, seconds in steps)
    measured_steps = {"steps": len(steps), "traced_s": traced, "predicted_s": predicted,
                      "error": error(predicted, traced)}  # fmt: skip
    print(
        f"measured runs: {len(steps)} steps, traced {traced:.1f} s, the profile prices them at "
        f"{predicted:.1f} s ({_pct(measured_steps['error'])})"
    )

    # 4b. simulate the same levels
    sim_json = out / "sim.json"
    sh([*SERVELM, "simulate", *sim_engine, *profile_args, *workload, "--sweep-rate", sweep,
        "--num-requests", str(args.num_requests), "--seed", str(args.seed),
        "--slo-ttft-ms", "0", "--out", str(sim_json)], log)  # fmt: skip

    # 5. compare
    real = json.loads(bench_json.read_text())
    sim = json.loads(sim_json.read_text())
    rows = []
    for r_run, s_run, rate in zip(real["runs"], sim["runs"], rates, strict=True):
        row = {"rate": rate}
        for metric in ("ttft_ms", "tpot_ms"):
            a, b = p50(r_run, metric), p50(s_run, metric)
            e = error(b, a)
            row[metric] = {"real_p50": a, "sim_p50": b, "error": e,
                           "within_25pct": e is not None and abs(e) <= TOLERANCE}  # fmt: skip
        row["real_throughput_rps"] = r_run["summary"].get("request_throughput")
        row["sim_throughput_rps"] = s_run["summary"].get("request_throughput")
        rows.append(row)

    from servelm.bench.plots import plot_results

    plots = plot_results(
        [real, sim], out, ["servelm bench (real)", "servelm simulate (calibrated)"]
    )
    labels = ("light", "medium", "near capacity")
    lines = [
        "| load | rate (req/s) | real TTFT p50 | sim TTFT p50 | error | real TPOT p50 | "
        "sim TPOT p50 | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(rows):
        t, p = row["ttft_ms"], row["tpot_ms"]
        lines.append(
            f"| {labels[i] if len(rows) == 3 else i + 1} | {row['rate']:g} | "
            f"{_ms(t['real_p50'])} | {_ms(t['sim_p50'])} | {_pct(t['error'])} | "
            f"{_ms(p['real_p50'])} | {_ms(p['sim_p50'])} | {_pct(p['error'])} |"
        )
    table = "\n".join(lines)
    t_end = time.perf_counter()
    summary = {
        "measured_steps": measured_steps,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core CPU",
        "model": str(model_dir),
        "profile": str(profile),
        "calibration": None if args.profile else args.calibration,
        "calibration_rates": args.calibration_rates if args.calibration == "serve" else None,
        "calibrate_clock": args.calibrate_clock if args.calibration == "inprocess" else None,
        "profile_fit": fit_report,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "endpoint": "completions",
        },  # fmt: skip
        "engine": {
            "num_blocks": num_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_prefill_admit_tokens": args.max_prefill_admit_tokens,
            "block_size": args.block_size,
            "num_threads": args.num_threads,
            "prefix_caching": False,
            "replicas": 1,
        },  # fmt: skip
        "simulated_capacity_rps": capacity,
        "tolerance": TOLERANCE,
        "rows": rows,
        "all_within_tolerance": all(
            r[m]["within_25pct"] for r in rows for m in ("ttft_ms", "tpot_ms")
        ),
        "seconds": {
            "start_and_calibrate": t_cal - t_start,
            "measure": t_bench - t_cal,
            "calibrate_again_simulate_and_report": t_end - t_bench,
            "total": t_end - t_start,
        },  # fmt: skip
        "table_markdown": table,
        "plots": [p.name for p in plots],
    }
    (out / "sim_vs_bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "sim_vs_bench.md").write_text(table + "\n")
    print(table)
    print(f"within {TOLERANCE:.0%}: {summary['all_within_tolerance']}; "
          f"total {t_end - t_start:.0f} s; wrote {out}")  # fmt: skip
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


if __name__ == "__main__":
    sys.exit(main())
