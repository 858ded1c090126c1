"""Waiting for a server launched as a subprocess (`servelm serve`, `servelm route`) to answer:
what the benchmarks and the live-server tests do before they send it anything."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    timeout_s: float,
    interval_s: float = 0.2,
    log: Callable[[], str] = str,
) -> None:
    """GET `url` every `interval_s` until it answers 200. RuntimeError, with what `log()` says,
    if `proc` exits first or `timeout_s` passes. One client throughout: `httpx.get` makes a
    client (and an SSL context) per call, CPU that a starting server on a small machine would
    lose to the poller (docs/performance.md)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: the server exited with {proc.returncode}:\n{log()}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval_s)
    raise RuntimeError(f"{url}: no answer after {timeout_s:.0f} s:\n{log()}")
