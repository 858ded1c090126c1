"""Terminal report of a benchmark: a live progress bar and summary tables (rich)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from servelm.bench.results import BenchResult, Load, RequestRecord

SUMMARY_COLUMNS = (
    "load", "ok", "fail", "req/s", "tok/s", "TTFT\np50", "TTFT\np99", "TPOT\np50",
    "TPOT\np99", "ITL\np99", "E2E\np50", "good\nreq/s", "SLO\nmet",
)  # fmt: skip
SERVER_COLUMNS = (
    "load", "prefix\nhit rate", "peak\nKV use", "peak\nwaiting", "peak\nrunning",
    "preempt-\nions", "TTFT\np50 ms",
)  # fmt: skip
# The width of a report that does not go to a terminal: wider than any table it prints, so no
# column is cut to fit (a file, a pipe or a CI log has no right edge to fit to).
UNCUT_WIDTH = 1000


def report_console() -> Console:
    """The console `servelm bench` and `servelm simulate` print to. In a terminal rich fits it
    to the window; elsewhere rich assumes 80 columns, and a table wider than that would have
    its figures cut to "136,…" and its headers to "req…", so there it gets UNCUT_WIDTH. Asks
    stdout itself, not rich's is_terminal, which FORCE_COLOR turns on in a CI log."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=UNCUT_WIDTH)


class RichProgress:
    """A progress bar per load level, counting finished and failed requests."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description:>14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("[red]{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=console,
        )
        self._task: TaskID | None = None
        self._failed = 0

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._progress.stop()

    def start_level(self, load: Load, total: int | None) -> None:
        self._failed = 0
        self._task = self._progress.add_task(load.label(), total=total, failed=0)

    def request_done(self, record: RequestRecord) -> None:
        if self._task is None:
            return
        self._failed += 0 if record.ok else 1
        self._progress.update(self._task, advance=1, failed=self._failed)

    def end_level(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[-1]
            self._progress.update(self._task, total=task.completed)
        self._task = None


def _ms(dist: dict[str, Any], key: str) -> str:
    value = dist.get(key)
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 1000 else f"{value:,.{digits}f}"


def _table(title: str, columns: tuple[str, ...]) -> Table:
    """A compact right-aligned table that fits 13 columns in an 80-column terminal."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for name in columns:
        table.add_column(name, justify="right")
    return table


def summary_table(result: BenchResult) -> Table:
    """One row per load level: counts, throughput, latency percentiles (ms), goodput."""
    title = f"servelm bench · {result.config.get('model')} · latencies in ms"
    table = _table(title, SUMMARY_COLUMNS)
    for run in result.runs:
        s = run.summary
        table.add_row(
            run.load.label(),
            str(s["completed"]),
            f"[red]{s['failed']}" if s["failed"] else "0",
            _num(s["request_throughput"]),
            _num(s["output_throughput"], 0),
            _ms(s["ttft_ms"], "p50"),
            _ms(s["ttft_ms"], "p99"),
            _ms(s["tpot_ms"], "p50"),
            _ms(s["tpot_ms"], "p99"),
            _ms(s["itl_ms"], "p99"),
            _ms(s["e2e_ms"], "p50"),
            _num(s["goodput"]),
            f"{s['slo_attainment']:.0%}",
        )
    slo = result.config.get("slo") or {}
    limits = [f"{name} ≤ {slo[key]:g} ms" for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))
              if slo.get(key) is not None]  # fmt: skip
    table.caption = f"SLO: {' and '.join(limits)}" if limits else "no SLO"
    return table


def server_table(result: BenchResult) -> Table | None:
    """Server-side metrics per level, or None if no level scraped any."""
    if not any(run.server for run in result.runs):
        return None
    table = _table("server /metrics, change over each level", SERVER_COLUMNS)
    for run in result.runs:
        m = run.server or {}
        hit = m.get("prefix_cache_hit_rate")
        kv = m.get("peak_kv_cache_usage_perc")
        table.add_row(
            run.load.label(),
            "-" if hit is None else f"{hit:.0%}",
            "-" if kv is None else f"{kv:.0%}",
            _num(m.get("peak_num_requests_waiting"), 0),
            _num(m.get("peak_num_requests_running"), 0),
            _num(m.get("num_preemptions"), 0),
            _ms(m, "ttft_p50_ms"),
        )
    return table


def error_lines(result: BenchResult) -> list[str]:
    """One line per level that had failures: counts by status and a sample message."""
    lines = []
    for run in result.runs:
        errors = run.summary["errors"]
        if not errors:
            continue
        counts = ", ".join(f"{kind}: {n}" for kind, n in errors.items())
        sample = next((r.error_message for r in run.requests if r.error_message), None)
        lines.append(f"{run.load.label()} failed requests by status: {counts}")
        if sample:
            lines.append(f"  e.g. {sample}")
    return lines


def print_report(result: BenchResult, console: Console | None = None) -> None:
    """Print the summary tables, capacity at SLO (for a sweep) and any errors."""
    console = console or report_console()
    console.print(summary_table(result))
    server = server_table(result)
    if server is not None:
        console.print(server)
    if len(result.runs) > 1:
        threshold = result.config.get("capacity_threshold", 0.9)
        cap = result.capacity
        if cap is None:
            console.print(f"capacity at SLO: none (the lowest level met it for < {threshold:.0%})")
        else:
            label = Load.from_dict(cap["load"]).label()
            console.print(
                f"capacity at SLO: [bold]{label}[/] (≥ {threshold:.0%} of requests met the SLO; "
                f"goodput {cap['goodput']:.2f} req/s)"
            )
    for line in error_lines(result):
        console.print(line, style="red", markup=False, highlight=False)
