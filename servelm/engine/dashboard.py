"""The dashboard's view of the engine: a compact snapshot of the KV pool and the queue.

Built in the engine-core process (where the pool and the queues live) and sent to the API
process with a step's outputs over the existing socket (`EngineCoreOutputs.dashboard`), only
while a dashboard is watching and at most once per `interval` seconds, never once per step:

    API process  --("dashboard", 0.25)-->  engine core   (a page connected; 0.0: none left)
    engine core  --("step", EngineCoreOutputs(..., dashboard=snapshot))-->  API process

The pool is summarised as at most `MAX_CELLS` cells of `blocks_per_cell` consecutive blocks,
so a pool of tens of thousands of blocks costs the same to send and to draw as one of 4,096.
Per cell: blocks in use, shared (held by more than one request: prefix hits), cached (free but
holding a reusable prefix), and the request holding its first block in use. Blocks never
handed out are those from `first_never_used` on: the pool hands out fresh blocks in id order
before any block it got back (block_pool.py's free queue), so they form one tail of ids.

Building one costs about a millisecond per few thousand blocks (benchmarks/dashboard_cost.py);
`Feed` also stretches the interval so that building takes under 0.5 % of the engine's time
whatever the pool size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelm.engine.scheduler import Scheduler
    from servelm.engine.step_trace import StepRecorder

MAX_CELLS = 4096
MAX_WAITING_LISTED = 64  # the queue table lists this many waiting requests (all are counted)
MAX_STEPS = 256  # step records carried by one snapshot (the most recent ones)
# Building a snapshot may take at most this share of the engine's time: the interval between
# two snapshots is at least build time / COST_SHARE.
COST_SHARE = 0.005


@dataclass
class DashboardRequest:
    request_id: str
    state: str  # "running" | "waiting" | "preempted"
    age: float  # seconds since the request arrived
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int  # of prompt + output: below prompt_tokens while a prompt is chunked
    cached_tokens: int  # prompt tokens found in the prefix cache at admission (-1: not yet)
    num_blocks: int
    preemptions: int
    priority: int = 0


@dataclass
class DashboardSnapshot:
    time: float  # wall clock, when it was built
    num_blocks: int
    block_size: int
    blocks_per_cell: int
    blocks_in_use: int
    blocks_shared: int
    blocks_cached: int  # free, with a prefix the cache can still hand out
    first_never_used: int  # block ids from here on were never handed out
    # per cell (len = ceil(num_blocks / blocks_per_cell))
    cell_used: list[int] = field(default_factory=list)
    cell_shared: list[int] = field(default_factory=list)
    cell_cached: list[int] = field(default_factory=list)
    cell_owner: list[int] = field(default_factory=list)  # index into `requests`, -1: none
    requests: list[DashboardRequest] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    # (wall time at the step's end, prompt tokens, decode tokens, seconds) since the last one
    steps: list[tuple[float, int, int, float]] = field(default_factory=list)
    build_seconds: float = 0.0  # what building this snapshot cost the engine


def build_snapshot(
    scheduler: Scheduler, max_cells: int = MAX_CELLS, seen_used: int = 0
) -> DashboardSnapshot:
    """The pool and the queue as they are now (read only: nothing in the scheduler changes).

    `seen_used`: one past the highest block id an earlier snapshot saw in use or cached. The
    free queue's head is the lowest never-used id while fresh blocks are left; a head below
    `seen_used` was used before, so none are left."""
    import numpy as np  # here, not at import: the API process imports this module for the types

    t0 = time.perf_counter()
    now = time.time()
    kv = scheduler.kv
    pool = kv.pool
    n = pool.num_blocks
    requests: list[DashboardRequest] = []
    id_lists = []
    for r in scheduler.running:
        ids = kv.held_block_ids(r.request_id)  # without the places of blocks behind a window
        id_lists.append(ids)
        requests.append(_describe(r, "running", now, len(ids)))
    num_running = len(requests)
    for k, r in enumerate(scheduler.waiting):
        if k >= MAX_WAITING_LISTED:
            break
        state = "preempted" if r.num_preemptions and r.num_computed_tokens == 0 else "waiting"
        requests.append(_describe(r, state, now, 0))

    held = np.fromiter(chain.from_iterable(id_lists), np.int64)
    refs = np.bincount(held, minlength=n) if held.size else np.zeros(n, np.int64)
    used = refs > 0
    shared = refs > 1
    owner = np.full(n, -1, np.int32)
    # The oldest holder of a shared block colours it: later lists are written first.
    for index in range(num_running - 1, -1, -1):
        if id_lists[index]:
            owner[id_lists[index]] = index
    cached = np.zeros(n, bool)
    cached_ids = pool.cached_block_ids()
    if cached_ids:
        cached[cached_ids] = True
    cached &= ~used
    seen = max(
        seen_used,
        int(held.max()) + 1 if held.size else 0,
        max(cached_ids) + 1 if cached_ids else 0,
    )
    head = pool.next_free_block_id()
    first_never_used = n if head is None or head < seen else head

    bpc = max(1, -(-n // max_cells))
    cells = -(-n // bpc)
    pad = cells * bpc - n

    def per_cell(a):
        if bpc == 1:
            return a.astype(np.int32)
        a = np.concatenate([a, np.zeros(pad, a.dtype)]) if pad else a
        return a.reshape(cells, bpc).sum(axis=1, dtype=np.int32)

    if bpc == 1:
        cell_owner = owner
    else:  # the holder of the cell's first block in use
        o = np.concatenate([owner, np.full(pad, -1, np.int32)]) if pad else owner
        o = o.reshape(cells, bpc)
        first = (o >= 0).argmax(axis=1)
        cell_owner = o[np.arange(cells), first]
    return DashboardSnapshot(
        time=now,
        num_blocks=n,
        block_size=kv.block_size,
        blocks_per_cell=bpc,
        blocks_in_use=int(used.sum()),
        blocks_shared=int(shared.sum()),
        blocks_cached=int(cached.sum()),
        first_never_used=first_never_used,
        cell_used=per_cell(used).tolist(),
        cell_shared=per_cell(shared).tolist(),
        cell_cached=per_cell(cached).tolist(),
        cell_owner=cell_owner.tolist(),
        requests=requests,
        num_running=num_running,
        num_waiting=len(scheduler.waiting),
        build_seconds=time.perf_counter() - t0,
    )


def _describe(r, state: str, now: float, num_blocks: int) -> DashboardRequest:
    return DashboardRequest(
        r.request_id,
        state,
        round(now - r.arrival_time, 3),
        len(r.prompt_token_ids),
        len(r.output_token_ids),
        r.num_computed_tokens,
        r.num_cached_tokens,
        num_blocks,
        r.num_preemptions,
        r.priority,
    )


class Feed:
    """The engine-core side of the dashboard: on while the API process says a page watches;
    records each step's composition and time, and builds a snapshot when one is due."""

    def __init__(self) -> None:
        self.interval = 0.0  # 0: nobody watches
        self.pending = False  # a snapshot is owed now, busy or not
        self.next_due = 0.0
        self.seen_used = 0  # see build_snapshot
        self.steps: list[tuple[float, int, int, float]] = []
        self._recorder: StepRecorder | None = None
        self._wrapped = False  # we put the recorder around the executor (and take it off)
        self._last = None  # the composition last recorded (a step without a forward has none)

    @property
    def active(self) -> bool:
        return self.interval > 0

    def set_interval(self, core, interval: float) -> None:
        """Start (interval > 0) or stop watching. Step composition comes from a
        `StepRecorder` around the executor: `--step-trace`'s own where there is one."""
        from servelm.engine.step_trace import StepRecorder

        self.interval = max(0.0, float(interval))
        self.next_due = 0.0  # the first snapshot goes out at once ...
        self.pending = self.active  # ... even while the engine idles
        self.steps = []
        if self.active and self._recorder is None:
            if isinstance(core.executor, StepRecorder):
                self._recorder = core.executor
            else:
                self._recorder = core.executor = StepRecorder(core.executor)
                self._wrapped = True
        elif not self.active and self._recorder is not None:
            if self._wrapped and core.executor is self._recorder:
                core.executor = self._recorder.inner
            self._recorder, self._wrapped = None, False

    def record_step(self, seconds: float) -> None:
        last = self._recorder.last if self._recorder is not None else None
        if last is None or last is self._last or not (last.prefill_tokens or last.decode_tokens):
            return
        self._last = last
        self.steps.append((time.time(), last.prefill_tokens, last.decode_tokens, seconds))
        if len(self.steps) > 2 * MAX_STEPS:
            del self.steps[:-MAX_STEPS]

    def due(self) -> bool:
        return self.active and time.perf_counter() >= self.next_due

    def snapshot(self, core) -> DashboardSnapshot:
        snap = build_snapshot(core.scheduler, seen_used=self.seen_used)
        self.seen_used = snap.first_never_used  # every id below it was handed out
        snap.steps, self.steps = self.steps[-MAX_STEPS:], []
        self.pending = False
        self.next_due = time.perf_counter() + max(self.interval, snap.build_seconds / COST_SHARE)
        return snap
