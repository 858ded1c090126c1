"""`servelm plan`: size a deployment from the command line (rich table or JSON).

servelm plan llama-3.1-8b --gpu h100-80gb
servelm plan llama-3.1-70b --tp 4 --json
servelm plan ./my-model-folder --gpu custom --gpu-memory-gb 48 --gpu-bandwidth-gbs 960
servelm plan --list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from servelm.config import fraction, positive_int
from servelm.planner.catalog import GB, GPUS, MODELS, GpuSpec, get_gpu, resolve_model
from servelm.planner.plan import Plan, PlanError, plan
from servelm.planner.shapes import KV_BYTES, WEIGHT_BYTES, ShapeError


def bounded_float(least: float, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite number above `least` (`strict`) or from it up; anything else
    is a usage error naming the flag. A memory, bandwidth or time of 0 or less would give a
    plan (or a simulation) of negative memory or time, or be taken for the flag left out."""
    bound = f"> {least:g}" if strict else f">= {least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # fails the test below
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"not a number {bound}: {text!r}")
        return value

    parse.__name__ = "number"  # the type argparse names in "invalid ... value"
    return parse


positive_number = bounded_float(0, strict=True)
non_negative_number = bounded_float(0, strict=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="catalog name (see --list) or its hub id (Qwen/Qwen2.5-7B-Instruct), or a local "
        "model folder / config.json (for another hub model: the folder `servelm fetch` prints)",
    )
    parser.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(GPUS)}, or custom")
    parser.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel GPUs (default 1)"
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(WEIGHT_BYTES), help="weights")
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_BYTES), help="KV cache")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    parser.add_argument(
        "--max-model-len", type=positive_int, default=None, help="default: model maximum"
    )
    parser.add_argument(
        "--typical-len", type=positive_int, default=2500, help="tokens in a typical request"
    )
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument(
        "--allowance-gb",
        type=non_negative_number,
        default=2.0,
        help="activations + CUDA graphs per GPU (GB)",
    )
    parser.add_argument("--gpu-memory-gb", type=positive_number, help="override GPU memory (GB)")
    parser.add_argument(
        "--gpu-bandwidth-gbs", type=positive_number, help="override HBM bandwidth (GB/s)"
    )
    parser.add_argument("--gpu-tflops", type=positive_number, help="override dense TFLOP/s")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--list", action="store_true", help="list catalog models and GPUs")


def _gpu_from_args(args: argparse.Namespace) -> GpuSpec:
    overrides = {
        "memory_bytes": args.gpu_memory_gb and args.gpu_memory_gb * GB,
        "mem_bandwidth": args.gpu_bandwidth_gbs and args.gpu_bandwidth_gbs * GB,
        "bf16_flops": args.gpu_tflops and args.gpu_tflops * 1e12,
    }
    overrides = {k: v for k, v in overrides.items() if v}
    if args.gpu.lower() == "custom":
        if "memory_bytes" not in overrides:
            raise ShapeError("--gpu custom needs --gpu-memory-gb")
        base = GpuSpec("custom GPU", 0.0, 1e12, 100e12)
        return dataclasses.replace(base, **overrides)
    base = get_gpu(args.gpu)
    if not overrides:
        return base
    if "bf16_flops" in overrides:
        overrides["fp8_flops"] = None
    return dataclasses.replace(base, name=f"{base.name} (custom)", **overrides)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.list:
        console.print(_catalog_table())
        return 0
    if not args.model:
        print("servelm plan: give a model (or --list)", file=sys.stderr)
        return 2
    try:
        result = plan(
            resolve_model(args.model),
            _gpu_from_args(args),
            weight_dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            tp=args.tp,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            allowance_gb=args.allowance_gb,
            block_size=args.block_size,
            typical_len=args.typical_len,
        )
    except (ShapeError, PlanError) as exc:
        print(f"servelm plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        console.print(plan_table(result))
    return 0 if result.fits else 1


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def _pool(pool: float) -> str:
    """The KV pool; where weights and allowance leave none (the plan's kv_pool_bytes, usable -
    weights - allowance, is negative), how much memory is missing instead of a negative size."""
    if pool >= 0:
        return _gb(pool)
    return f"none: usable memory is {_gb(-pool)} short"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GB:g} GB/s" if bytes_per_s >= GB else f"{bytes_per_s / 1e6:g} MB/s"


def _params(total: int, active: int) -> str:
    """A mixture of experts holds every expert but runs a token through a few."""
    if active == total:
        return f"{total / 1e9:.2f} B"
    return f"{total / 1e9:.2f} B ({active / 1e9:.2f} B active)"


def plan_table(p: Plan) -> Table:
    """A two-column rich table of one plan."""
    title = f"{p.model} on {p.tp} x {p.gpu}  ({p.weight_dtype} weights, {p.kv_dtype} KV)"
    speeds = ", ".join(f"{c.source} {_rate(c.bandwidth)}" for c in p.cold_start)
    caption = (
        f"cold start = weights / read speed ({speeds}) + PCIe copy"
        f" + {p.cold_start[0].warmup_s:g} s warm-up"
        if p.cold_start
        else None
    )
    table = Table(
        title=title,
        caption=caption,
        show_header=False,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("quantity", style="bold")
    table.add_column("value")
    rows = [
        ("Parameters", _params(p.num_params, p.active_params)),
        ("Weights / GPU", f"{_gb(p.weight_bytes)}  (all GPUs {_gb(p.weight_bytes_total)})"),
        ("Heads / GPU", f"{p.q_heads_per_gpu} query, {p.kv_heads_per_gpu} KV"),
        (
            "KV / token / GPU",
            f"{p.kv_bytes_per_token:,.0f} B = {p.kv_bytes_per_token / 1024:,.0f} KiB"
            f"  (all GPUs {p.kv_bytes_per_token_total:,.0f} B)",
        ),
        (
            "Usable memory",
            f"{_gb(p.gpu_memory_bytes)} x {p.gpu_memory_utilization:g} = {_gb(p.usable_bytes)}",
        ),
        ("Allowance", f"{_gb(p.allowance_bytes)} (activations, graphs)"),
        ("KV cache pool", _pool(p.kv_pool_bytes)),
        (
            "KV capacity",
            f"{p.kv_capacity_tokens:,} tokens = {p.kv_capacity_blocks:,} x {p.block_size}",
        ),
        (f"Concurrency @ {p.max_model_len:,}", f"{p.max_concurrency:.2f}x"),
        (f"Concurrency @ {p.typical_len:,}", f"{p.typical_concurrency:.1f}x"),
        ("Collectives / step", f"{p.collectives_per_step}"),
    ]
    for c in p.cold_start:
        rows.append((f"Cold start, {c.source}", f"{c.total_s:,.0f} s  (read {c.read_s:,.0f} s)"))
    rows.append(("Smallest TP that fits", str(p.min_tp) if p.min_tp else "none up to 8"))
    rows.append(("Verdict", f"[{'green' if p.fits else 'red'}]{p.verdict}[/]"))
    for row in rows:
        table.add_row(*row)
    return table


def _catalog_table() -> Table:
    table = Table(title="servelm plan catalog")
    for col in ("name", "kind", "size", "shape / datasheet"):
        table.add_column(col)
    for key, m in MODELS.items():
        ctx = f"{m.num_layers} layers, heads {m.num_heads}/{m.num_kv_heads}, {m.max_context:,} ctx"
        table.add_row(key, "model", _params(m.num_params(), m.active_params()), ctx)
    for key, g in GPUS.items():
        fp8 = f", fp8 {g.fp8_flops / 1e12:,.0f}" if g.fp8_flops else ""
        notes = f"{g.mem_bandwidth / GB:,.0f} GB/s, TFLOP/s bf16 {g.bf16_flops / 1e12:,.0f}{fp8}"
        table.add_row(key, "gpu", _gb(g.memory_bytes), notes)
    return table
