"""Runs a benchmark: warm-up, closed- or open-loop arrivals per load level, sweeps, capacity.

Closed loop: `concurrency` workers each send their next request as soon as the last one ends.
Open loop: requests start on a schedule of gamma-distributed gaps with mean 1/rate (shape =
burstiness; 1.0 is a Poisson process), whether or not earlier ones have finished, optionally
capped at `max_concurrency` in flight. The schedule is absolute (due times add up), so a slow
event loop delays requests but does not lower the rate it catches up to.

A run given a `stop` event ends early once it is set (`servelm bench` sets it on Ctrl-C): no
request is sent after it, those in flight are cancelled, and the result holds the levels run
so far, the one it stopped marked `interrupted` with the requests that had finished.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Protocol

import httpx
from tokenizers import Tokenizer

from servelm.bench.client import (
    Target,
    auth_headers,
    build_payload,
    error_message,
    normalise_base_url,
    send_request,
)
from servelm.bench.config import BenchConfig
from servelm.bench.results import BenchResult, Load, RequestRecord, RunResult, capacity_block
from servelm.bench.server_metrics import MetricsWatcher
from servelm.bench.stats import summarize
from servelm.bench.workload import RequestSpec, Workload, build_workload

Send = Callable[[RequestSpec], Awaitable[RequestRecord]]


class BenchError(Exception):
    """The benchmark could not start (server unreachable, no model, bad workload)."""


class ProgressSink(Protocol):
    """Receives progress events; report.RichProgress draws them as a progress bar."""

    def start_level(self, load: Load, total: int | None) -> None: ...

    def request_done(self, record: RequestRecord) -> None: ...

    def end_level(self) -> None: ...


async def run_benchmark(
    config: BenchConfig,
    *,
    tokenizer: Tokenizer | None = None,
    progress: ProgressSink | None = None,
    stop: asyncio.Event | None = None,
) -> BenchResult:
    """Run every load level of `config` in turn and collect the results.

    `tokenizer` overrides `config.tokenizer` (handy for tests with an in-memory tokenizer).
    `stop`, once set, ends the run early with what has finished (the module's docstring).
    Raises BenchError if the run cannot start; failed requests do not raise.
    """
    try:
        chosen = tokenizer if tokenizer is not None else config.tokenizer
        workload = build_workload(config.workload, config.seed, chosen)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        # only the synthetic prompts load the default model's tokenizer when none was given
        default_tokenizer = chosen is None and config.workload.dataset is None
        hint = " (pass --tokenizer DIR)" if default_tokenizer else ""
        raise BenchError(f"cannot build the workload: {exc}{hint}") from exc
    root, api_url = normalise_base_url(config.base_url)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=config.timeout_s) as client:
        model = config.model or await first_model(client, api_url, config.api_key)
        target = Target(
            api_url=api_url,
            model=model,
            endpoint=config.endpoint,
            api_key=config.api_key,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            timeout_s=config.timeout_s,
        )
        try:  # fail before sending anything if workload and endpoint do not fit
            build_payload(target, workload.request(0, "check"))
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
        watcher = None
        if config.server_metrics:
            headers = auth_headers(config.api_key)
            watcher = MetricsWatcher(client, root + "/metrics", headers, config.metrics_interval_s)
        runs = []
        for level, load in enumerate(config.loads):
            if stop is not None and stop.is_set():
                break
            run = await run_level(
                client, target, workload, config, load, level, watcher, progress, stop
            )
            if run is not None:
                runs.append(run)
    return BenchResult(
        {**config.to_dict(), "model": model},
        runs,
        capacity_block(list(runs), config.capacity_threshold),
    )


async def run_sweep(
    config: BenchConfig,
    loads: Iterable[Load],
    *,
    tokenizer: Tokenizer | None = None,
    progress: ProgressSink | None = None,
) -> BenchResult:
    """`run_benchmark` over the given load levels instead of `config.loads`."""
    swept = replace(config, loads=tuple(loads))
    return await run_benchmark(swept, tokenizer=tokenizer, progress=progress)


async def first_model(client: httpx.AsyncClient, api_url: str, api_key: str | None) -> str:
    """The first model id listed by GET /v1/models."""
    try:
        response = await client.get(api_url + "/models", headers=auth_headers(api_key))
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {api_url}/models: {exc!r}") from exc
    status = response.status_code
    if status in (401, 403):  # --model would not help: every request would be refused too
        said = error_message(response.text)
        hint = (
            "the server refused the API key given (--api-key or $OPENAI_API_KEY)"
            if api_key
            else "the server wants an API key: pass --api-key or set $OPENAI_API_KEY"
        )
        raise BenchError(
            f"GET {api_url}/models: HTTP {status}{f' ({said})' if said else ''}; {hint}"
        )
    if status != 200:
        raise BenchError(f"GET {api_url}/models: HTTP {status}; pass --model")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"GET {api_url}/models listed no model; pass --model") from exc


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    config: BenchConfig,
    load: Load,
    level: int = 0,
    watcher: MetricsWatcher | None = None,
    progress: ProgressSink | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult | None:
    """One load level: warm-up (uncounted), then the measured requests, then the summary.
    None if `stop` was set before a measured request finished."""
    width = load.concurrency or load.max_concurrency or 1
    if config.warmup:
        warm = _Source(workload, f"warmup{level}", config.warmup, None)
        zero = time.perf_counter()
        await until_stopped(
            closed_loop(lambda s: send_request(client, target, s, zero), warm, width), stop
        )
    if stop is not None and stop.is_set():
        return None
    source = _Source(workload, f"level{level}", config.num_requests, config.duration_s)
    if watcher is not None:
        await watcher.start()
    if progress is not None:
        progress.start_level(load, config.num_requests)
    t0 = time.perf_counter()

    records: list[RequestRecord] = []  # as they finish: what a stopped level keeps

    async def send(spec: RequestSpec) -> RequestRecord:
        record = await send_request(client, target, spec, t0)
        records.append(record)
        if progress is not None:
            progress.request_done(record)
        return record

    source.begin(t0)
    if load.concurrency is not None:
        arrivals = closed_loop(send, source, load.concurrency)
    else:
        rng = random.Random(f"{config.seed}/arrivals/{level}")
        arrivals = open_loop(send, source, load, rng)
    interrupted = await until_stopped(arrivals, stop)
    duration = time.perf_counter() - t0
    if progress is not None:
        progress.end_level()
    server = await watcher.stop() if watcher is not None else None
    if interrupted and not records:
        return None
    records.sort(key=lambda r: r.index)
    summary = summarize(records, duration, config.slo)
    return RunResult(load, summary, server, records, interrupted=interrupted)


async def until_stopped(work: Awaitable[object], stop: asyncio.Event | None) -> bool:
    """Await `work`, or until `stop` is set: then cancel it, with the requests it has in
    flight, and return True."""
    if stop is None:
        await work
        return False
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (task, stopped):
            waiting.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    if not task.cancelled():
        task.result()  # the exception it raised, if any
        return False
    return True


class _Source:
    """Hands out the requests of one level until the count or the deadline is reached."""

    def __init__(
        self, workload: Workload, stream: str, limit: int | None, duration_s: float | None
    ) -> None:
        self._workload, self._stream = workload, stream
        self._limit, self._duration_s = limit, duration_s
        # build prompts before the clock starts when we know how many there will be
        self._specs = workload.requests(range(limit), stream) if limit else None
        self._counter = itertools.count()
        self._deadline = math.inf

    def begin(self, now: float) -> None:
        self._deadline = now + self._duration_s if self._duration_s is not None else math.inf

    async def next(self) -> RequestSpec | None:
        if time.perf_counter() >= self._deadline:
            return None
        i = next(self._counter)
        if self._limit is not None and i >= self._limit:
            return None
        if self._specs is not None:
            return self._specs[i]
        # open-ended (--duration only): build on demand, off the event loop's thread
        spec = await asyncio.to_thread(self._workload.request, i, self._stream)
        return spec if time.perf_counter() < self._deadline else None


async def closed_loop(send: Send, source: _Source, concurrency: int) -> list[RequestRecord]:
    """`concurrency` workers, each sending its next request when its last one finishes."""
    records: list[RequestRecord] = []

    async def worker() -> None:
        while (spec := await source.next()) is not None:
            records.append(await send(spec))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def open_loop(
    send: Send, source: _Source, load: Load, rng: random.Random
) -> list[RequestRecord]:
    """Start requests on a gamma-arrival schedule at `load.rate`, never waiting for replies."""
    rate = load.rate if load.rate is not None else math.inf
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def capped(spec: RequestSpec) -> RequestRecord:
        if cap is None:
            return await send(spec)
        async with cap:
            return await send(spec)

    tasks: list[asyncio.Task[RequestRecord]] = []
    due = time.perf_counter()
    try:
        while True:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            spec = await source.next()
            if spec is None:
                break
            tasks.append(asyncio.create_task(capped(spec)))
            due += inter_arrival(rng, rate, load.burstiness)
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:  # cancelled between arrivals: the requests sent go too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def inter_arrival(rng: random.Random, rate: float, burstiness: float = 1.0) -> float:
    """A gap (s) before the next arrival: gamma(shape=burstiness) with mean 1/rate."""
    if math.isinf(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
