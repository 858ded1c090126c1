"""`servelm serve`: start the engine process, then open the port, then serve until told to stop.

Start-up order matters for orchestrators: the port opens only once the engine has loaded the
model and warmed up, so a readiness probe sees "connection refused" until it can answer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time

import uvicorn

from servelm.config import EngineArgs, bounded_int, parse_size, port_number
from servelm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from servelm.server.graceful import KEEP_ALIVE_SECONDS, GracefulServer
from servelm.text.tool_parsers import PARSERS

logger = logging.getLogger("servelm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument(
        "--api-key",
        default=os.environ.get("SERVELM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (env SERVELM_API_KEY)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=bounded_int(0),
        default=256,
        help="sequences (each prompt x n of a request) waiting for a place in the running batch "
        "before new requests get 503",
    )
    g.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies over this size get 413 before they are read (default 8MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish on SIGTERM",
    )
    g.add_argument(
        "--engine-death-grace",
        type=float,
        default=2.0,
        help="seconds to keep answering 503 after the engine dies, then exit 1",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how the model writes tool calls (default: from its chat template; hermes)",
    )
    g.add_argument(
        "--responses-store-size",
        type=bounded_int(0),
        default=1000,
        help="finished Responses API answers kept in memory for previous_response_id and GET "
        "/v1/responses/{id} (the newest; 0 keeps none)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    from servelm.engine.client import AsyncEngineClient, EngineDeadError
    from servelm.store.fetch import resolve_model_dir
    from servelm.text.tokenizer import TextTokenizer

    t0 = time.perf_counter()
    engine_args = EngineArgs.from_cli_args(args)
    model_dir = resolve_model_dir(engine_args)
    logger.info("model folder %s ready in %.2f s", model_dir, time.perf_counter() - t0)
    tokenizer = TextTokenizer(model_dir)
    engine = AsyncEngineClient(engine_args, tokenizer, str(model_dir))
    # SIGTERM or Ctrl-C while the model loads stops the engine and exits 0. As PID 1 in a
    # container a SIGTERM without a handler is dropped: the pod came up anyway, and its
    # deletion waited out the grace period.
    loop = asyncio.get_running_loop()
    loading = asyncio.ensure_future(engine.wait_ready())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, loading.cancel)
    engine.launch()
    # The web stack loads while the engine process loads the model.
    from servelm.server.app import build_app
    from servelm.server.metrics import ServerMetrics
    from servelm.server.serving import ServerState

    try:
        ready = await loading
    except EngineDeadError as exc:  # a bad setting or model: the engine has logged the details
        logger.error("%s", exc)
        await engine.shutdown()
        return 1
    except asyncio.CancelledError:
        logger.info("stopped while the model was loading")
        await engine.shutdown()
        return 0
    except BaseException:
        await engine.shutdown()
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    name = engine_args.served_model_name or model_dir.name
    metrics = ServerMetrics(name, ready.block_size, ready.num_blocks)
    engine.stats_listeners.append(metrics.on_stats)
    # (a pool smaller than the context limits each request: refused or warned at start-up)
    max_len = min(ready.max_model_len, ready.num_blocks * ready.block_size)
    state = ServerState(
        engine,
        metrics,
        name,
        max_len,
        args.max_queued_requests,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        responses_store_size=args.responses_store_size,
    )
    app = build_app(state, args.api_key, args.max_request_bytes)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        access_log=False,
    )
    server = GracefulServer(config)
    server.on_exit_start = app.state.dashboard.close  # open pages must not hold up the drain
    server.on_drain_deadline = lambda: engine.stop_all(
        f"The server is shutting down: --shutdown-timeout {args.shutdown_timeout:g} s passed"
    )
    logger.info(
        "engine ready in %.2f s; serving %s at http://%s:%d/v1",
        time.perf_counter() - t0,
        name,
        args.host,
        args.port,
    )

    async def exit_when_engine_dies() -> None:
        while engine.is_alive:
            await asyncio.sleep(0.2)
        logger.error(
            "engine died (%s); exiting in %.1f s", engine.dead_reason, args.engine_death_grace
        )
        await asyncio.sleep(args.engine_death_grace)
        server.should_exit = True

    watchdog = asyncio.create_task(exit_when_engine_dies())
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        died = engine.dead_reason is not None
        await engine.shutdown()
    return 1 if died else 0
