"""Calibration from a server's step trace: reading it, fitting it, and the latency outside steps."""

import json
from dataclasses import replace

import pytest

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.cli import main
from servelm.engine.outputs import ScheduledRequest, SchedulerOutput
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.step_trace import (
    StepComposition,
    StepRecorder,
    StepTraceWriter,
    read_step_trace,
    read_trace_engine,
)
from servelm.sim.calibrate import (
    calibrate_from_trace,
    fit_api_process,
    fit_frontend_latency,
)
from servelm.sim.config import SimConfig
from servelm.sim.executor import price
from servelm.sim.profiles import load_profile
from servelm.sim.roofline import measured_profile
from servelm.sim.sweep import run_sweep

# A made-up CPU: 400 GFLOP/s, 40 ms per step, 1 ms per request, no memory bound to speak of.
TRUE = measured_profile(4e11, 1e15, step_overhead_s=0.040, per_request_s=0.001)


class _Runner:
    def execute(self, scheduler_output):
        return None


def _scheduled(new: int, prior: int) -> ScheduledRequest:
    ids = list(range(prior + new))
    return ScheduledRequest("r", ids[prior:], prior, [0], SamplingParams(), True, ids, [])


def test_trace_lines_round_trip_and_a_cut_line_is_skipped(tmp_path):
    path = tmp_path / "steps.jsonl"
    recorder = StepRecorder(_Runner())
    writer = StepTraceWriter(path, recorder)
    recorder.execute(SchedulerOutput([_scheduled(100, 0)]))
    writer.write(0.25)
    recorder.execute(SchedulerOutput([_scheduled(1, 100), _scheduled(1, 40)]))
    writer.write(0.05)
    writer.close()
    with path.open("a") as f:
        f.write('{"time": 1, "seconds": 0.1, "prefill_to')  # killed mid-line
    steps = read_step_trace(path)
    assert steps == [
        (StepComposition(100, 0, 0, 100 * 101 // 2, 1, 1), 0.25),
        (StepComposition(0, 2, 140, 142, 2, 2), 0.05),
    ]


def _synthetic_trace(path, cost, steps: list[StepComposition]) -> None:
    with path.open("w") as f:
        for step in steps:
            seconds = price(step, TRUE, cost).total_s
            f.write(json.dumps({"seconds": seconds, **step.__dict__}) + "\n")


def test_fit_to_a_trace_recovers_the_profile_that_priced_it(tmp_path, tiny_model_dir):
    from servelm.planner.shapes import shape_from_folder
    from servelm.sim.roofline import ModelCost

    cost = ModelCost.from_shape(shape_from_folder(tiny_model_dir))
    steps = [StepComposition(n, 0, 0, n * (n + 1) // 2, 1, 1) for n in (64, 256, 1024, 2048)]
    steps += [StepComposition(0, b, b * 200, b * 201, b, b) for b in (1, 2, 4, 8, 16, 32)]
    steps += [StepComposition(300, b, b * 100, 300 * 301 // 2 + b * 101, b, b + 1) for b in (3, 9)]
    _synthetic_trace(tmp_path / "steps.jsonl", cost, steps)
    cal = calibrate_from_trace(tmp_path / "steps.jsonl", str(tiny_model_dir))
    fitted = cal.profile_file.profile
    assert fitted.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.02)
    assert fitted.per_request_s == pytest.approx(TRUE.per_request_s, rel=0.05)
    assert len(cal.held_out) == len(steps) // 4
    assert max(abs(e) for e in cal.held_out_errors) < 0.01
    assert cal.profile_file.model == str(tiny_model_dir)


def test_frontend_latency_is_what_the_real_runs_add_to_the_simulated_ttft():
    # "Real" results: the simulator itself with 35 ms outside the steps; fitting the same
    # deployment without that latency must find the 35 ms again.
    workload = WorkloadSpec.from_preset("chat", input_len=128, output_len=16)
    real_profile = replace(TRUE, frontend_latency_s=0.035)
    real = SimConfig(model="smollm2-135m", profile=real_profile, workload=workload,
                     num_requests=40, seed=3, kv_cache_gb=0.5)  # fmt: skip
    bench = run_sweep(real, [Load(rate=1.0), Load(rate=6.0)]).to_dict()
    found = fit_frontend_latency(real.with_(profile=TRUE, seed=99, num_requests=5), bench)
    assert found == pytest.approx(0.035, abs=1e-6)
    # and the simulator adds it to TTFT and end-to-end latency, not to the steps
    with_it = run_sweep(real, [Load(rate=1.0)]).runs[0].summary
    without = run_sweep(real.with_(profile=TRUE), [Load(rate=1.0)]).runs[0].summary
    assert with_it["ttft_ms"]["p50"] == pytest.approx(without["ttft_ms"]["p50"] + 35)
    assert with_it["tpot_ms"]["p50"] == pytest.approx(without["tpot_ms"]["p50"])


def test_the_api_process_queues_tokens_and_its_costs_are_recovered():
    # "Real" results: the simulator with an API process that spends 2 ms per engine step and
    # 0.5 ms per streamed token, and 20 ms outside the steps; its bench result reports that
    # process's busy time and the steps it handled.
    workload = WorkloadSpec.from_preset("chat", input_len=128, output_len=16)
    api = replace(TRUE, frontend_per_step_s=0.002, frontend_per_token_s=0.0005)
    real = SimConfig(model="smollm2-135m", profile=replace(api, frontend_latency_s=0.02),
                     workload=workload, num_requests=60, seed=3, kv_cache_gb=0.5)  # fmt: skip
    loads = [Load(rate=0.1), Load(rate=3.0), Load(rate=12.0)]  # alone, a few, many at once
    bench = run_sweep(real, loads).to_dict()
    for run in bench["runs"]:
        server = run["server"]
        busy = 0.002 * server["engine_steps"] + 0.0005 * server["generation_tokens"]
        assert server["process_cpu_seconds"] == pytest.approx(busy)
    assert fit_api_process(bench) == pytest.approx((0.002, 0.0005))
    # with the API process's costs known, the latency outside the steps is the rest
    fitted = real.with_(profile=api, seed=99, num_requests=5)
    assert fit_frontend_latency(fitted, bench) == pytest.approx(0.02, abs=1e-6)
    # The queue: a lone request's first token waits for its own step's handling only; under
    # load for every token of its step and the API process's backlog, so the gap grows.
    plain = run_sweep(real.with_(profile=TRUE), loads).runs
    queued = run_sweep(real.with_(profile=api), loads).runs
    gaps = [
        q.summary["ttft_ms"]["p50"] - p.summary["ttft_ms"]["p50"]
        for q, p in zip(queued, plain, strict=True)
    ]
    assert gaps[0] == pytest.approx(2.5, abs=0.05)  # ms: one step, one token
    assert gaps[2] > 3 * gaps[0]
    # without the step counts (a server that does not export them) all of it is per token
    for run in bench["runs"]:
        run["server"]["engine_steps"] = None
    per_step, per_token = fit_api_process(bench)
    assert per_step == 0 and per_token > 0.0005
    # and without the process's CPU time there is nothing to fit
    for run in bench["runs"]:
        run["server"]["process_cpu_seconds"] = None
    assert fit_api_process(bench) is None


def test_cli_fits_a_trace_and_a_bench_run_into_one_profile(tmp_path, tiny_model_dir):
    from servelm.planner.shapes import shape_from_folder
    from servelm.sim.roofline import ModelCost

    cost = ModelCost.from_shape(shape_from_folder(tiny_model_dir))
    steps = [StepComposition(n, 0, 0, n * (n + 1) // 2, 1, 1) for n in (32, 128, 512)]
    steps += [StepComposition(0, b, b * 64, b * 65, b, b) for b in (1, 4, 16, 24, 48)]
    _synthetic_trace(tmp_path / "steps.jsonl", cost, steps)
    workload = WorkloadSpec.from_preset("chat", input_len=64, output_len=8)
    real_profile = replace(
        TRUE, frontend_latency_s=0.02, frontend_per_step_s=0.001, frontend_per_token_s=0.0005
    )
    real = SimConfig(model=str(tiny_model_dir), profile=real_profile,
                     workload=workload, num_requests=20, kv_cache_gb=0.1)  # fmt: skip
    bench = run_sweep(real, [Load(rate=0.2), Load(rate=4.0)]).to_dict()
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "cpu.json"
    code = main(["simulate", "--calibrate-trace", str(tmp_path / "steps.jsonl"),
                 "--calibrate-bench", str(tmp_path / "bench.json"),
                 "--calibrate-model", str(tiny_model_dir), "--kv-cache-gb", "0.1",
                 "--profile-out", str(out)])  # fmt: skip
    assert code == 0
    saved = load_profile(out)
    assert saved.profile.frontend_latency_s == pytest.approx(0.02, abs=1e-3)
    assert saved.profile.frontend_per_step_s == pytest.approx(0.001)
    assert saved.profile.frontend_per_token_s == pytest.approx(0.0005)
    assert saved.profile.step_overhead_s == pytest.approx(0.040, rel=0.02)
    assert saved.fit["steps"] == len(steps)


def test_cli_refuses_what_is_not_a_trace_or_a_bench_result(tmp_path, tiny_model_dir, capsys):
    trace = tmp_path / "steps.jsonl"
    from servelm.planner.shapes import shape_from_folder
    from servelm.sim.roofline import ModelCost

    cost = ModelCost.from_shape(shape_from_folder(tiny_model_dir))
    _synthetic_trace(trace, cost, [StepComposition(0, b, b * 9, b * 10, b, b) for b in range(1, 9)])
    not_bench = tmp_path / "other.json"
    not_bench.write_text('{"runs": []}')
    model = ["--calibrate-model", str(tiny_model_dir), "--profile-out", str(tmp_path / "p.json")]
    cases = [
        (["--calibrate-trace", str(not_bench)], "not a step trace line"),
        (
            ["--calibrate-trace", str(trace), "--calibrate-bench", str(not_bench)],
            "not a `servelm bench",
        ),
        (["--calibrate-bench", str(not_bench)], "needs --calibrate-trace"),
        (["--calibrate-trace", str(tmp_path / "missing.jsonl")], "No such file"),
    ]
    for args, message in cases:
        assert main(["simulate", *args, *model]) == 2
        assert message in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "p.json").exists()


STACK = measured_profile(2e11, 2e10, step_overhead_s=0.006, per_request_s=0.0025)


def test_a_trace_from_an_engine_with_a_decode_stack_fits_both_paths(tmp_path, tiny_model_dir):
    from servelm.planner.shapes import shape_from_folder
    from servelm.sim.roofline import ModelCost

    cost = ModelCost.from_shape(shape_from_folder(tiny_model_dir))
    truth = replace(TRUE, decode_stack=STACK, decode_stack_max_tokens=16)
    steps = [StepComposition(n, 0, 0, n * (n + 1) // 2, 1, 1) for n in (64, 256, 1024, 2048)]
    steps += [StepComposition(0, b, b * 200, b * 201, b, b) for b in range(1, 33)]
    steps += [StepComposition(300, b, b * 100, 300 * 301 // 2 + b * 101, b, b + 1) for b in (3, 9)]
    path = tmp_path / "steps.jsonl"
    with path.open("w") as f:  # what `servelm serve --step-trace` writes: the engine line first
        f.write(json.dumps({"engine": {"decode_stack_max_tokens": 16}}) + "\n")
        for step in steps:
            f.write(json.dumps({"seconds": price(step, truth, cost).total_s, **step.__dict__}))
            f.write("\n")
    assert read_trace_engine(path) == {"decode_stack_max_tokens": 16}
    assert len(read_step_trace(path)) == len(steps)
    cal = calibrate_from_trace(path, str(tiny_model_dir))
    fitted = cal.profile_file.profile
    assert fitted.decode_stack_max_tokens == 16
    assert fitted.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.02)
    for b in (1, 5, 16, 17, 40):  # each path prices its steps (40: beyond the trace)
        step = StepComposition(0, b, b * 200, b * 201, b, b)
        assert price(step, fitted, cost).total_s == pytest.approx(
            price(step, truth, cost).total_s, rel=0.01
        )
    assert max(abs(e) for e in cal.held_out_errors) < 0.01
    # the nested profile survives the JSON file
    cal.profile_file.write(tmp_path / "cpu.json")
    assert load_profile(tmp_path / "cpu.json").profile == fitted
    # traces from engines with different stacks do not make one profile
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"engine": {"decode_stack_max_tokens": 8}}) + "\n")
    with pytest.raises(ValueError, match="different code paths"):
        calibrate_from_trace([path, other], str(tiny_model_dir))


def test_a_trace_from_an_engine_with_float32_wide_steps_fits_them_apart(tmp_path, tiny_model_dir):
    from servelm.planner.shapes import shape_from_folder
    from servelm.sim.roofline import ModelCost

    cost = ModelCost.from_shape(shape_from_folder(tiny_model_dir))
    wide = measured_profile(9e11, 1e15, step_overhead_s=0.080, per_request_s=0.001)
    truth = replace(TRUE, wide_step=wide, wide_step_min_tokens=192)
    steps = [StepComposition(n, 0, 0, n * (n + 1) // 2, 1, 1) for n in range(32, 1100, 48)]
    steps += [StepComposition(0, b, b * 200, b * 201, b, b) for b in range(1, 33)]
    engine = {"decode_stack_max_tokens": 0, "wide_step_min_tokens": 192}
    path = tmp_path / "steps.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"engine": engine}) + "\n")
        for step in steps:
            f.write(json.dumps({"seconds": price(step, truth, cost).total_s, **step.__dict__}))
            f.write("\n")
    cal = calibrate_from_trace(path, str(tiny_model_dir))
    fitted = cal.profile_file.profile
    assert fitted.wide_step_min_tokens == 192 and fitted.decode_stack is None
    # Each wide step is one prompt alone: its fixed and per-request costs (80 + 1 ms) cannot be
    # told apart, and the fixed cost takes both, on every CPU (test_fit.py).
    assert fitted.wide_step.step_overhead_s == pytest.approx(0.081, rel=1e-6)
    assert fitted.wide_step.per_request_s == 0.0
    assert max(abs(e) for e in cal.held_out_errors) < 0.01
    cal.profile_file.write(tmp_path / "cpu.json")
    assert load_profile(tmp_path / "cpu.json").profile == fitted
