"""AsyncEngineClient: the API process's handle on the engine-core process.

It starts the process, sends requests and aborts over ZMQ, and runs one background task that
receives step outputs, detokenizes them (OutputProcessor) and hands each request its deltas
through its own asyncio queue. A slow consumer only fills its own queue; it never delays a
step. If the engine process dies, every live request gets `EngineDeadError` at once.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from servelm.config import EngineArgs
from servelm.engine.core_process import run_engine_core
from servelm.engine.dashboard import DashboardSnapshot
from servelm.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    decode,
    encode,
)
from servelm.engine.output_processor import OutputProcessor, TextDelta
from servelm.engine.outputs import SchedulerStats
from servelm.engine.sampling_params import SamplingParams
from servelm.text.tokenizer import TextTokenizer

logger = logging.getLogger("servelm")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be answered."""


class RequestsStopped(RuntimeError):
    """The server ended the request before it finished (its shutdown's grace ran out)."""


class AsyncEngineClient:
    def __init__(self, args: EngineArgs, tokenizer: TextTokenizer, model_dir: str) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.processor = OutputProcessor(tokenizer)
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.stats_listeners: list[Callable[[SchedulerStats], None]] = []
        self.last_stats: SchedulerStats | None = None  # the engine's, after its latest step
        # Called with each dashboard snapshot (sent only after `watch_dashboard`).
        self.dashboard_listeners: list[Callable[[DashboardSnapshot], None]] = []
        self._queues: dict[str, asyncio.Queue[TextDelta | Exception]] = {}
        self._tasks: list[asyncio.Task] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="servelm-")  # unique per server: no fixed names
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._proc: multiprocessing.process.BaseProcess | None = None

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    # -- life cycle -------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the engine process; `wait_ready` then waits for its model to be loaded."""
        in_addr = f"ipc://{self._ipc_dir}/input"
        out_addr = f"ipc://{self._ipc_dir}/output"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        args = EngineArgs(**{**self.args.__dict__, "model": self.model_dir})
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_engine_core,
            name="servelm-engine-core",
            args=(args, in_addr, out_addr, os.getpid(), logging.getLogger().level or logging.INFO),
            daemon=True,
        )
        self._proc.start()

    async def wait_ready(self) -> EngineReady:
        while True:
            if await self._out.poll(200):
                kind, payload = decode(await self._out.recv())
                if kind == "ready":
                    self.ready = payload
                    break
                if kind == "error":
                    raise EngineDeadError(f"engine failed to start: {payload}")
            elif not self._proc.is_alive():
                raise EngineDeadError(
                    f"engine process exited with code {self._proc.exitcode} during start-up"
                )
        self._tasks = [
            asyncio.create_task(self._output_loop()),
            asyncio.create_task(self._watchdog()),
        ]
        return self.ready

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.is_alive():
            try:  # without waiting: an engine that is already exiting reads nothing
                await self._in.send(encode("shutdown"), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await asyncio.to_thread(self._proc.join, 5)
            if self._proc.is_alive():
                self._proc.kill()
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def kill_engine_for_test(self) -> int:
        """The engine's pid (tests kill it to check the failure path)."""
        return self._proc.pid

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Deltas of one request (n == 1) until it finishes; aborts it if the caller stops early."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        queue: asyncio.Queue[TextDelta | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        self.processor.add_request(request_id, params, prompt_token_ids)
        req = EngineCoreRequest(
            request_id,
            prompt_token_ids,
            params,
            self.tokenizer.eos_token_ids,
            arrival_time or time.time(),
            priority,
            cache_salt,
        )
        finished = False
        try:
            await self._in.send(encode("add", req))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.processor.remove(request_id)
            if not finished and self.is_alive:
                logger.debug("request %s abandoned by its consumer: aborting", request_id)
                await self.abort([request_id])

    async def abort(self, request_ids: list[str]) -> None:
        await self._in.send(encode("abort", request_ids))

    async def watch_dashboard(self, interval: float) -> None:
        """Ask the engine for a dashboard snapshot at most every `interval` seconds (0: stop)."""
        if self.is_alive:
            await self._in.send(encode("dashboard", float(interval)))

    # -- background tasks -------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            kind, payload = decode(await self._out.recv())
            if kind == "error":
                self._fail_all(f"engine failed: {payload}")
                continue
            outs: EngineCoreOutputs = payload
            to_abort = []
            for out in outs.outputs:
                queue = self._queues.get(out.request_id)
                if queue is None:
                    continue
                delta = self.processor.process(out)
                if delta is None:
                    continue
                if delta.abort_engine:
                    to_abort.append(out.request_id)
                queue.put_nowait(delta)
            if to_abort:
                await self.abort(to_abort)
            if outs.stats is not None:
                self.last_stats = outs.stats
                for listener in self.stats_listeners:
                    listener(outs.stats)
            if outs.dashboard is not None:
                for listener in self.dashboard_listeners:
                    listener(outs.dashboard)

    async def _watchdog(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(0.2)
        self._fail_all(f"engine process exited with code {self._proc.exitcode}")

    def stop_all(self, reason: str) -> None:
        """Ends every in-flight request with `RequestsStopped(reason)`; each consumer aborts
        its request in the engine as it hears it."""
        if self._queues:
            logger.warning("%s: stopping %d in-flight requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(RequestsStopped(reason))

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        self.dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
