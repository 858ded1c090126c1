"""`servelm simulate`: latency, throughput and capacity of a deployment, without the hardware.

servelm simulate --model llama-3.1-8b --gpu h100-80gb --preset chat --sweep-rate 2,4,8,16,24,32
servelm simulate --preset rag --find-capacity --replicas 2 --policy least-loaded
servelm simulate --sweep-rate 10,20,40 --target-rate 100 --out sim.json --plot plots/
servelm simulate --calibrate --profile-out cpu.json     # time this machine's real engine
servelm simulate --profile cpu.json --rate 1             # simulate with the fitted profile
servelm simulate --calibrate-trace steps.jsonl --calibrate-bench bench.json --num-blocks N
                                  # fit to a real server's steps (serve --step-trace) and bench

Exit status: 0 on success (requests the engine refuses are counted and a sample reason is
printed), 2 on bad arguments (an --out, --plot or --profile-out that could not be written, a
capacity search without an SLO), an unknown model / GPU / profile file, a deployment that would
refuse every request (a prompt beyond the context or the KV pool, as `servelm plan` refuses a
--max-model-len beyond the model's), or a --target-rate no number of replicas meets.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from servelm.bench.outputs import check_out_file, check_out_folder
from servelm.bench.report import error_lines, report_console, server_table, summary_table
from servelm.bench.results import BenchResult, Load
from servelm.bench.stats import SLO
from servelm.bench.workload import LENGTH_DISTS, PRESETS, WorkloadSpec
from servelm.config import fraction, positive_int, scheduler_limit
from servelm.planner.catalog import GPUS
from servelm.planner.command import non_negative_number, positive_number
from servelm.planner.shapes import KV_BYTES, WEIGHT_BYTES, ShapeError
from servelm.sim.config import POLICIES, SimConfig, resolve
from servelm.sim.fit import NEVER_BINDS
from servelm.sim.profiles import load_profile
from servelm.sim.roofline import DeviceProfile
from servelm.sim.sweep import check_has_slo, replicas_for_rate, run_sweep, search_capacity

DEFAULT_MODEL = "llama-3.1-8b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    dep = parser.add_argument_group("deployment")
    dep.add_argument("--model", help=f"catalog name or folder (default {DEFAULT_MODEL}, or the "
                     "model a --profile was calibrated with)")  # fmt: skip
    dep.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}")
    dep.add_argument("--profile", help="device profile JSON (from --calibrate) instead of --gpu")
    dep.add_argument("--dtype", default="bf16", choices=sorted(WEIGHT_BYTES))
    dep.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_BYTES))
    dep.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel GPUs per replica")
    dep.add_argument("--replicas", type=positive_int, default=1)
    dep.add_argument("--policy", choices=POLICIES, default="round-robin", help="routing")
    dep.add_argument("--num-blocks", type=positive_int,
                     help="KV blocks per replica (default: planner)")  # fmt: skip
    dep.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    dep.add_argument("--allowance-gb", type=non_negative_number, default=2.0)
    dep.add_argument("--kv-cache-gb", type=positive_number,
                     help="KV pool per replica (measured profiles)")  # fmt: skip
    dep.add_argument("--block-size", type=positive_int, default=16)
    dep.add_argument("--max-num-seqs", type=scheduler_limit("max_num_seqs"),
                     help="default: 256 on a --gpu, servelm serve's default with --profile")  # fmt: skip
    dep.add_argument("--max-num-batched-tokens", type=scheduler_limit("max_num_batched_tokens"),
                     help="default: 2048 on a --gpu, servelm serve's default with --profile")  # fmt: skip
    dep.add_argument("--max-prefill-admit-tokens", type=scheduler_limit("max_prefill_admit_tokens"),
                     help="as servelm serve's flag; default: 0 (none) on a --gpu, serve's with "
                     "--profile")  # fmt: skip
    dep.add_argument("--max-model-len", type=positive_int)
    dep.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    dep.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    dep.add_argument("--per-request-us", type=non_negative_number,
                     help="host time per scheduled request per step (default: 20 on a GPU)")  # fmt: skip

    work = parser.add_argument_group("workload (as servelm bench)")
    work.add_argument("--preset", "--workload", dest="preset", choices=sorted(PRESETS),
                      default="chat", help="chat 500/250, rag 6000/250, shared-prefix")  # fmt: skip
    work.add_argument("--input-len", type=int)
    work.add_argument("--output-len", type=int)
    work.add_argument("--prefix-len", type=int)
    work.add_argument("--len-dist", choices=LENGTH_DISTS, default="fixed")
    work.add_argument("--len-spread", type=float, default=0.5,
                      help="uniform: +-spread*mean (below 1); lognormal: sigma")  # fmt: skip
    work.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    levels = load.add_mutually_exclusive_group()
    levels.add_argument("--rate", type=float, help="requests/s (Poisson; see --burstiness)")
    levels.add_argument("--sweep-rate", help="comma list of rates, e.g. 2,4,8,16")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    load.add_argument("--num-requests", type=positive_int, default=2000, help="per level")
    load.add_argument("--find-capacity", action="store_true", help="bisect for the capacity")
    load.add_argument("--target-rate", type=positive_number,
                      help="report replicas needed for this rate")  # fmt: skip

    rep = parser.add_argument_group("report")
    rep.add_argument("--slo-ttft-ms", type=non_negative_number, default=1000.0,
                     help="0 = no TTFT limit")  # fmt: skip
    rep.add_argument("--slo-tpot-ms", type=non_negative_number, default=0.0,
                     help="0 = no TPOT limit (a capacity search needs one of the two)")  # fmt: skip
    rep.add_argument("--slo-threshold", type=fraction, default=0.99,
                     help="share of requests within the SLO (0.99: TTFT p99 under the SLO)")  # fmt: skip
    rep.add_argument("--record-itl", action="store_true", help="keep every inter-token gap")
    rep.add_argument("--out", help="write the --rate / --sweep-rate levels as JSON (servelm "
                     "bench schema)")  # fmt: skip
    rep.add_argument("--plot", help="write PNG plots of those levels into this folder")

    cal = parser.add_argument_group("calibration (times the real engine on this machine)")
    cal.add_argument("--calibrate", action="store_true", help="fit a profile to this CPU")
    cal.add_argument("--profile-out", default="cpu_profile.json")
    cal.add_argument("--calibrate-seconds", type=positive_number, default=45.0,
                     help="seconds for rounds of timed steps after the model loads (the "
                     "first round always completes, however long it takes)")  # fmt: skip
    cal.add_argument("--calibrate-clock", choices=["wall", "cpu"], default="wall",
                     help="time steps by wall time (default) or CPU time / threads (for a "
                     "shared machine; undercounts multi-threaded steps)")  # fmt: skip
    cal.add_argument("--calibrate-model", help="model folder to time (default: default model)")
    cal.add_argument("--calibrate-trace", metavar="FILE", action="append",
                     help="fit to the steps a loaded server traced (`servelm serve --step-trace "
                     "FILE`) instead of timing steps in this process; repeat to fit several")  # fmt: skip
    cal.add_argument("--calibrate-bench", metavar="FILE", action="append",
                     help="with --calibrate-trace: `servelm bench --out` results of the traced "
                     "runs, to fit the server's latency outside engine steps (repeatable); pass "
                     "the server's engine settings (--num-blocks, --max-num-seqs, ...) as well")  # fmt: skip


def config_from_args(args: argparse.Namespace, profile_model: str | None = None) -> SimConfig:
    """A SimConfig from parsed arguments (the profile, if any, already loaded into args)."""
    workload = WorkloadSpec.from_preset(
        args.preset,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        len_dist=args.len_dist,
        len_spread=args.len_spread,
    )
    per_request = None if args.per_request_us is None else args.per_request_us * 1e-6
    return SimConfig(
        model=args.model or profile_model or DEFAULT_MODEL,
        gpu=args.gpu,
        profile=getattr(args, "loaded_profile", None),
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        tp=args.tp,
        replicas=args.replicas,
        policy=args.policy,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        allowance_gb=args.allowance_gb,
        kv_cache_gb=args.kv_cache_gb,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_admit_tokens=args.max_prefill_admit_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        scheduling_policy=args.scheduling_policy,
        per_request_s=per_request,
        workload=workload,
        num_requests=args.num_requests,
        seed=args.seed,
        record_itl=args.record_itl,
        slo=slo_from_args(args),
        capacity_threshold=args.slo_threshold,
    )


def slo_from_args(args: argparse.Namespace) -> SLO:
    return SLO(ttft_ms=args.slo_ttft_ms or None, tpot_ms=args.slo_tpot_ms or None)


def loads_from_args(args: argparse.Namespace) -> list[Load]:
    if args.sweep_rate:
        rates = [float(r) for r in args.sweep_rate.split(",") if r.strip()]
        if not rates:
            raise ValueError(f"empty --sweep-rate {args.sweep_rate!r}")
    else:
        rates = [args.rate] if args.rate is not None else []
    return [Load(rate=r, burstiness=args.burstiness) for r in rates]


def run(args: argparse.Namespace) -> int:
    console = report_console()
    try:
        loads = loads_from_args(args)
        # what this run will do, checked before any of it (calibrating takes a minute, a
        # capacity search many): a file it could not write, a search it could not end
        calibrate_only = (args.calibrate or args.calibrate_trace) and not (
            loads or args.find_capacity or args.target_rate
        )
        search = not calibrate_only and bool(args.find_capacity or args.target_rate or not loads)
        _check_outputs(args, loads)
        if search:
            check_has_slo(slo_from_args(args))
        profile_model = _profile_from_args(args, console)
        if calibrate_only:
            return 0
        config = config_from_args(args, profile_model)
        deployment = resolve(config)
    except (ValueError, ShapeError, OSError) as exc:
        _error(console, exc)
        return 2
    c = deployment.scheduler
    console.print(
        f"{config.replicas} x {deployment.shape.name} on {deployment.profile.name}: "
        f"{c.num_blocks:,} KV blocks ({c.num_blocks * c.block_size:,} tokens) per replica, "
        f"max {c.max_num_seqs} seqs, {c.max_num_batched_tokens} tokens per step"
        + (f", new prompts admitted below {cap}" if (cap := c.max_prefill_admit_tokens) else ""),
        highlight=False,
    )
    if loads:
        result = run_sweep(config, loads)
        _print_result(result, console)
        if args.out:
            result.write_json(args.out)
            console.print(f"wrote {args.out}", highlight=False)
        if args.plot:
            from servelm.bench.plots import plot_results  # matplotlib is slow to import

            for path in plot_results([result.to_dict()], args.plot, ["simulated"]):
                console.print(f"wrote {path}", highlight=False)
    per_replica = None
    if search:
        found = search_capacity(config.with_(replicas=1), burstiness=args.burstiness)
        per_replica = found.rate
        console.print(f"capacity of one replica: [bold]{found.rate:.2f} req/s[/] ({_slo(config)})")
        if config.replicas > 1 and args.find_capacity and found.rate > 0:
            fleet = config.with_(num_requests=config.num_requests * config.replicas)
            total = search_capacity(fleet, start=found.rate, burstiness=args.burstiness).rate
            console.print(f"capacity of {config.replicas} replicas ({config.policy}): {total:.2f}")
    if args.target_rate:
        try:
            n, attained = replicas_for_rate(
                config, args.target_rate, per_replica, burstiness=args.burstiness
            )
        except ValueError as exc:  # no number of replicas meets the SLO: one line, as above
            _error(console, exc)
            return 2
        console.print(
            f"replicas for {args.target_rate:g} req/s: [bold]{n}[/] "
            f"({attained:.1%} of requests within the SLO; "
            f"{math.ceil(args.target_rate / per_replica)} by capacity arithmetic)"
        )
    return 0


def _error(console: Console, exc: Exception) -> None:
    console.print(f"servelm simulate: {exc}", style="red", markup=False, highlight=False)


def _check_outputs(args: argparse.Namespace, loads: list[Load]) -> None:
    """ValueError for a file this run is asked to write but could not, or would not write."""
    if (args.out or args.plot) and not loads:
        raise ValueError(
            "--out and --plot write the levels of --rate or --sweep-rate; a capacity search "
            "alone has none to write"
        )
    if args.out:
        check_out_file(args.out, "--out")
    if args.plot:
        check_out_folder(args.plot, "--plot")
    if args.calibrate or args.calibrate_trace:
        check_out_file(args.profile_out, "--profile-out")


def _profile_from_args(args: argparse.Namespace, console: Console) -> str | None:
    """Calibrate or load a profile into `args.loaded_profile`; return its model, if any."""
    if args.calibrate_bench and not args.calibrate_trace:
        raise ValueError("--calibrate-bench needs --calibrate-trace (the steps of that run)")
    if args.calibrate or args.calibrate_trace:
        from servelm.sim import calibrate as calib  # torch (for --calibrate): only when asked

        if args.calibrate_trace:
            cal = calib.calibrate_from_trace(args.calibrate_trace, args.calibrate_model)
        else:
            console.print(
                f"calibrating: rounds of timed steps for {args.calibrate_seconds:g} s after the "
                "model loads (the first round always completes, however long it takes)..."
            )
            cal = calib.calibrate(
                args.calibrate_model, budget_s=args.calibrate_seconds, clock=args.calibrate_clock
            )
        p = cal.profile_file.profile
        if args.calibrate_bench:
            benches = [json.loads(Path(f).read_text()) for f in args.calibrate_bench]
            api = calib.fit_api_process(benches)
            if api is not None:
                p = replace(p, frontend_per_step_s=api[0], frontend_per_token_s=api[1])
            args.loaded_profile = p
            config = config_from_args(args, cal.profile_file.model)
            p = replace(p, frontend_latency_s=calib.fit_frontend_latency(config, benches))
            cal.profile_file.profile = p
        cal.profile_file.write(args.profile_out)
        stack = ""
        if p.decode_stack is not None:
            rows = p.decode_stack_max_tokens  # sys.maxsize: every decode step
            steps = "decode steps" if rows >= sys.maxsize else f"decode steps of <= {rows} tokens"
            stack = f"; decode stack ({steps}): "
            stack += _rates(p.decode_stack)
        if p.wide_step is not None:
            stack += f"; steps of >= {p.wide_step_min_tokens} tokens: {_rates(p.wide_step)}"
        console.print(
            f"fitted {_rates(p)}, {p.frontend_latency_s * 1e3:.1f} ms outside steps"
            f"{_api_rate(p)}{stack}; "
            f"held-out errors {_errors(cal.held_out_errors)}; wrote {args.profile_out}",
            highlight=False,
        )
        args.loaded_profile = p
        return cal.profile_file.model
    if args.profile:
        loaded = load_profile(args.profile)
        args.loaded_profile = loaded.profile
        return loaded.model
    return None


def _rates(p: DeviceProfile) -> str:
    return (
        f"{_flops(p.peak_flops)}, {_bandwidth(p.mem_bandwidth)}, "
        f"{p.step_overhead_s * 1e3:.1f} ms per step, {p.per_request_s * 1e3:.2f} ms per request"
    )


def _api_rate(p: DeviceProfile) -> str:
    if not (p.frontend_per_step_s or p.frontend_per_token_s):
        return ""
    return (
        f"; API process {p.frontend_per_step_s * 1e3:.2f} ms per step + "
        f"{p.frontend_per_token_s * 1e3:.2f} ms per streamed token"
    )


def _flops(rate: float) -> str:
    return "no compute bound" if rate >= NEVER_BINDS else f"{rate / 1e9:.1f} GFLOP/s"


def _bandwidth(rate: float) -> str:
    return "no memory bound" if rate >= NEVER_BINDS else f"{rate / 1e9:.2f} GB/s"


def _errors(errors: list[float]) -> str:
    """Relative errors: each of a few, or the median and 10th-90th percentiles of many."""
    if len(errors) <= 12:
        return ", ".join(f"{e:+.0%}" for e in errors)
    q = statistics.quantiles(errors, n=10)
    return f"median {statistics.median(errors):+.0%} ({q[0]:+.0%} to {q[-1]:+.0%}, p10-p90)"


def _slo(config: SimConfig) -> str:
    parts = []
    if config.slo.ttft_ms is not None:
        parts.append(f"TTFT <= {config.slo.ttft_ms:g} ms")
    if config.slo.tpot_ms is not None:
        parts.append(f"TPOT <= {config.slo.tpot_ms:g} ms")
    return f"{' and '.join(parts) or 'no SLO'} for {config.capacity_threshold:.0%} of requests"


def _print_result(result: BenchResult, console: Console) -> None:
    table = summary_table(result)
    table.title = f"servelm simulate · {result.config.get('model')}"
    console.print(table)
    server = server_table(result)
    if server is not None:
        server.title = "simulated engine (peaks over each level)"
        console.print(server)
    if len(result.runs) > 1:
        cap = result.capacity
        if cap is None:
            console.print("capacity at SLO: none (the lowest rate misses it)")
        else:
            label = Load.from_dict(cap["load"]).label()
            console.print(f"capacity at SLO among the swept rates: [bold]{label}[/]")
    # requests the engine refused (prompts beyond the context), with a sample reason, as
    # `servelm bench` prints a server's refusals
    for line in error_lines(result):
        console.print(line, style="red", markup=False, highlight=False)
