"""Fitting a DeviceProfile to timed steps: nonnegative least squares on the roofline's terms.

The roofline prices a step as

    t = max(a x FLOPs, b x bytes) + c + d x requests      a = 1/FLOP/s, b = 1/(bytes/s)

which is linear in (a, b, c, d) once each point's bound (compute or memory) is fixed. The fit
alternates: assign each point the bound the current estimate gives it, solve the weighted
nonnegative least squares for (a, b, c, d), repeat until the assignment stops changing. Weights
are 1/t by default, so the error minimised is relative (a 50 ms step matters as much as a 2 s
one: right for a few hand-picked shapes); a server's trace of a thousand steps is fitted on
seconds instead, so that their sum, a simulated run's duration, comes out right.
Starting points: the additive model (a FLOPs + b bytes), all compute-bound, all memory-bound;
the best final fit wins. FLOPs and bytes come from `roofline.step_cost` itself, so the fit and
the simulator can never disagree on what a step costs.

An engine with a decode stack (`decode_stack_max_tokens` > 0), or a float32 path for wide steps
(`wide_step_min_tokens` > 0), runs several code paths with their own costs; the steps of each
are fitted apart, and the profiles of the decode stack and the wide steps nest in the other's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from servelm.engine.step_trace import StepComposition
from servelm.sim.executor import price
from servelm.sim.roofline import DeviceProfile, ModelCost, measured_profile, step_path

_UNIT = measured_profile(1.0, 1.0)  # with unit rates, compute_s = FLOPs and memory_s = bytes
NEVER_BINDS = 1e30  # the rate of a term the fit found never binds
# squared errors closer than this (relative to |y|^2: residuals within 1e-10 of |y|) are a tie
TIE = 1e-20


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: what it computed and how long it took (seconds)."""

    step: StepComposition
    seconds: float
    label: str = ""


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| subject to x >= 0, exactly, by trying every support (few columns).

    Supports that fit equally well (columns the points cannot tell apart, such as the fixed
    and the per-request cost on steps of one request each) differ in error only by rounding,
    and rounding differs with the CPU's BLAS kernels; so a support replaces the best only if
    it fits better by more than `TIE`, and among equals the first with the fewest columns
    wins, whatever the host."""
    cols = a.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(y * y))
    tie = TIE * best_err
    for k in range(1, cols + 1):
        for support in itertools.combinations(range(cols), k):
            sub = a[:, support]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - y) ** 2))
            if err < best_err - tie:
                best_err = err
                best = np.zeros(cols)
                best[list(support)] = x
    return best


def _terms(points: Sequence[TimedStep], cost: ModelCost) -> tuple[np.ndarray, ...]:
    flops, nbytes, reqs, secs = [], [], [], []
    for p in points:
        s = p.step
        c = price(s, _UNIT, cost)
        flops.append(c.flops)
        nbytes.append(c.bytes)
        reqs.append(s.num_requests)
        secs.append(p.seconds)
    return tuple(np.asarray(v, dtype=float) for v in (flops, nbytes, reqs, secs))


def fit_profile(
    points: Sequence[TimedStep],
    cost: ModelCost,
    name: str = "cpu (fitted)",
    relative: bool = True,
    decode_stack_max_tokens: int = 0,
    wide_step_min_tokens: int = 0,
) -> DeviceProfile:
    """The measured profile whose roofline best matches `points`: least squares on relative
    errors (each step counts alike), or with `relative=False` on seconds (each second counts
    alike, so the summed time of many steps comes out right).

    With `decode_stack_max_tokens` > 0 the engine's decode-stack steps (decode-only, at most
    that many tokens) get a profile of their own, fitted to them alone, nested in the profile
    of the other steps; so do the steps of at least `wide_step_min_tokens` tokens when that is
    > 0. Each path needs 4 timed steps, except that wide steps too few for a fit of their own
    (a server's trace of short prompts may have one or two) join the other steps."""
    paths: dict[str, list[TimedStep]] = {"layers": [], "decode stack": [], "wide": []}
    for p in points:
        s = p.step
        paths[
            step_path(
                s.prefill_tokens, s.decode_tokens, decode_stack_max_tokens, wide_step_min_tokens
            )
        ].append(p)
    if len(paths["wide"]) < 4:
        paths["layers"] += paths.pop("wide")
        wide_step_min_tokens = 0
    several = decode_stack_max_tokens > 0 or wide_step_min_tokens > 0
    profile = _fit_one(paths["layers"], cost, name, relative, "other " if several else "")
    if decode_stack_max_tokens > 0:
        stack = _fit_one(
            paths["decode stack"], cost, f"{name}, decode stack", relative, "decode-stack "
        )
        profile = replace(
            profile, decode_stack=stack, decode_stack_max_tokens=decode_stack_max_tokens
        )
    if wide_step_min_tokens > 0:
        wide = _fit_one(paths["wide"], cost, f"{name}, wide steps", relative, "wide ")
        profile = replace(profile, wide_step=wide, wide_step_min_tokens=wide_step_min_tokens)
    return profile


def _fit_one(
    points: Sequence[TimedStep], cost: ModelCost, name: str, relative: bool, kind: str = ""
) -> DeviceProfile:
    if len(points) < 4:
        raise ValueError(f"need at least 4 timed {kind}steps to fit 4 terms, got {len(points)}")
    flops, nbytes, reqs, t = _terms(points, cost)
    w = 1.0 / t if relative else np.full_like(t, 1.0 / np.median(t))
    ones = np.ones_like(t)

    def solve(compute: np.ndarray) -> np.ndarray:
        a = np.column_stack([flops * compute, nbytes * ~compute, ones, reqs]) * w[:, None]
        return nnls(a, t * w)

    def error(x: np.ndarray) -> float:  # what the weighted least squares minimises
        pred = np.maximum(x[0] * flops, x[1] * nbytes) + x[2] + x[3] * reqs
        return float(np.sqrt(np.mean(((pred - t) * w) ** 2)))

    additive = nnls(np.column_stack([flops, nbytes, ones, reqs]) * w[:, None], t * w)
    starts = [additive[0] * flops >= additive[1] * nbytes, np.ones(len(t), bool)]
    starts.append(np.zeros(len(t), bool))
    best, best_err = additive, np.inf
    for compute in starts:
        x = solve(compute)
        for _ in range(50):
            bound = x[0] * flops >= x[1] * nbytes
            if np.array_equal(bound, compute):
                break
            compute = bound
            x = solve(compute)
        err = error(x)
        if err < best_err - 1e-10:  # a relative RMS error: the first start wins a tie
            best, best_err = x, err
    a, b, c, d = (float(v) for v in best)
    return measured_profile(
        flops=1.0 / a if a > 0 else NEVER_BINDS,
        bandwidth=1.0 / b if b > 0 else NEVER_BINDS,
        step_overhead_s=c,
        name=name,
        per_request_s=d,
    )


def predict(profile: DeviceProfile, cost: ModelCost, step: StepComposition) -> float:
    """The simulator's time for a step of this composition."""
    return price(step, profile, cost).total_s


def relative_errors(
    profile: DeviceProfile, cost: ModelCost, points: Sequence[TimedStep]
) -> list[float]:
    """(predicted - measured) / measured for each point."""
    return [(predict(profile, cost, p.step) - p.seconds) / p.seconds for p in points]
