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
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
