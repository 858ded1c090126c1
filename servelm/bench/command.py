"""`servelm bench`: load-test any OpenAI-compatible server and report latency and throughput.

Exit status: 0 when every request succeeded, 1 when any failed (counts by status are printed),
2 when the benchmark could not start (bad arguments, an --out or --plot it could not write,
server unreachable or refusing the API key, no tokenizer), 130 when Ctrl-C stopped it: the
levels so far are reported and written, the last one over the requests that finished (a
second Ctrl-C stops at once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from servelm.bench.config import BenchConfig
from servelm.bench.outputs import check_out_file, check_out_folder
from servelm.bench.report import RichProgress, print_report, report_console
from servelm.bench.results import BenchResult, Load
from servelm.bench.runner import BenchError, run_benchmark
from servelm.bench.stats import SLO
from servelm.bench.workload import LENGTH_DISTS, PRESETS, WorkloadSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server URL, with or without /v1 (default: %(default)s)",
    )
    target.add_argument("--model", help="model name (default: the first one GET /v1/models lists)")
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    target.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos/min_tokens (for servers that reject them)",
    )
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")

    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        choices=sorted(PRESETS),
        default="chat",
        help="preset lengths: chat 500/250, rag 6000/250, shared-prefix "
        "1000-token system prompt + 100/250 (default: %(default)s)",
    )
    work.add_argument("--input-len", type=int, help="prompt tokens (mean); overrides the preset")
    work.add_argument("--output-len", type=int, help="output tokens (mean); overrides the preset")
    work.add_argument("--prefix-len", type=int, help="shared system prompt tokens")
    work.add_argument("--len-dist", choices=LENGTH_DISTS, default="fixed")
    work.add_argument(
        "--len-spread",
        type=float,
        default=0.5,
        help="uniform: +-spread*mean, below 1; lognormal: sigma (default: %(default)s)",
    )
    work.add_argument("--dataset", help='JSONL of {"prompt": ...} or {"messages": [...]}')
    work.add_argument(
        "--tokenizer",
        help="folder with tokenizer.json for exact prompt lengths "
        "(default: the servelm default model's)",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="same seed, same prompts; a server that already saw them will hit "
        "its prefix cache, so change the seed (or restart) between runs",
    )

    load = parser.add_argument_group("load")
    levels = load.add_mutually_exclusive_group()
    levels.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    levels.add_argument("--rate", type=float, help="open loop: requests/s ('inf' = all at once)")
    levels.add_argument("--sweep-concurrency", help="comma list, e.g. 1,2,4,8")
    levels.add_argument("--sweep-rate", help="comma list, e.g. 1,2,4")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop gamma shape: 1 = Poisson, <1 burstier",
    )
    load.add_argument(
        "--max-concurrency", type=int, help="open loop (--rate) cap on requests in flight"
    )
    load.add_argument("--num-requests", type=int, help="per level (default 100 without --duration)")
    load.add_argument("--duration", type=float, help="seconds per level to keep sending")
    load.add_argument("--warmup", type=int, default=0, help="uncounted requests before each level")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=300.0, help="0 = no TTFT limit")
    report.add_argument("--slo-tpot-ms", type=float, default=50.0, help="0 = no TPOT limit")
    report.add_argument(
        "--slo-threshold",
        type=float,
        default=0.9,
        help="share of requests that must meet the SLO for a level to count "
        "towards capacity at SLO (default: %(default)s)",
    )
    report.add_argument(
        "--no-server-metrics",
        dest="server_metrics",
        action="store_false",
        help="do not scrape the server's /metrics",
    )
    report.add_argument("--out", help="write every request and the summaries to this JSON file")
    report.add_argument("--plot", help="write PNG plots into this folder")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed arguments; raises ValueError on a bad combination."""
    workload = WorkloadSpec.from_preset(
        args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        len_dist=args.len_dist,
        len_spread=args.len_spread,
        dataset=args.dataset,
    )
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = 100
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        workload=workload,
        tokenizer=args.tokenizer,
        loads=loads_from_args(args),
        num_requests=num_requests,
        duration_s=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        timeout_s=args.timeout,
        slo=SLO(ttft_ms=args.slo_ttft_ms or None, tpot_ms=args.slo_tpot_ms or None),
        capacity_threshold=args.slo_threshold,
        server_metrics=args.server_metrics,
    )


def loads_from_args(args: argparse.Namespace) -> tuple[Load, ...]:
    def rate_load(rate: float) -> Load:
        return Load(rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency)

    def closed_load(concurrency: int) -> Load:  # (Load refuses a --max-concurrency here)
        return Load(concurrency=concurrency, max_concurrency=args.max_concurrency)

    if args.sweep_concurrency:
        return tuple(closed_load(int(c)) for c in _split(args.sweep_concurrency))
    if args.sweep_rate:
        return tuple(rate_load(float(r)) for r in _split(args.sweep_rate))
    if args.rate is not None:
        return (rate_load(args.rate),)
    return (closed_load(1 if args.concurrency is None else args.concurrency),)


def _split(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise ValueError(f"empty sweep list {text!r}")
    return items


def run(args: argparse.Namespace) -> int:
    console = report_console()
    try:
        config = config_from_args(args)
        # before the run: a path that fails only once the results are ready costs the run
        if args.out:
            check_out_file(args.out, "--out")
        if args.plot:
            check_out_folder(args.plot, "--plot")
    except ValueError as exc:
        console.print(f"servelm bench: {exc}", style="red", markup=False, highlight=False)
        return 2
    try:
        with RichProgress(console) as progress:
            result, interrupted = asyncio.run(run_until_interrupted(config, progress))
    except BenchError as exc:
        console.print(f"servelm bench: {exc}", style="red", markup=False, highlight=False)
        return 2
    if interrupted and not result.runs:
        console.print("servelm bench: interrupted before any request finished", style="red")
        return 130
    print_report(result, console)
    if args.out:
        result.write_json(args.out)
        console.print(f"wrote {args.out}", highlight=False)
    if args.plot:
        from servelm.bench.plots import plot_results  # matplotlib is slow to import

        for path in plot_results([result.to_dict()], args.plot):
            console.print(f"wrote {path}", highlight=False)
    if interrupted:
        last = result.runs[-1]
        said = f"the levels after {last.load.label()} did not run"
        if last.interrupted:
            said = (
                f"level {last.load.label()} was cut short: its figures are over the "
                f"{len(last.requests)} requests that finished, and it counts for no capacity"
            )
        console.print(f"servelm bench: interrupted: {said}", style="red", highlight=False)
        return 130
    return 1 if result.failed else 0


async def run_until_interrupted(
    config: BenchConfig, progress: RichProgress | None = None
) -> tuple[BenchResult, bool]:
    """`run_benchmark` with Ctrl-C (SIGINT) as its `stop`; returns (result, whether stopped).
    The first Ctrl-C ends the run with what has finished; it also takes the handler away, so
    a second one stops at once (a KeyboardInterrupt, which `servelm.cli.main` reports)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        loop.remove_signal_handler(signal.SIGINT)
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # no signals here (Windows, another thread)
        pass
    try:
        result = await run_benchmark(config, progress=progress, stop=stop)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    cut = len(result.runs) < len(config.loads) or any(run.interrupted for run in result.runs)
    return result, stop.is_set() and cut  # (a Ctrl-C after the last request: nothing cut)
