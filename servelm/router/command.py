"""`servelm route`: one OpenAI-compatible address in front of many replicas.

    servelm route --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000 \\
        --policy prefix-aware --port 8080 --admin-key $ADMIN --api-keys-file keys.json
"""

from __future__ import annotations

import argparse
import logging
import os

from servelm.config import parse_size, port_number
from servelm.router.config import RouterConfig
from servelm.router.policies import POLICIES
from servelm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES


def _weight(text: str) -> tuple[str, float]:
    url, sep, value = text.rpartition("=")
    try:
        if not sep or not url:
            raise ValueError
        return url, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected URL=WEIGHT, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas")
    g.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica's base URL (repeat for more)",
    )
    g.add_argument(
        "--weight",
        action="append",
        default=[],
        type=_weight,
        metavar="URL=W",
        help="relative share of traffic for a replica, e.g. a canary at 0.1 (default 1)",
    )
    g.add_argument(
        "--replicas-file", help='file of "URL [WEIGHT]" lines or JSON; re-read when it changes'
    )
    g.add_argument(
        "--upstream-api-key",
        default=os.environ.get("SERVELM_UPSTREAM_API_KEY"),
        help="bearer key the replicas want (env SERVELM_UPSTREAM_API_KEY)",
    )
    g = parser.add_argument_group("routing")
    g.add_argument("--policy", choices=sorted(POLICIES), default="least-loaded")
    g.add_argument(
        "--prefix-block-chars",
        type=int,
        default=128,
        help="prefix-aware: characters per hashed prompt block",
    )
    g.add_argument(
        "--prefix-max-blocks",
        type=int,
        default=64,
        help="prefix-aware: blocks of the prompt that count",
    )
    g.add_argument(
        "--imbalance-abs",
        type=float,
        default=4.0,
        help="prefix-aware: leave the affine replica when it has this many more requests ...",
    )
    g.add_argument(
        "--imbalance-rel",
        type=float,
        default=1.5,
        help="... and this many times as many as the least loaded",
    )
    g.add_argument(
        "--max-waiting-per-replica",
        type=int,
        default=None,
        help="a replica with this many waiting requests takes no more (503 when all do)",
    )
    g.add_argument(
        "--responses-table-size",
        type=int,
        default=100_000,
        help="Responses API ids the router remembers the replica of (the oldest beyond are "
        "looked up by asking the replicas)",
    )
    g = parser.add_argument_group("health")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between probes")
    g.add_argument("--health-timeout", type=float, default=2.0)
    g.add_argument("--failure-threshold", type=int, default=2, help="soft failures before ejection")
    g.add_argument(
        "--eject-cooldown",
        type=float,
        default=2.0,
        help="least seconds an ejected replica stays out",
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=port_number, default=8080)
    g.add_argument(
        "--admin-key",
        default=os.environ.get("SERVELM_ADMIN_KEY"),
        help="enables /admin/* with this bearer key (env SERVELM_ADMIN_KEY)",
    )
    g.add_argument(
        "--api-keys-file", help="JSON API keys with rpm/tpm limits (see servelm.router.ratelimit)"
    )
    g.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies over this size get 413 before they are read (default 8MiB)",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        help="add x-servelm-replica headers and record per-chunk timings",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds open streams may take to finish on SIGTERM",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        replicas=list(args.replica),
        weights=dict(args.weight),
        replicas_file=args.replicas_file,
        policy=args.policy,
        host=args.host,
        port=args.port,
        admin_key=args.admin_key,
        api_keys_file=args.api_keys_file,
        upstream_api_key=args.upstream_api_key,
        max_request_bytes=args.max_request_bytes,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        failure_threshold=args.failure_threshold,
        eject_cooldown_s=args.eject_cooldown,
        max_waiting_per_replica=args.max_waiting_per_replica,
        responses_table_size=args.responses_table_size,
        prefix_block_chars=args.prefix_block_chars,
        prefix_max_blocks=args.prefix_max_blocks,
        imbalance_abs=args.imbalance_abs,
        imbalance_rel=args.imbalance_rel,
        debug=args.debug,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from servelm.router.app import Router, build_app
    from servelm.server.graceful import KEEP_ALIVE_SECONDS, GracefulServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    log = logging.getLogger("servelm.router")
    config = config_from_args(args)
    if not config.replicas and not config.replicas_file and not config.admin_key:
        log.error(
            "no replicas: give --replica URL, --replicas-file F, or --admin-key to add them later"
        )
        return 2
    try:
        router = Router(config)
    except (OSError, ValueError, KeyError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    app = build_app(router)
    log.info(
        "routing %d replicas with %s at http://%s:%d/v1",
        len(router.replicas),
        config.policy,
        config.host,
        config.port,
    )
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=args.shutdown_timeout,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
    )
    server.on_exit_start = app.state.dashboard.close  # open pages must not hold up the drain
    server.run()
    return 0
