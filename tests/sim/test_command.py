"""`servelm simulate` end to end: sweep, JSON in the bench schema, plots, profile files."""

import argparse
import json

import pytest

from servelm.bench.results import load_results
from servelm.cli import main
from servelm.config import EngineArgs
from servelm.sim.command import add_arguments, config_from_args
from servelm.sim.config import resolve
from servelm.sim.profiles import ProfileFile, load_profile
from servelm.sim.roofline import measured_profile


def test_sweep_writes_bench_schema_and_plots(tmp_path, capsys):
    out, plots = tmp_path / "sim.json", tmp_path / "plots"
    code = main(
        ["simulate", "--preset", "chat", "--sweep-rate", "2,40", "--num-requests", "150",
         "--max-num-seqs", "16", "--out", str(out), "--plot", str(plots)]
    )  # fmt: skip
    assert code == 0
    data = load_results(out)  # the bench reader accepts it
    assert [run["load"]["rate"] for run in data["runs"]] == [2.0, 40.0]
    low, high = (run["summary"] for run in data["runs"])
    assert low["completed"] == 150 and low["ttft_ms"]["p50"] < high["ttft_ms"]["p50"]
    assert data["capacity"]["load"]["rate"] == 2.0  # 16 sequences at a time cannot take 40/s
    assert data["config"]["model"] == "llama-3.1-8b" and data["config"]["num_blocks"] > 20000
    assert data["runs"][0]["requests"][0]["ttft_s"] > 0
    assert sorted(p.name for p in plots.iterdir()) == [
        "latency_cdf.png", "latency_vs_load.png", "throughput_vs_load.png"
    ]  # fmt: skip
    printed = " ".join(capsys.readouterr().out.split())
    assert "servelm simulate" in printed
    # the table's caption names only the limits that are set
    assert "SLO: TTFT ≤ 1000 ms" in printed and "TPOT ≤ None" not in printed


def test_profile_file_round_trip_and_use(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    profile = measured_profile(60e9, 8e9, step_overhead_s=0.05, per_request_s=0.002)
    ProfileFile(profile, "smollm2-135m", {"note": "made up"}).write(path)
    loaded = load_profile(path)
    assert loaded.profile == profile and loaded.model == "smollm2-135m"
    code = main(["simulate", "--profile", str(path), "--rate", "0.5", "--num-requests", "5",
                 "--output-len", "8", "--input-len", "64"])  # fmt: skip
    assert code == 0
    assert "smollm2-135m" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError):
        load_profile(bad)
    assert main(["simulate", "--profile", str(bad)]) == 2
    bad.write_text("not json at all")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)


def test_bad_arguments_exit_2():
    assert main(["simulate", "--model", "no-such-model", "--rate", "1"]) == 2
    assert main(["simulate", "--gpu", "no-such-gpu", "--rate", "1"]) == 2


def test_scheduler_limits_default_to_what_is_simulated(tmp_path):
    # a measured profile simulates servelm's own engine: serve's defaults (from EngineArgs);
    # a datasheet GPU simulates a GPU deployment: 256 sequences, 2,048 tokens per step, no
    # cap on the prompt tokens admitted
    path = tmp_path / "cpu.json"
    ProfileFile(measured_profile(60e9, 8e9), "smollm2-135m").write(path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def limits(*argv):
        args = parser.parse_args(list(argv))
        profile_model = None
        if args.profile:
            args.loaded_profile = load_profile(args.profile).profile
            profile_model = "smollm2-135m"
        sched = resolve(config_from_args(args, profile_model)).scheduler
        return sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_prefill_admit_tokens

    serve = EngineArgs()
    served = (serve.max_num_seqs, serve.max_num_batched_tokens, serve.prefill_admit_tokens("cpu"))
    assert served[2] > 0  # a cap on the CPU
    assert limits("--profile", str(path)) == served
    assert limits("--profile", str(path), "--max-num-seqs", "8") == (8, *served[1:])
    assert limits("--profile", str(path), "--max-prefill-admit-tokens", "300") == (
        *served[:2],
        300,
    )
    assert limits() == (256, 2048, 0)
    assert limits("--max-num-batched-tokens", "8192") == (256, 8192, 0)
    assert limits("--max-prefill-admit-tokens", "512") == (256, 2048, 512)


def test_tables_keep_every_figure_when_stdout_is_not_a_terminal(tmp_path, capsys):
    # 4 sequences at a time against 50 req/s: TTFTs of minutes, a table wider than 80 columns;
    # rich cut such figures to "663,…" when printing to a file, a pipe or a CI log
    out = tmp_path / "sim.json"
    argv = ["simulate", "--gpu", "l4", "--rate", "50", "--num-requests", "300",
            "--max-num-seqs", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = load_results(out)["runs"][0]["summary"]
    for dist, key in (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("e2e_ms", "p50")):
        assert summary[dist][key] > 100_000
        assert f"{summary[dist][key]:,.0f}" in printed
    assert "…" not in printed and "good" in printed and "req/s" in printed


@pytest.mark.parametrize(
    "flags, message",
    [(["--input-len", "200000"],
      "every request would be refused: This model's maximum context length is 131072 tokens, "
      "but the prompt has 200000 tokens."),
     (["--num-blocks", "1"],
      "the prompt has 500 tokens. The KV pool (1 block of 16 tokens per replica) caps it below "
      "max_model_len 131,072."),
     (["--input-len", "100", "--len-dist", "uniform", "--max-model-len", "50"],
      "maximum context length is 50 tokens, but the prompt has 50 tokens"),
     (["--max-model-len", "999999"], "max_model_len 999999 outside 1..131072 for llama-3.1-8b")],
)  # fmt: skip
@pytest.mark.parametrize("load", [["--rate", "2"], []])  # a level, or a capacity search
def test_a_deployment_that_would_refuse_every_request_is_an_error(flags, message, load, capsys):
    # every level would serve nothing ("0 ok / 20 fail", exit 0, no reason given), and a
    # capacity search would probe rate after rate of refusals; --max-model-len beyond the
    # model's context is refused as `servelm plan` refuses it
    assert main(["simulate", "--num-requests", "20", *load, *flags]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.startswith("servelm simulate: ") and message in printed


def test_requests_the_engine_refuses_are_counted_with_a_reason(capsys):
    # prompts of 450 to 1,350 tokens against a 1,024-token context: some are refused (the
    # server's 400), and the report says how many and why
    argv = ["simulate", "--max-model-len", "1024", "--input-len", "900", "--len-dist", "uniform",
            "--output-len", "10", "--rate", "2", "--num-requests", "20"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if "failed requests by status" in x)
    refused = int(line.rsplit("400: ", 1)[1])
    assert 0 < refused < 20
    assert "e.g. This model's maximum context length is 1024 tokens, but the prompt has" in printed
    # a pool that caps the context below the prompts' length only if it must: 1 block serves
    # prompts of up to 15 tokens
    assert main(["simulate", "--num-blocks", "1", "--input-len", "8", "--output-len", "4",
                 "--rate", "2", "--num-requests", "5"]) == 0  # fmt: skip
