"""PNG plots of benchmark results: latency and throughput against load, latency CDFs.

Figures are built with matplotlib's object API (Figure, no pyplot), which renders PNGs with
the Agg canvas and never touches the process-wide backend or opens a window.

Plots take result dicts in the results.py JSON schema, so several files (a measured sweep and
a simulated one) overlay on the same axes, one line style per file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from servelm.bench.results import Load


def plot_results(
    results: Sequence[dict[str, Any]], out_dir: str | Path, labels: Sequence[str] | None = None
) -> list[Path]:
    """Write latency_vs_load.png, throughput_vs_load.png and latency_cdf.png; return paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(labels) if labels else [_label(r, i) for i, r in enumerate(results)]
    return [
        _latency_vs_load(results, names, out / "latency_vs_load.png"),
        _throughput_vs_load(results, names, out / "throughput_vs_load.png"),
        _latency_cdf(results, names, out / "latency_cdf.png"),
    ]


def _label(result: dict[str, Any], i: int) -> str:
    config = result.get("config", {})
    return str(config.get("source") or config.get("model") or f"run {i + 1}")


def _series(
    result: dict[str, Any], metric: str, key: str | None = None
) -> tuple[list[float], list[float]]:
    """(load values, summary[metric][key]) for the levels where both exist."""
    xs, ys = [], []
    for run in result["runs"]:
        x = Load.from_dict(run["load"]).value
        value = run["summary"][metric]
        y = value if key is None else value.get(key)
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _x_label(results: Sequence[dict[str, Any]]) -> str:
    runs = [run for r in results for run in r["runs"]]
    return "concurrency" if runs and "concurrency" in runs[0]["load"] else "request rate (req/s)"


def _latency_vs_load(results: Sequence[dict[str, Any]], names: list[str], path: Path) -> Path:
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for ax, metric, title, slo_key in (
        (axes[0], "ttft_ms", "time to first token", "ttft_ms"),
        (axes[1], "tpot_ms", "time per output token", "tpot_ms"),
    ):
        for i, (result, name) in enumerate(zip(results, names, strict=True)):
            color = f"C{i}"
            for q, style in (("p50", "-o"), ("p99", "--^")):
                xs, ys = _series(result, metric, q)
                ax.plot(xs, ys, style, color=color, label=f"{name} {q}", markersize=4)
        slo = results[0].get("config", {}).get("slo", {}).get(slo_key) if results else None
        if slo is not None:
            ax.axhline(slo, color="grey", linestyle=":", label=f"SLO {slo:g} ms")
        ax.set(title=title, xlabel=_x_label(results), ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _throughput_vs_load(results: Sequence[dict[str, Any]], names: list[str], path: Path) -> Path:
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for i, (result, name) in enumerate(zip(results, names, strict=True)):
        xs, ys = _series(result, "output_throughput")
        axes[0].plot(xs, ys, "-o", color=f"C{i}", label=name, markersize=4)
        xs, ys = _series(result, "request_throughput")
        axes[1].plot(xs, ys, "-o", color=f"C{i}", label=f"{name} completed", markersize=4)
        xs, ys = _series(result, "goodput")
        axes[1].plot(xs, ys, "--^", color=f"C{i}", label=f"{name} within SLO", markersize=4)
    axes[0].set(title="output token throughput", ylabel="tokens/s")
    axes[1].set(title="request throughput and goodput", ylabel="requests/s")
    for ax in axes:
        ax.set_xlabel(_x_label(results))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _latency_cdf(results: Sequence[dict[str, Any]], names: list[str], path: Path) -> Path:
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    styles = ("-", "--", ":", "-.")
    for i, (result, name) in enumerate(zip(results, names, strict=True)):
        for j, run in enumerate(result["runs"]):
            ok = [r for r in run["requests"] if r.get("error") is None]
            label = f"{name} {Load.from_dict(run['load']).label()}"
            for ax, key in ((axes[0], "ttft_s"), (axes[1], "tpot_s")):
                values = sorted(r[key] * 1000 for r in ok if r.get(key) is not None)
                if values:
                    fractions = [(k + 1) / len(values) for k in range(len(values))]
                    ax.step(
                        values, fractions, styles[i % 4], where="post", color=f"C{j}", label=label
                    )
    axes[0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    axes[1].set(title="TPOT CDF", xlabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
