"""Per-request grammar state in the engine: matchers that follow output tokens, and the masks.

A request's matcher advances only when the scheduler appends a sampled token to its output
(`GrammarMatcher.accept`), never per step: a preempted request recomputes its tokens without
sampling, so its matcher is already where its output is. A finished or aborted request drops
its matcher (`Request.grammar = None`, by the scheduler); `StructuredOutputs` forgets it at the
next step.

Mask layout: one row of int32 words per constrained request that samples this step; bit j of
word w allows token 32 * w + j (llguidance's own layout).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import numpy as np

from servelm.engine.outputs import GrammarBitmask, SchedulerOutput
from servelm.engine.request import Request
from servelm.structured.compiler import GrammarCompiler

# How the error of a request whose grammar did not compile starts (the API process's check
# compiles without the whole vocabulary's tables, and a grammar too large for them fails only
# here). The engine core ends such a request as its own fault, `ErrorKind.REQUEST`.
GRAMMAR_ERROR = "grammar failed to compile: "


class GrammarMatcher:
    """One request's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by a sampled token. True once nothing but the end can follow (the grammar is
        complete) or the token broke it (`error` says why)."""
        return not self.matcher.consume_token(token) or self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None

    def fill(self, bits: np.ndarray, row: int) -> None:
        """The tokens allowed next, into `bits[row]`."""
        view = bits[row]
        self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)


class StructuredOutputs:
    """The engine's grammar side: compiling requests, live matchers, each step's masks."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(tokenizer_file, vocab_size)
        self.words = (vocab_size + 31) // 32
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.live: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_output
        future = self.compiler.submit(spec, request.eos_token_ids)
        self.compiling[request.request_id] = (request, future)

    def abort(self, request_ids: list[str]) -> list[Request]:
        return [self.compiling.pop(rid)[0] for rid in request_ids if rid in self.compiling]

    def take_compiled(
        self, timeout: float = 0.0
    ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (each with its own matcher now), and those whose
        grammar failed (with why); waits up to `timeout` seconds for a first one."""
        if timeout and self.compiling:
            wait([f for _, f in self.compiling.values()], timeout, FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            exc = future.exception()
            if exc is not None:
                # (one line, without the backtrace a grammar too large for llguidance panics with)
                text = str(exc).split("<backtrace>")[0]
                why = " ".join(line.strip() for line in text.splitlines() if line.strip())
                why = why or repr(exc)
                failed.append((request, GRAMMAR_ERROR + why))
                continue
            request.grammar = GrammarMatcher(future.result().deep_copy())
            self.live[rid] = request
            ready.append(request)
        return ready, failed

    def bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The masks of the constrained requests that sample in this step, or None."""
        live = self.live
        if not live:
            return None
        for rid in [rid for rid, r in live.items() if r.grammar is None]:
            del live[rid]  # finished or aborted since the last step
        rows = [
            r.request_id for r in scheduler_output.requests if r.sample and r.request_id in live
        ]
        if not rows:
            return None
        bits = np.empty((len(rows), self.words), dtype=np.int32)
        for i, rid in enumerate(rows):
            live[rid].grammar.fill(bits, i)
        return GrammarBitmask(rows, bits)

    def shutdown(self) -> None:
        self.compiler.shutdown()
