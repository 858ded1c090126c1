"""`benchmarks/workloads.py --peer`: another server, started from its command line, waited for
and measured like servelm's own. The peer here is a `servelm serve` of the tiny model under
another model name, launched from a command line as llama.cpp's server would be."""

from __future__ import annotations

import shlex
import sys

from benchmarks.serve_latency import MODEL_NAME, Server
from benchmarks.workloads import bench, first_answer_s
from servelm.bench import WorkloadSpec


def peer_command() -> str:
    serve = f"{shlex.quote(sys.executable)} -m servelm.cli serve {{model}} --port {{port}}"
    return serve + " --device cpu --kv-cache-memory 8MiB --served-model-name peer-model"


def test_a_peer_is_started_from_its_command_line_measured_and_stopped(tiny_model_dir, tmp_path):
    server = Server(tiny_model_dir, [], tmp_path / "peer.log", peer_command())
    try:
        server.wait_ready(120)  # on GET /v1/models: a peer need not have /health
        # the bench asks the peer for its model: servelm's own name would be a 404 here
        assert server.model_name is None and MODEL_NAME != "peer-model"
        spec = WorkloadSpec(input_len=16, output_len=4)
        run = bench(server, tiny_model_dir, spec, 4, 2, 0)
    finally:
        server.stop()
    assert server.proc.poll() is not None
    # Every request reached the peer under its model's name (a wrong name: 404 for all). A
    # random-weight model's answer may stream no text at all (a lone byte of a multi-byte
    # character), which the bench counts as a stream error; the others have all their tokens.
    done = run.summary["completed"]
    assert done >= 1 and set(run.summary["errors"]) <= {"stream-error"}, run.summary["errors"]
    assert run.summary["output_tokens"] == 4 * done
    assert f"--port {server.port}" in " ".join(server.proc.args)


def test_a_peers_start_up_is_timed_to_its_first_answer(tiny_model_dir, tmp_path):
    seconds = first_answer_s(tiny_model_dir, [], tmp_path / "start.log", 120, peer_command())
    assert 0 < seconds < 120


def test_side_by_side_ratios_bracket_the_peer_with_both_servelm_runs():
    from benchmarks.workloads import side_by_side_ratios

    def r(who, tok_s, ttft, tpot):
        return {"workload": "W2", "server": who, "output_throughput": tok_s,
                "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}}  # fmt: skip

    rows = [r("servelm", 300.0, 100.0, 10.0), r("peer", 100.0, 400.0, 40.0)]
    rows.append(r("servelm", 250.0, 120.0, 12.0))
    ratios = side_by_side_ratios(rows)["W2"]
    assert ratios["out tok/s"] == [2.5, 3.0]
    assert ratios["TTFT p50"] == [0.25, 0.3]
    assert ratios["TPOT p50"] == [0.25, 0.3]


def test_the_vllm_peer_needs_a_venv_and_says_so(tmp_path):
    import pytest

    from benchmarks.peers import peer_command

    assert peer_command("llama-server --port {port}", None) == "llama-server --port {port}"
    with pytest.raises(SystemExit, match="--peer-venv"):
        peer_command("vllm", None)
    with pytest.raises(SystemExit, match="no python"):
        peer_command("vllm", tmp_path)
