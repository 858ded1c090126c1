"""uvicorn's server as `servelm serve` and `servelm route` run it: the first SIGTERM / Ctrl-C
starts a graceful drain, a second one (of either) stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("servelm")

DRAIN_MARGIN = 0.5  # seconds before --shutdown-timeout that unfinished requests are ended
# How long an idle keep-alive connection stays open: longer than clients' and load balancers'
# own (httpx 5 s, aiohttp 15 s, cloud balancers 60 s), so the client always closes first. At
# uvicorn's 5 s the server closed a connection just as a client sent its next request on it:
# about 1 request in 400 lost at concurrency 64.
KEEP_ALIVE_SECONDS = 75


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM / Ctrl-C only start a graceful shutdown, and a
    second one (of either) during it stops at once.

    uvicorn re-raises the signal once serving ends, which would kill this process before it
    stops the engine process and before it can exit 0.
    """

    # called when the drain starts: what never ends by itself (a dashboard's feed) ends now
    on_exit_start: Callable[[], None] | None = None
    # called a moment before the drain's timeout cuts what is left
    on_drain_deadline: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # already draining: a second signal means now
            logger.warning("second signal: stopping without waiting for in-flight requests")
            self.force_exit = True
            # what was still running is cancelled, as asked: not a traceback each to the log
            logging.getLogger("uvicorn.error").addFilter(_not_cancelled)
            return
        self.should_exit = True
        if self.on_exit_start is not None:
            self.on_exit_start()
        if self.on_drain_deadline and self.config.timeout_graceful_shutdown is not None:
            # uvicorn cancels what still runs at the timeout, mid-chunk: end it first, with a
            # 503 in-band, so each client hears why and every stream ends with [DONE]
            deadline = max(0.0, self.config.timeout_graceful_shutdown - DRAIN_MARGIN)
            asyncio.get_running_loop().call_later(deadline, self.on_drain_deadline)

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            # Serving is over, but the process still stops its engine and removes its IPC
            # folder: a signal now (a second Ctrl-C) must not kill it halfway through that.
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, logger.info, "already stopping")


def _not_cancelled(record: logging.LogRecord) -> bool:
    """False for uvicorn's report of a task cancelled by a forced stop (a request, the
    lifespan), which it logs as an application error."""
    exc = record.exc_info[1] if record.exc_info else None
    text = record.getMessage()
    return not (isinstance(exc, asyncio.CancelledError) or text.rstrip().endswith("CancelledError"))
