"""Profile fitting: exact NNLS, and recovering a known profile from its own step times, the
same on every CPU (whichever BLAS kernels numpy's OpenBLAS picks for it)."""

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from servelm.engine.step_trace import StepComposition
from servelm.planner.catalog import get_model
from servelm.sim.fit import TimedStep, fit_profile, nnls, predict, relative_errors
from servelm.sim.roofline import ModelCost, measured_profile, pairs_for_request

COST = ModelCost.from_shape(get_model("smollm2-135m"))


def test_nnls_clips_negative_directions():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([2.0, 3.0, 5.0])) == pytest.approx([2.0, 3.0])
    assert nnls(a, np.array([2.0, -3.0, -1.0])) == pytest.approx([0.5, 0.0])


def test_nnls_breaks_a_tie_the_same_way_whatever_the_rounding():
    # Columns 1 and 2 are the same (a fixed and a per-request cost on steps of one request
    # each): every split of 0.5 between them fits, and the errors differ by rounding only,
    # which each CPU's BLAS kernels round their own way. Noise of that size stands in for them.
    x = np.linspace(1.0, 9.0, 12)
    a = np.column_stack([x, np.ones_like(x), np.ones_like(x)])
    rng = np.random.default_rng(0)
    for _ in range(50):
        y = (2 * x + 0.5) * (1 + rng.uniform(-1e-15, 1e-15, len(x)))
        got = nnls(a, y)
        assert got[:2] == pytest.approx([2.0, 0.5], rel=1e-12) and got[2] == 0.0


def steps() -> list[StepComposition]:
    out = [
        StepComposition(n, 0, 0, pairs_for_request(n, 0), 1, 1) for n in (64, 128, 256, 512, 1024)
    ]
    for batch, ctx in ((1, 128), (4, 512), (8, 256), (16, 1024), (32, 256), (64, 2048)):
        out.append(StepComposition(0, batch, batch * ctx, batch * (ctx + 1), batch, batch))
    return out


def test_recovers_a_known_profile():
    truth = measured_profile(80e9, 3e9, step_overhead_s=0.02, per_request_s=0.004)
    points = [TimedStep(s, predict(truth, COST, s)) for s in steps()]
    fitted = fit_profile(points, COST)
    assert max(abs(e) for e in relative_errors(fitted, COST, points)) < 1e-6
    assert fitted.peak_flops == pytest.approx(80e9, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.02, rel=1e-3)


def test_noisy_points_fit_within_noise():
    truth = measured_profile(50e9, 10e9, step_overhead_s=0.3, per_request_s=0.02)
    rng = np.random.default_rng(0)
    points = [
        TimedStep(s, predict(truth, COST, s) * (1 + rng.uniform(-0.05, 0.05))) for s in steps()
    ]
    fitted = fit_profile(points, COST)
    assert max(abs(e) for e in relative_errors(fitted, COST, points)) < 0.12
    with pytest.raises(ValueError):
        fit_profile(points[:3], COST)


def test_two_paths_are_fitted_apart_and_nested():
    # An engine with a decode stack for decode-only steps of <= 16 tokens: two cost curves.
    layers = measured_profile(80e9, 3e9, step_overhead_s=0.02, per_request_s=0.004)
    stack = measured_profile(1e30, 20e9, step_overhead_s=0.003, per_request_s=0.002)
    truth = replace(layers, decode_stack=stack, decode_stack_max_tokens=16)
    points = [TimedStep(s, predict(truth, COST, s)) for s in steps()]
    points += [
        TimedStep(s, predict(truth, COST, s))
        for s in (StepComposition(0, b, b * 300, b * 301, b, b) for b in (2, 6, 12))
    ]
    fitted = fit_profile(points, COST, decode_stack_max_tokens=16)
    assert fitted.decode_stack_max_tokens == 16
    assert fitted.step_overhead_s == pytest.approx(0.02, rel=1e-3)
    assert fitted.decode_stack.step_overhead_s == pytest.approx(0.003, rel=1e-3)
    assert fitted.decode_stack.per_request_s == pytest.approx(0.002, rel=1e-3)
    assert max(abs(e) for e in relative_errors(fitted, COST, points)) < 1e-6
    # one curve through both paths cannot do that
    one = fit_profile(points, COST)
    assert max(abs(e) for e in relative_errors(one, COST, points)) > 0.2
    with pytest.raises(ValueError, match="decode-stack steps"):
        fit_profile(points, COST, decode_stack_max_tokens=1)  # only one step of 1 token


def test_wide_steps_get_a_profile_of_their_own():
    # An AVX2 CPU's engine: from 192 tokens a step dequantizes its weights to float32 (a fixed
    # cost) and multiplies at a higher FLOP rate; one FLOP rate cannot price both sides.
    layers = measured_profile(60e9, 3e9, step_overhead_s=0.02, per_request_s=0.004)
    wide = measured_profile(110e9, 3e9, step_overhead_s=0.09, per_request_s=0.004)
    stack = measured_profile(1e30, 20e9, step_overhead_s=0.003, per_request_s=0.002)
    truth = replace(layers, decode_stack=stack, decode_stack_max_tokens=16)
    truth = replace(truth, wide_step=wide, wide_step_min_tokens=192)
    shapes = steps() + [StepComposition(0, b, b * 300, b * 301, b, b) for b in (2, 6, 12)]
    shapes.append(StepComposition(160, 0, 0, pairs_for_request(160, 0), 1, 1))
    shapes.append(StepComposition(180, 20, 20 * 100, pairs_for_request(180, 0) + 20 * 101, 1, 21))
    points = [TimedStep(s, predict(truth, COST, s)) for s in shapes]
    fitted = fit_profile(points, COST, decode_stack_max_tokens=16, wide_step_min_tokens=192)
    assert (fitted.decode_stack_max_tokens, fitted.wide_step_min_tokens) == (16, 192)
    assert fitted.peak_flops == pytest.approx(60e9, rel=1e-3)
    assert fitted.wide_step.peak_flops == pytest.approx(110e9, rel=1e-3)
    assert fitted.wide_step.step_overhead_s == pytest.approx(0.09, rel=1e-3)
    assert max(abs(e) for e in relative_errors(fitted, COST, points)) < 1e-6
    # the 180 + 20 token step is a wide one: tokens of both kinds count
    assert fitted.profile_for_step(180, 20) is fitted.wide_step
    without = fit_profile(points, COST, decode_stack_max_tokens=16)
    assert max(abs(e) for e in relative_errors(without, COST, points)) > 0.1
    # too few wide steps for a fit of their own (only the 1,024-token one): they join the rest
    merged = fit_profile(points, COST, decode_stack_max_tokens=16, wide_step_min_tokens=1000)
    assert merged.wide_step is None and merged.wide_step_min_tokens == 0


def one_request_wide_steps() -> list[TimedStep]:
    """A server's trace as it often is: each wide step one prompt alone, so that to the fit the
    wide path's fixed and per-request costs are one column."""
    layers = measured_profile(4e11, 1e15, step_overhead_s=0.040, per_request_s=0.001)
    wide = measured_profile(9e11, 1e15, step_overhead_s=0.080, per_request_s=0.001)
    truth = replace(layers, wide_step=wide, wide_step_min_tokens=192)
    shapes = [StepComposition(n, 0, 0, pairs_for_request(n, 0), 1, 1) for n in range(32, 1100, 48)]
    shapes += [StepComposition(0, b, b * 200, b * 201, b, b) for b in range(1, 33)]
    return [TimedStep(s, predict(truth, COST, s)) for s in shapes]


def test_the_fixed_cost_takes_what_the_steps_cannot_tell_apart():
    fitted = fit_profile(one_request_wide_steps(), COST, wide_step_min_tokens=192)
    assert fitted.wide_step.step_overhead_s == pytest.approx(0.081, rel=1e-6)
    assert fitted.wide_step.per_request_s == 0.0
    assert fitted.per_request_s == pytest.approx(0.001, rel=1e-6)  # decodes of 1-32 requests


def synthetic_fits() -> dict[str, float | str | None]:
    """Every field of the profiles fitted to this module's synthetic steps, flattened."""
    layers = measured_profile(60e9, 3e9, step_overhead_s=0.02, per_request_s=0.004)
    stack = measured_profile(1e30, 20e9, step_overhead_s=0.003, per_request_s=0.002)
    truth = replace(layers, decode_stack=stack, decode_stack_max_tokens=16)
    shapes = steps() + [StepComposition(0, b, b * 300, b * 301, b, b) for b in (2, 6, 12)]
    points = [TimedStep(s, predict(truth, COST, s)) for s in shapes]
    rng = np.random.default_rng(0)
    noisy = [TimedStep(p.step, p.seconds * (1 + rng.uniform(-0.05, 0.05))) for p in points]
    fits = {
        "one path": fit_profile(points, COST),
        "two paths": fit_profile(points, COST, decode_stack_max_tokens=16),
        "noisy": fit_profile(noisy, COST, decode_stack_max_tokens=16),
        "one-request wide steps": fit_profile(
            one_request_wide_steps(), COST, wide_step_min_tokens=192
        ),
    }
    flat: dict[str, float | str | None] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        else:
            flat[prefix] = value

    for case, profile in fits.items():
        walk(case, asdict(profile))
    return flat


# OpenBLAS's x86 kernels (OPENBLAS_CORETYPE) and the CPU flags each needs. numpy's OpenBLAS
# picks one by the host's CPU, and they round differently: a tie the fit used to break by
# rounding gave one profile on AVX-512 CPUs and another on AVX2 ones (issue 29).
BLAS_KERNELS = {
    "Nehalem": (),
    "Sandybridge": ("avx",),
    "Haswell": ("avx2", "fma"),
    "SkylakeX": ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "CooperLake": ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"),
    "SapphireRapids": ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                       "avx512_bf16", "amx_tile"),
}  # fmt: skip


def test_fits_are_the_same_on_every_blas_kernel_this_cpu_runs():
    """The fits above, once per OpenBLAS kernel the host can execute (each in a process of its
    own, as the kernel is chosen when the library loads): the same profiles on each, so a fit
    that leans on one CPU's rounding fails here, whichever CPU runs the suite."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("OpenBLAS's x86 kernels: an x86 Linux host only")
    flags = set(cpuinfo.read_text().split())
    code = "import json; from tests.sim.test_fit import synthetic_fits as f; print(json.dumps(f()))"
    root = Path(__file__).resolve().parents[2]
    by_core: dict[str, dict] = {}
    for kernel, needs in BLAS_KERNELS.items():
        if not flags.issuperset(needs):
            continue
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_VERBOSE": "2"}
        run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                             capture_output=True, text=True, check=True)  # fmt: skip
        core = re.search(r"^Core: (\w+)", run.stdout + run.stderr, re.MULTILINE)
        if core is None:
            pytest.skip("numpy's BLAS is not an OpenBLAS that picks its kernels at run time")
        by_core[core.group(1)] = json.loads(run.stdout.splitlines()[-1])
    print("BLAS kernels compared:", ", ".join(by_core))
    assert len(by_core) >= 2
    (first_core, first), *others = by_core.items()
    for core, fits in others:
        for key, value in first.items():
            if isinstance(value, float):
                assert fits[key] == pytest.approx(value, rel=1e-6), (first_core, core, key)
            else:
                assert fits[key] == value, (first_core, core, key)
