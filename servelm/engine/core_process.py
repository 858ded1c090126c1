"""The engine-core process: owns the EngineCore and runs its step loop next to two sockets.

    API process  --PUSH-->  [input socket]   engine core   [output socket]  --PUSH-->  API process

It never waits on a client: between steps it drains whatever arrived (new requests, aborts)
without blocking, and only blocks on the input socket when it has nothing to run. Aborts
therefore take effect within one step.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time

import zmq

from servelm.config import EngineArgs
from servelm.engine.dashboard import Feed
from servelm.engine.messages import EngineCoreOutputs, EngineReady, decode, encode
from servelm.engine.request import Request
from servelm.engine.step_trace import StepRecorder, StepTraceWriter

logger = logging.getLogger("servelm.engine")


# How long an idle OpenMP thread spins before it sleeps (libgomp's default is 300,000).
OPENMP_SPIN_COUNT = 30_000


def bound_openmp_spin() -> None:
    """Bound OpenMP's busy-waiting before torch loads libgomp (it reads the setting once).

    Between two parallel regions libgomp's threads spin. When anything else wants a core (the
    API process streaming tokens, a second server, a test runner), a spinning thread holds the
    core while the thread it waits for is descheduled, and a step can take many times as long
    (docs/performance.md). A short spin keeps most of the benefit of spinning
    on a quiet machine. An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone. The
    offline `LLM` calls it too, in its constructor before torch loads, for the same reason.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def hold_group_signals(api_pid: int) -> None:
    """Ctrl-C in a terminal, `kill -TERM -PGID` and systemd's control-group kill signal every
    process of the server, this one too. The API process answers them by draining its in-flight
    requests and then stopping this process; dying here at once would cut those requests. So
    SIGINT is ignored, and SIGTERM too while the API process lives (once it is gone, SIGTERM
    ends this process as usual)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum, frame) -> None:
        if os.getppid() != api_pid:
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)


def run_engine_core(
    args: EngineArgs,
    input_addr: str,
    output_addr: str,
    api_pid: int,
    log_level: int = logging.INFO,
) -> None:
    """Process entry point. Builds the engine (loads the model) and serves until shutdown, or
    until the API process `api_pid`, which started it, is gone. It is named by the API process,
    not read here: a parent killed before this process read it (loading the model, or in the
    moment after "ready") would leave init's pid as the "parent", and the engine running for
    good."""
    hold_group_signals(api_pid)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
    trace, ready = None, False
    try:
        bound_openmp_spin()
        from servelm.worker.executor import create_engine_core  # torch lives past this line

        t0 = time.perf_counter()
        core, info = create_engine_core(args)
        if args.step_trace:  # opened before "ready": a bad path fails the start, not a step
            paths = getattr(core.executor, "step_paths", {})
            core.executor = recorder = StepRecorder(core.executor)
            trace = StepTraceWriter(args.step_trace, recorder, paths)
        outputs.send(
            encode(
                "ready",
                EngineReady(
                    str(info.model_dir),
                    info.max_model_len,
                    info.num_blocks,
                    info.block_size,
                    info.device,
                    info.dtype,
                    time.perf_counter() - t0,
                ),
            )
        )
        ready = True
        # Everything allocated so far (model, tokenizer tables) lives as long as the process:
        # keep it out of the garbage collector's generations so collections stay short. After
        # "ready": the collection (0.1 s here) overlaps the API process opening its port.
        gc.collect()
        gc.freeze()
        _loop(core, inputs, outputs, api_pid, trace)
    except Exception as exc:  # report, then die: the API process turns this into errors + 503
        if isinstance(exc, ValueError) and not ready:
            # a setting or model refused at start-up: the API process says so in one line
            logger.debug("engine core refused to start", exc_info=True)
        else:
            logger.exception("engine core failed")
        outputs.send(encode("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    finally:
        if trace is not None:
            trace.close()
        outputs.close(linger=1000 if os.getppid() == api_pid else 0)  # 0: no one to read
        inputs.close(linger=0)
        ctx.term()


def _loop(
    core,
    inputs: zmq.Socket,
    outputs: zmq.Socket,
    api_pid: int,
    trace: StepTraceWriter | None = None,
) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    feed = Feed()  # the dashboard's snapshots: built only while one watches (dashboard.py)
    while True:
        if os.getppid() != api_pid:  # the API process is gone (even SIGKILLed): do not linger
            logger.warning("API process exited; engine core shutting down")
            return
        busy = core.has_unfinished_requests()
        # Block only when idle; otherwise just drain what is already there.
        events = dict(poller.poll(timeout=0 if busy else 1000))
        t0 = time.perf_counter()  # a traced step is timed from here: draining inputs is part of it
        aborted = []
        changed = False
        while inputs in events or inputs.poll(0):
            events = {}
            kind, payload = decode(inputs.recv())
            if kind == "add":
                aborted += _add(core, payload)
            elif kind == "abort":
                aborted += core.abort_requests(payload)
            elif kind == "shutdown":
                return
            elif kind == "dashboard":
                feed.set_interval(core, payload)
                continue  # not a change the gauges need to hear of
            changed = True
        if core.has_unfinished_requests():
            step_outputs, stats = core.step()
            # The last step before idling always carries one: the page shows the queue empty.
            snap = (
                feed.snapshot(core)
                if feed.due() or (feed.active and not core.has_unfinished_requests())
                else None
            )
            outputs.send(encode("step", EngineCoreOutputs(aborted + step_outputs, stats, snap)))
            if trace is not None or feed.active:
                seconds = time.perf_counter() - t0
                if trace is not None:
                    trace.write(seconds)
                feed.record_step(seconds)
        elif changed:
            # Idle after aborts: report it, so gauges (running, KV usage) drop at once.
            snap = feed.snapshot(core) if feed.active else None
            stats = core.scheduler.make_stats()
            outputs.send(encode("step", EngineCoreOutputs(aborted, stats, snap)))
            core.check_integrity()
        elif feed.pending:  # idle, and a page just connected: a snapshot with no stats
            outputs.send(encode("step", EngineCoreOutputs([], None, feed.snapshot(core))))


def _add(core, req) -> list:
    from servelm.engine.outputs import EngineCoreOutput, ErrorKind

    request = Request(
        req.request_id,
        req.prompt_token_ids,
        req.sampling_params,
        frozenset(req.eos_token_ids),
        req.arrival_time,
        req.priority,
        req.cache_salt,
    )
    try:
        core.add_request(request)
    except ValueError as exc:  # validated in the API process already; never crash the loop
        out = EngineCoreOutput(req.request_id, [], finish_reason="error", error=str(exc))
        out.error_kind = ErrorKind.REQUEST  # (see EngineCore.add_request)
        return [out]
    return []
