"""The terminal report of `servelm bench` (and `servelm simulate`, which prints the same tables)."""

from __future__ import annotations

from servelm.bench.report import print_report
from servelm.bench.results import BenchResult, Load, RequestRecord, RunResult
from servelm.bench.stats import SLO, summarize


def test_tables_keep_every_figure_when_stdout_is_not_a_terminal(capsys) -> None:
    # minutes-long latencies make the 13-column summary wider than 80 columns; in a file, a
    # pipe or a CI log (capsys is none of them a terminal) rich used to cut them to "1,32…"
    records = [
        RequestRecord(i, 0.0, 500, 250, ttft_s=663.525 * (i + 1), e2e_s=1326.373 * (i + 1),
                      itl_s=[0.071] * 249, output_tokens=250, server_prompt_tokens=500)
        for i in range(2)
    ]  # fmt: skip
    slo = SLO(ttft_ms=1000.0, tpot_ms=50.0)
    run = RunResult(Load(rate=50.0), summarize(records, 2652.746, slo), None, records)
    print_report(BenchResult({"model": "m", "slo": slo.to_dict()}, [run]))
    printed = capsys.readouterr().out
    ttft = run.summary["ttft_ms"]
    assert f"{ttft['p50']:,.0f}" in printed and f"{ttft['p99']:,.0f}" in printed
    assert f"{run.summary['e2e_ms']['p50']:,.0f}" in printed
    assert "…" not in printed and "good" in printed and "req/s" in printed
