"""Profile fitting: exact NNLS, and recovering a known profile from its own step times."""

from dataclasses import replace

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
