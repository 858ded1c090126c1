"""What each engine step computed, and (in a trace) how long it took.

`compose` sums a scheduled step into the numbers the simulator's step-time model prices:

    per scheduled request   new = len(token_ids), prior = num_computed_tokens
    one new token            -> decode_tokens += 1
    more (a prompt chunk, first or later, or a recompute after preemption)
                             -> prefill_tokens += new
    context read += prior;   attention pairs += new * prior + new * (new + 1) / 2

A one-token prompt chunk counts as a decode: the roofline prices both the same (it only sums
them), so the split matters for token counts in reports, not for time.

`servelm serve --step-trace FILE` appends one JSON line per step of the real engine: its
composition and the wall time of the engine loop's iteration (draining new requests, schedule,
forward, sample, sending the outputs). `servelm simulate --calibrate-trace FILE` fits a device
profile to those lines, so the simulator learns what a step costs inside a loaded server,
where the API process shares the machine with the engine. A trace opens with one
`{"engine": {...}}` line: what the fit must know of the engine's code paths (how many decode
tokens its decode stack takes, `decode_stack_max_tokens`; from how many tokens a step's matmuls
run in float32, `wide_step_min_tokens`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, mul
from pathlib import Path
from typing import IO, Any

from servelm.engine.outputs import ModelRunnerOutput, SchedulerOutput

_TOKEN_IDS = attrgetter("token_ids")
_PRIOR = attrgetter("num_computed_tokens")
_REQUEST_ID = attrgetter("request_id")
_SAMPLE = attrgetter("sample")


@dataclass
class StepComposition:
    """What one step computed; the inputs of the simulator's step-time model."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens_read: int = 0
    attention_pairs: int = 0
    sampled_tokens: int = 0
    num_requests: int = 0


def sampled_request_ids(scheduler_output: SchedulerOutput) -> Iterator[str]:
    """Ids of the requests that sample a token this step (their prompt is complete)."""
    reqs = scheduler_output.requests
    return compress(map(_REQUEST_ID, reqs), map(_SAMPLE, reqs))


def compose(scheduler_output: SchedulerOutput, sampled: int | None = None) -> StepComposition:
    """The step-time inputs of one scheduled step.

    `sampled`: how many requests sample a token this step, if the caller already counted them.
    """
    reqs = scheduler_output.requests
    n = len(reqs)
    # Runs once per simulated step over every scheduled request: C-level map/sum, no Python
    # loop, and no per-request lists in the common all-decode step.
    total_new = sum(map(len, map(_TOKEN_IDS, reqs)))
    context = sum(map(_PRIOR, reqs))
    if total_new == n:  # every request computes one token: pairs = prior + 1 each
        decode, pairs = n, context + n
    else:  # sum of new*prior + new*(new+1)/2, the triangle summed exactly in integers
        news = list(map(len, map(_TOKEN_IDS, reqs)))
        priors = list(map(_PRIOR, reqs))
        decode = news.count(1)
        pairs = sum(map(mul, news, priors)) + (sum(map(mul, news, news)) + total_new) // 2
    if sampled is None:
        sampled = sum(map(_SAMPLE, reqs))
    return StepComposition(total_new - decode, decode, context, pairs, sampled, n)


class StepRecorder:
    """Wraps an executor and keeps the composition of the last step it ran."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last = StepComposition()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last = compose(scheduler_output)
        return self.inner.execute(scheduler_output)


class StepTraceWriter:
    """Appends `{"time", "seconds", <composition>}` lines to a file, one per step, after an
    `{"engine": engine}` line when `engine` is given."""

    def __init__(
        self, path: str | Path, recorder: StepRecorder, engine: dict[str, Any] | None = None
    ) -> None:
        self.recorder = recorder
        self.file: IO[str] = Path(path).open("a", buffering=1)  # line-buffered: survives a kill
        if engine is not None:
            self.file.write(json.dumps({"engine": engine}) + "\n")

    def write(self, seconds: float) -> None:
        line = {"time": round(time.time(), 4), "seconds": round(seconds, 7)}
        self.file.write(json.dumps(line | vars(self.recorder.last)) + "\n")  # flat ints

    def close(self) -> None:
        self.file.close()


def read_step_trace(path: str | Path) -> list[tuple[StepComposition, float]]:
    """(composition, seconds) of every complete step line of a trace written by
    `StepTraceWriter` (engine lines: `read_trace_engine`)."""
    steps = []
    for number, row in _rows(path):
        if isinstance(row, dict) and "engine" in row:
            continue
        try:
            seconds = float(row.pop("seconds"))
            row.pop("time", None)
            steps.append((StepComposition(**row), seconds))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}, line {number}: not a step trace line ({exc})") from exc
    return steps


def read_trace_engine(path: str | Path) -> dict[str, Any]:
    """What the trace's engine line says (a trace appended to by several servers: the
    last), `{}` for a trace without one."""
    engine: dict[str, Any] = {}
    for number, row in _rows(path):
        if isinstance(row, dict) and "engine" in row:
            if not isinstance(row["engine"], dict):
                raise ValueError(f"{path}, line {number}: the engine line is not an object")
            engine = row["engine"]
    return engine


def _rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every complete line; a line cut short by a kill is
    skipped."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError:
            continue
