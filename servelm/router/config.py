"""RouterConfig: every knob of `servelm route`, and FileWatcher for the files it re-reads.

Plain data with defaults that suit a small deployment; `command.py` fills it from flags and the
app, health checker, policies and gateway each read only their own fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from servelm.server.body_limit import DEFAULT_MAX_REQUEST_BYTES


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)  # url -> weight (canary splits)
    replicas_file: str | None = None
    policy: str = "least-loaded"
    host: str = "127.0.0.1"
    port: int = 8080
    admin_key: str | None = None
    api_keys_file: str | None = None
    upstream_api_key: str | None = None  # sent to replicas that were started with --api-key
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies: 413, never read
    # health and circuit breaker
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 2  # soft failures in a row before ejection
    eject_cooldown_s: float = 2.0  # least time out of rotation; doubles for a flapping replica
    max_eject_cooldown_s: float = 30.0
    # proxy
    connect_timeout_s: float = 3.0
    max_waiting_per_replica: int | None = None  # a replica this deep in queue counts as saturated
    # Responses API: response id -> the replica holding it. 100 replicas' default stores
    # (--responses-store-size 1000) at about 200 bytes an entry: some 20 MB. Past it the oldest
    # ids are asked for again (one GET per replica), never lost.
    responses_table_size: int = 100_000
    # prefix-aware policy
    prefix_block_chars: int = 128
    prefix_max_blocks: int = 64
    prefix_table_size: int = 200_000
    imbalance_abs: float = 4.0  # fall back to least-loaded when the affine replica has this many
    imbalance_rel: float = 1.5  # more requests than the least loaded AND this many times as many
    seed: int = 0
    debug: bool = False  # x-servelm-replica header and per-chunk timings at /admin/timings


class FileWatcher:
    """Tells whether a file changed (mtime or size) since the last call; a missing file is "no"."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None

    def changed(self) -> bool:
        try:
            st = self.path.stat()
        except OSError:
            return False
        sig = (st.st_mtime_ns, st.st_size)
        if sig == self._seen:
            return False
        self._seen = sig
        return True
