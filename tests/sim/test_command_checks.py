"""`servelm simulate` refusing, in one line and before it runs, what it could not finish or
write: a capacity search without an SLO, a target rate no replica count meets, an output path
it could not write, numbers out of range."""

import pytest

from servelm.bench.stats import SLO
from servelm.cli import main
from servelm.sim.config import SimConfig
from servelm.sim.sweep import replicas_for_rate, search_capacity

pytestmark = pytest.mark.timeout(120)  # the searches these stop ran for many minutes

SMALL = ["--model", "llama-3.2-1b", "--num-blocks", "200", "--input-len", "100",
         "--output-len", "20", "--num-requests", "10"]  # fmt: skip
NO_SLO = SimConfig(model="llama-3.2-1b", slo=SLO(ttft_ms=None, tpot_ms=None), num_requests=10)


def error_line(capsys) -> str:
    """The one-line error the command ended with (after whatever it printed before)."""
    out = capsys.readouterr().out
    assert "Traceback" not in out
    return out.strip().splitlines()[-1]


def test_a_target_rate_no_replica_count_meets_is_one_line(capsys):
    # 1 ms TTFT: one replica misses it at any rate, so no count of them meets it; the
    # command says so at once instead of simulating 1, 2, ... 64 replicas
    assert main(["simulate", *SMALL, "--target-rate", "2", "--slo-ttft-ms", "1"]) == 2
    line = error_line(capsys)
    assert line.startswith("servelm simulate: one replica misses the SLO even at the lowest")
    assert "no number of replicas meets it at 2 req/s" in line
    with pytest.raises(ValueError, match="even at the lowest rate tried"):
        replicas_for_rate(SimConfig(model="llama-3.2-1b"), 2.0, per_replica=0.0)


@pytest.mark.parametrize(
    "flags",
    [
        ["--slo-ttft-ms", "0"],  # no --rate: a capacity search, the command's default
        ["--slo-ttft-ms", "0", "--slo-tpot-ms", "0", "--find-capacity", "--rate", "1"],
        ["--slo-ttft-ms", "0", "--target-rate", "5"],
    ],
)
def test_a_capacity_search_without_an_slo_is_refused(flags, capsys):
    assert main(["simulate", *SMALL, *flags]) == 2
    assert error_line(capsys) == (
        "servelm simulate: finding capacity needs an SLO: --slo-ttft-ms or --slo-tpot-ms"
    )


def test_the_python_searches_refuse_no_slo_too():
    with pytest.raises(ValueError, match="finding capacity needs an SLO"):
        search_capacity(NO_SLO)
    with pytest.raises(ValueError, match="finding capacity needs an SLO"):
        replicas_for_rate(NO_SLO, 5.0)


def test_a_sweep_needs_no_slo(capsys):
    assert main(["simulate", *SMALL, "--slo-ttft-ms", "0", "--rate", "1"]) == 0


def test_outputs_it_could_not_write_are_refused_before_the_run(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for flags, says in (
        (["--rate", "1", "--out", str(a_file / "x.json")], f"{a_file} is a file, not a folder"),
        (["--rate", "1", "--out", str(tmp_path)], "is a folder; give the name of a file"),
        (["--rate", "1", "--plot", str(a_file)], "is a file; give a folder to write the plots"),
        # --out writes levels: a capacity search alone has none (it was quietly not written)
        (["--target-rate", "5", "--out", str(tmp_path / "x.json")], "a capacity search alone"),
    ):
        assert main(["simulate", *SMALL, *flags]) == 2
        out = capsys.readouterr().out
        assert "KV blocks" not in out  # said before the deployment was even resolved
        assert "Traceback" not in out and says in out, out
    # a folder missing on the way is made
    out = tmp_path / "new" / "folder" / "sim.json"
    assert main(["simulate", *SMALL, "--rate", "1", "--out", str(out)]) == 0
    assert out.is_file()


def test_profile_out_is_checked_before_calibrating(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    argv = ["simulate", "--calibrate", "--profile-out", str(a_file / "cpu.json")]
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "calibrating" not in out and f"--profile-out {a_file / 'cpu.json'}" in out


def test_the_calibration_message_does_not_promise_a_bound(tmp_path, capsys):
    # --calibrate-seconds bounds the rounds after the first, which always completes; the
    # message is printed before the model loads (here: fails to, quickly)
    argv = ["simulate", "--calibrate", "--calibrate-seconds", "5", "--calibrate-model",
            str(tmp_path / "no-model"), "--profile-out", str(tmp_path / "cpu.json")]  # fmt: skip
    assert main(argv) == 2
    said = capsys.readouterr().out
    assert "the first round always completes" in said and "up to 5 s" not in said


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--per-request-us", "-5", "not a number >= 0: '-5'"),
        ("--kv-cache-gb", "-1", "not a number > 0: '-1'"),
        ("--kv-cache-gb", "0", "not a number > 0: '0'"),
        ("--block-size", "0", "not an integer >= 1: '0'"),
        ("--slo-threshold", "2", "not a number in (0, 1]: '2'"),
        ("--slo-threshold", "0", "not a number in (0, 1]: '0'"),
        ("--slo-ttft-ms", "-1", "not a number >= 0: '-1'"),
        ("--target-rate", "0", "not a number > 0: '0'"),
        ("--replicas", "0", "not an integer >= 1: '0'"),
        ("--gpu-memory-utilization", "1.5", "not a number in (0, 1]: '1.5'"),
        ("--allowance-gb", "-2", "not a number >= 0: '-2'"),
        ("--calibrate-seconds", "0", "not a number > 0: '0'"),
    ],
)
def test_numbers_out_of_range_are_usage_errors_naming_the_flag(flag, value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--rate", "1", flag, value])
    assert exit_.value.code == 2
    assert f"servelm simulate: error: argument {flag}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"per_request_s": -5e-6}, "per_request_s must be >= 0"),
        ({"kv_cache_gb": -1.0}, "kv_cache_gb must be > 0"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"capacity_threshold": 2.0}, r"capacity_threshold is a share of requests, in \(0, 1\]"),
    ],
)
def test_a_sim_config_refuses_them_too(changes, says):
    with pytest.raises(ValueError, match=says):
        SimConfig(**changes)
