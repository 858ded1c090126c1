"""Calibration: time the REAL engine on this machine and fit a DeviceProfile to it.

The default model (or any folder) is loaded in-process with `servelm.llm.LLM`; its EngineCore
steps batches built here, and each whole `engine.step()` (schedule + forward + sample + update)
is timed, since that is what the simulator's clock advances by. Shapes:

    prefill   one fresh prompt of N tokens per step           N in 32 .. 1024
    decode    B requests with C-token contexts, one token each B in 1 .. 48, C in 64 .. 256

A short untimed warm-up runs first. Then rounds: each round times every shape once (a decode
shape: the fastest of four steps; a prefill shape: the faster of two, since the first step
after a much larger one pays for the caches that one emptied: docs/performance.md), and each
shape keeps its fastest
time over the rounds, since on a shared machine noise only ever adds time, and spreading a
shape's samples over rounds keeps one burst of noise from spoiling all of them. Shapes
alternate between a fitting set and a held-out set (interleaved in time, so machine noise hits
both alike); the profile is fitted on the first and judged on the second.
A prefill shape's prompts are random ids, so the prefix cache never shortens it; a decode
shape's prompts are the same in every round, so that after the first the cache computes them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.config import EngineArgs
from servelm.engine.core import EngineCore
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.step_trace import (
    StepComposition,
    StepRecorder,
    read_step_trace,
    read_trace_engine,
)
from servelm.planner.shapes import shape_from_folder
from servelm.sim.config import SimConfig, device_profile
from servelm.sim.fit import TimedStep, fit_profile, relative_errors
from servelm.sim.profiles import ProfileFile
from servelm.sim.roofline import ModelCost
from servelm.sim.sweep import run_sweep
from servelm.store.fetch import resolve_model_dir

PATH_KEYS = ("decode_stack_max_tokens", "wide_step_min_tokens")  # fit_profile's path sizes
LISTED_POINTS = 40  # a profile file lists each timed step only up to this many

# (kind, size, context): prefill size = prompt tokens; decode size = batch, context = prompt.
# With several code paths each path gets fitted shapes of its own (4 at least, as a fit needs)
# and held-out ones inside their range. Where the decode stack takes every decode step (batch
# invariant, the default: every CPU), the other path's fit rests on the prefills. With paths by
# row count (`--no-batch-invariant`): on an AVX2-only CPU with x in float32 the prefills of >= 192
# tokens (`wide_step_min_tokens`: float32 matmuls) have a path of their own, and the four shorter
# ones are the other path's; where the stack takes decodes of up to 16 requests (AVX-512 without
# AMX), those of 32-48 join the prefills.
FIT_SHAPES = [
    ("prefill", 64, 0),
    ("decode", 1, 128),
    ("prefill", 1024, 0),
    ("decode", 48, 64),
    ("prefill", 256, 0),
    ("prefill", 768, 0),
    ("decode", 8, 256),
    ("decode", 2, 256),
    ("prefill", 160, 0),
    ("decode", 16, 128),
    ("prefill", 384, 0),
    ("prefill", 32, 0),
    ("prefill", 96, 0),
    ("decode", 40, 128),
    ("decode", 32, 64),
    ("decode", 6, 64),
]
HELD_OUT_SHAPES = [
    ("prefill", 512, 0),
    ("decode", 4, 128),
    ("prefill", 128, 0),
    ("decode", 12, 64),
    ("decode", 24, 96),
    ("decode", 44, 96),
]


@dataclass
class Calibration:
    """What a calibration measured and fitted."""

    profile_file: ProfileFile
    fitted: list[TimedStep] = field(default_factory=list)
    held_out: list[TimedStep] = field(default_factory=list)
    held_out_errors: list[float] = field(default_factory=list)
    seconds: float = 0.0


class _Bench:
    """Builds batches on one engine and times its steps."""

    def __init__(
        self, engine: EngineCore, vocab_size: int, seed: int, clock: str, threads: int
    ) -> None:
        if clock not in ("cpu", "wall"):
            raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
        self.engine = engine
        self.vocab_size = vocab_size
        self.clock = clock
        self.threads = max(1, threads)
        self.wall_s = self.cpu_s = 0.0  # totals over timed steps, for the report
        self.rng = random.Random(seed)
        self.count = 0
        self.recorder = StepRecorder(engine.executor)
        engine.executor = self.recorder

    def _add(self, prompt_len: int, max_tokens: int, rng: random.Random | None = None) -> str:
        self.count += 1
        rid = f"calib-{self.count}"
        ids = [(rng or self.rng).randrange(3, self.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(Request(rid, ids, params))
        return rid

    def _timed_step(self) -> tuple[StepComposition, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        self.engine.step()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        self.wall_s += wall
        self.cpu_s += cpu
        return self.recorder.last, wall if self.clock == "wall" else cpu / self.threads

    def prefill(self, tokens: int, steps: int = 2) -> TimedStep:
        timed = []
        for _ in range(steps):  # each a fresh prompt, which finishes in its prefill step
            self._add(tokens, max_tokens=1)
            timed.append(self._timed_step())
        step, seconds = min(timed, key=lambda t: t[1])
        return TimedStep(step, seconds, f"prefill {tokens}")

    def decode(self, batch: int, context: int, steps: int = 4) -> TimedStep:
        # The same prompts in every round: after the first, the prefix cache computes them
        # (untimed, and on a slow CPU most of a round's time) almost for free.
        rids = [
            self._add(context, 10_000, random.Random(f"{batch} {context} {i}"))
            for i in range(batch)
        ]
        scheduler = self.engine.scheduler
        while scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
        ):
            self.engine.step()  # prefill the batch (untimed)
        timed = [self._timed_step() for _ in range(steps)]
        self.engine.abort_requests(rids)
        step, seconds = min(timed, key=lambda t: t[1])
        return TimedStep(step, seconds, f"decode {batch}x{context}")

    def warm_up(self) -> None:
        """First forwards of a process pay one-off costs; keep them out of every shape."""
        for tokens in (64, 256, 1024):
            self.prefill(tokens)
        self.decode(8, 64)

    def run(self, shape: tuple[str, int, int]) -> TimedStep:
        kind, size, context = shape
        return self.prefill(size) if kind == "prefill" else self.decode(size, context)


def calibrate(
    model: str | None = None,
    budget_s: float = 45.0,
    rounds: int = 4,
    seed: int = 0,
    clock: str = "wall",
    fit_shapes: list[tuple[str, int, int]] | None = None,
    held_out_shapes: list[tuple[str, int, int]] | None = None,
    **engine_kwargs: Any,
) -> Calibration:
    """Load `model` (None: the default model) on this machine's CPU, time steps, fit a profile.

    Every shape is timed once per round (fit and held-out shapes interleaved) and keeps its
    fastest time over the rounds; a new round starts only while `budget_s` (model loading and
    warm-up excluded) has room for one as long as the last. The first round always completes.

    `clock="wall"` (the default) times a step by wall time: what a server's step takes on
    this machine, OpenMP threads waiting for each other included. `clock="cpu"` uses the
    process's CPU time divided by torch's thread count, which leaves out time other jobs hold
    the cores on a shared machine, but also the time torch's threads sleep between parallel
    regions, so it undercounts multi-threaded steps (docs/performance.md).
    """
    import torch

    from servelm.llm import LLM  # torch: only when calibrating

    engine_kwargs.setdefault("device", "cpu")
    llm = LLM(model, **engine_kwargs)
    shape = shape_from_folder(llm.info.model_dir)
    cost = ModelCost.from_shape(shape)
    paths = getattr(llm.engine.executor, "step_paths", {})
    bench = _Bench(llm.engine, shape.vocab_size, seed, clock, torch.get_num_threads())
    bench.warm_up()
    fit_plan = list(fit_shapes or FIT_SHAPES)
    held_plan = list(held_out_shapes or HELD_OUT_SHAPES)
    plan = _interleave(fit_plan, held_plan)
    best: dict[int, TimedStep] = {}
    t0 = time.perf_counter()
    done, last_round = 0, 0.0
    while done < rounds:
        started = time.perf_counter()
        if done and started - t0 + last_round > budget_s:
            break  # another round as long as the last would overrun the budget
        done += 1
        for i, (shape_, _) in enumerate(plan):
            point = bench.run(shape_)
            if i not in best or point.seconds < best[i].seconds:
                best[i] = point
        last_round = time.perf_counter() - started  # the first is the longest (cold cache)
    llm.engine.check_integrity()
    fitted = [best[i] for i, (_, fit) in enumerate(plan) if fit]
    held = [best[i] for i, (_, fit) in enumerate(plan) if not fit]
    report = {"rounds": done, "clock": clock, "torch_threads": bench.threads,
              "timed_wall_s": bench.wall_s, "timed_cpu_s": bench.cpu_s}  # fmt: skip
    name = f"cpu fitted on {shape.name}"
    return _fit(fitted, held, cost, name, str(llm.info.model_dir), report, t0, paths=paths)


def calibrate_from_trace(
    traces: str | Path | Sequence[str | Path], model: str | None = None, hold_out_every: int = 4
) -> Calibration:
    """Fit a profile to the steps a real server traced (`servelm serve --step-trace FILE`).

    Unlike `calibrate`, whose steps run alone in this process, these are the steps of a server
    under load: the API process tokenizing, streaming and detokenizing on the same cores is in
    their time, as it will be when the simulated deployment is served. Every `hold_out_every`-th
    step is held out of the fit and judged. `model` is the served model's folder or name
    (None: the default model); no weights are loaded.
    """
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(EngineArgs(model=model))
    shape = shape_from_folder(model_dir)
    paths = [traces] if isinstance(traces, str | Path) else list(traces)
    steps = [TimedStep(step, s) for path in paths for step, s in read_step_trace(path)]
    engines = {tuple(sorted(_paths(read_trace_engine(path)).items())) for path in paths}
    if len(engines) > 1:
        raise ValueError(
            f"the traces come from engines with different code paths (decode stacks, wide "
            f"steps): {sorted(engines)}"
        )
    held = steps[hold_out_every - 1 :: hold_out_every]
    fitted = [p for i, p in enumerate(steps) if (i + 1) % hold_out_every]
    report = {"traces": [str(p) for p in paths], "steps": len(steps), "clock": "wall (server loop)"}
    cost = ModelCost.from_shape(shape)
    name = f"cpu fitted on {shape.name} (server trace)"
    # Least squares on seconds: a simulated run's time is the sum of its steps, so the many
    # short decode steps and the few long prefills should add up to what was traced.
    return _fit(fitted, held, cost, name, str(model_dir), report, t0, False, dict(engines.pop()))


def _paths(engine: dict[str, Any]) -> dict[str, int]:
    """The code-path sizes an engine line gives (`ModelRunner.step_paths`), 0 for absent ones."""
    return {key: int(engine.get(key, 0)) for key in PATH_KEYS}


def _bench_list(benches: dict[str, Any] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [benches] if isinstance(benches, dict) else list(benches)


def fit_api_process(
    benches: dict[str, Any] | Sequence[dict[str, Any]],
) -> tuple[float, float] | None:
    """The API process's CPU seconds (per engine step, per streamed token), from `servelm bench`
    results: least squares of each level's `process_cpu_seconds` on its `engine_steps` and
    `generation_tokens` (deltas scraped from /metrics), neither below zero. Levels of one
    output length differ in tokens per step, which is what tells the two apart; without
    `engine_steps` (a server that does not count them), or without two levels that differ,
    everything is per token. None when no level has the process's CPU time.

    Each request's own handling (HTTP, tokenizing the prompt) is in that CPU time too, spread
    over what the fit sees: the simulator prices the API process by steps and tokens.
    """
    rows = []
    for bench in _bench_list(benches):
        for run in bench.get("runs", []):
            server = run.get("server") or {}
            cpu, tokens = server.get("process_cpu_seconds"), server.get("generation_tokens")
            if cpu and tokens:
                rows.append((float(server.get("engine_steps") or 0.0), float(tokens), cpu))
    if not rows:
        return None
    steps, tokens, cpu = (np.array(column) for column in zip(*rows, strict=True))
    design = np.stack([steps, tokens], 1)
    if steps.all() and np.linalg.matrix_rank(design) == 2:  # two levels that differ
        (per_step, per_token), *_ = np.linalg.lstsq(design, cpu, rcond=None)
        if per_step >= 0 and per_token >= 0:
            return float(per_step), float(per_token)
        if per_token < 0:  # one cost only: whichever the data allow
            return float(cpu.sum() / steps.sum()), 0.0
    return 0.0, float(cpu.sum() / tokens.sum())


def fit_frontend_latency(
    config: SimConfig, benches: dict[str, Any] | Sequence[dict[str, Any]]
) -> float:
    """What a server adds outside its engine steps, in seconds, from `servelm bench` results.

    `benches` are the bench results (`servelm bench --out`) of the traced runs and `config` the
    deployment as simulated, with the profile fitted to those traces (and its API process's
    costs from `fit_api_process`, if known): each bench level is simulated with the same workload,
    request count and seed, and the answer is the median over levels of real TTFT p50 minus
    simulated TTFT p50 (never below zero). The steps are already priced as traced, so what
    remains is the request's way in and its first token's way out.
    """
    profile = replace(device_profile(config), frontend_latency_s=0.0)
    gaps = []
    for bench in _bench_list(benches):
        try:
            run_cfg = bench["config"]
            level_config = config.with_(
                profile=profile,
                workload=WorkloadSpec(**run_cfg["workload"]),
                num_requests=run_cfg["num_requests"],
                seed=run_cfg["seed"],
                replicas=1,
            )
            loads = [Load.from_dict(run["load"]) for run in bench["runs"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a `servelm bench --out` result (no {exc})") from exc
        simulated = run_sweep(level_config, loads).runs
        for real, sim in zip(bench["runs"], simulated, strict=True):
            real_p50 = (real["summary"].get("ttft_ms") or {}).get("p50")
            sim_p50 = (sim.summary.get("ttft_ms") or {}).get("p50")
            if real_p50 is not None and sim_p50 is not None:
                gaps.append((real_p50 - sim_p50) / 1000)
    if not gaps:
        raise ValueError("the bench results have no level with a TTFT p50")
    return max(0.0, statistics.median(gaps))


def _fit(
    fitted: list[TimedStep],
    held: list[TimedStep],
    cost: ModelCost,
    name: str,
    model_dir: str,
    report: dict[str, Any],
    t0: float,
    relative: bool = True,
    paths: dict[str, int] | None = None,
) -> Calibration:
    profile = fit_profile(fitted, cost, name, relative, **_paths(paths or {}))
    errors = relative_errors(profile, cost, held)
    fit_errors = relative_errors(profile, cost, fitted)
    report = {
        "cost_model": cost.name,
        **report,
        "fit_errors": _spread(fit_errors),
        "held_out_errors": _spread(errors),
        "max_abs_held_out_error": max((abs(e) for e in errors), default=None),
    }
    if len(fitted) + len(held) <= LISTED_POINTS:  # a trace's thousand steps: the spread only
        report["points"] = [_point(p, e) for p, e in zip(fitted, fit_errors, strict=True)]
        report["held_out"] = [_point(p, e) for p, e in zip(held, errors, strict=True)]
    elapsed = time.perf_counter() - t0
    return Calibration(ProfileFile(profile, model_dir, report), fitted, held, errors, elapsed)


def _interleave(
    fit: list[tuple[str, int, int]], held: list[tuple[str, int, int]]
) -> list[tuple[tuple[str, int, int], bool]]:
    """Fit and held-out shapes alternately, so machine noise hits both alike."""
    out: list[tuple[tuple[str, int, int], bool]] = []
    for i in range(max(len(fit), len(held))):
        out += [(fit[i], True)] if i < len(fit) else []
        out += [(held[i], False)] if i < len(held) else []
    return out


def _spread(errors: list[float]) -> dict[str, float] | None:
    """Median and 10th / 90th percentiles of relative errors."""
    if len(errors) < 2:
        return None
    deciles = statistics.quantiles(errors, n=10)
    return {"median": statistics.median(errors), "p10": deciles[0], "p90": deciles[-1]}


def _point(p: TimedStep, error: float) -> dict[str, Any]:
    return {"label": p.label, "measured_s": p.seconds, "error": error, **p.step.__dict__}
