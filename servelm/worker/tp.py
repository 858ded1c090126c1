"""Tensor parallelism across processes: one model over N ranks, driven as one executor.

    engine core (rank 0)                      rank 1 .. N-1 (processes it starts)
    scheduler -> TPRunner.execute(so)  --so-->  ModelRunner.execute(so)   (a pipe each)
                 ModelRunner.execute(so)  <== all-reduce / all-gather ==>  (gloo or NCCL)
                 samples; waits for each rank's "done"

Rank 0's scheduler is the only scheduler. Each step's `SchedulerOutput` goes down every rank's
pipe, every rank runs its share of the layers (`model/parallel.py`), the collectives keep them
in step, and rank 0 samples from the gathered logits. Commands travel on plain pipes rather
than as collectives because a collective has a timeout and an idle server waits for its next
request indefinitely.

The ranks meet at a TCPStore that rank 0 opens on loopback at a port the OS picks. A rank that
dies takes the engine down: its pipe or a collective fails the step in progress, and a
watchdog interrupts rank 0's main thread when it happens between steps; the engine-core process
then reports the error and exits non-zero, and the API process fails every in-flight request
and turns /health to 503. Ranks die with rank 0 (the kernel's parent-death signal), so none is
left behind.
"""

from __future__ import annotations

import _thread
import ctypes
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from servelm.model.config import ModelSpec
from servelm.model.parallel import process_group
from servelm.worker.shm_allreduce import ShmAllReduce
from servelm.worker.shm_allreduce import usable as shm_usable

logger = logging.getLogger("servelm")

# A collective that waits this long for a rank has lost it (a dead rank usually fails the
# collective at once: its sockets close).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# ModelRunner methods every rank runs together (they run the model or size its cache); their
# results come back from every rank.
COLLECTIVE_CALLS = ("execute", "profile_num_blocks", "allocate_kv_cache", "warm_up")


class RankFailed(RuntimeError):
    """A tensor-parallel rank failed or exited; the engine cannot go on."""


@dataclass
class RankInfo:
    """What one rank holds once loaded, for the start-up log and the tests."""

    rank: int
    weight_bytes: int
    bytes_read: int  # of the checkpoint, by this rank
    rss_bytes: int
    int4_layers: int  # projections served from 4-bit copies of this rank's slices

    def line(self) -> str:
        return (
            f"rank {self.rank}: {self.weight_bytes / 2**20:.1f} MiB of weights, "
            f"{self.bytes_read / 2**20:.1f} MiB read from the checkpoint, "
            f"{self.rss_bytes / 2**20:.0f} MiB resident"
        )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _backend(device: str) -> str:
    cuda = (
        device == "cuda"
        or device.startswith("cuda:")
        or (device == "auto" and torch.cuda.is_available())
    )
    return "nccl" if cuda else "gloo"


class TPRunner:
    """Stands where a ModelRunner stands (the engine core's executor) and runs N ranks."""

    def __init__(self, model_dir: Path, spec: ModelSpec, size: int, **runner_kwargs: Any) -> None:
        from servelm.worker.model_runner import ModelRunner

        self.size = size
        cores = runner_kwargs.pop("num_threads", None) or os.cpu_count() or 1
        # The cores are shared between the ranks: each rank's matmuls take its share.
        runner_kwargs["num_threads"] = max(1, cores // size)
        backend = _backend(runner_kwargs.get("device", "auto"))
        store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
        )
        self._store = store  # (the ranks meet here: kept as long as they run)
        self.address = f"{backend} via 127.0.0.1:{store.port}"
        shm = ShmAllReduce(0, size) if backend == "gloo" and shm_usable(size) else None
        if shm is not None:
            self.address += ", all-reduces through shared memory"
        self.workers: list[_Worker] = []
        self.failed: str | None = None
        # Stops the ranks when this runner is shut down or collected; nothing that outlives
        # it (the watchdog threads, the signal handler) holds it, so dropping an engine is
        # enough to end its ranks.
        self._stopping = threading.Event()
        self.shutdown = weakref.finalize(self, _stop_ranks, self.workers, self._stopping)
        try:
            for rank in range(1, size):
                setup = {
                    "rank": rank,
                    "size": size,
                    "port": store.port,
                    "backend": backend,
                    "model_dir": str(model_dir),
                    "spec": spec,
                    "kwargs": runner_kwargs,
                    "shm": shm.path if shm is not None else None,
                    "log_level": logging.getLogger().level or logging.INFO,
                }
                self.workers.append(_Worker.start(setup))
            for worker in self.workers:  # each says it is about to join (or dies first)
                worker.reply()
            if shm is not None:
                shm.unlink()  # every rank has it mapped
            if backend == "nccl":
                torch.cuda.set_device(0)
            group = process_group(backend, store, 0, size, COLLECTIVE_TIMEOUT, shm)
            self.runner = ModelRunner(model_dir, spec, tp=group, **runner_kwargs)
            self.ranks = [self._info(self.runner, 0)] + [w.reply() for w in self.workers]
        except BaseException:
            if shm is not None:
                shm.unlink()
            self.shutdown()
            raise
        self._watch()

    # -- the ModelRunner interface --------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # everything that only reads rank 0's state (timings, kernel summary, step paths)
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def execute(self, so):
        return self._call("execute", so)[0]

    def profile_num_blocks(self, *args) -> int:
        return min(self._call("profile_num_blocks", *args))  # every rank must fit its cache

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def warm_up(self, *args) -> None:
        self._call("warm_up", *args)

    def _call(self, name: str, *args) -> list:
        """Run runner method `name` on every rank at once; each rank's result, rank 0 first."""
        if self.failed:
            raise RankFailed(self.failed)
        for worker in self.workers:
            worker.send((name, args))
        try:
            results = [getattr(self.runner, name)(*args)]
        except Exception as exc:  # a collective failed: name the rank that left, if one did
            raise RankFailed(self._who_failed() or f"rank 0: {type(exc).__name__}: {exc}") from exc
        results += [worker.reply() for worker in self.workers]
        return results

    def _who_failed(self) -> str | None:
        for worker in self.workers:
            code = worker.proc.poll()
            if code is not None:
                return f"tensor-parallel rank {worker.rank} exited with code {code}"
        return None

    @staticmethod
    def _info(runner, rank: int) -> RankInfo:
        model = runner.model
        return RankInfo(
            rank, runner.weight_bytes, model.bytes_read or 0, rss_bytes(), model.int4_layers
        )

    def log_ranks(self) -> None:
        logger.info(
            "tensor parallel: %d ranks, %s; %s",
            self.size,
            self.address,
            "; ".join(r.line() for r in self.ranks),
        )

    # -- failure and shutdown -------------------------------------------------------------
    def _watch(self) -> None:
        """A rank that exits while rank 0 waits for requests: stop the engine now, not at the
        next step. SIGUSR1 reaches the main thread's handler, which raises RankFailed there."""
        if threading.current_thread() is not threading.main_thread():
            return  # no signal handler off the main thread: the next step reports it
        me = weakref.ref(self)

        def on_signal(signum, frame) -> None:
            runner = me()
            if runner is not None and runner.failed:
                raise RankFailed(runner.failed)

        signal.signal(signal.SIGUSR1, on_signal)
        for worker in self.workers:
            threading.Thread(
                target=_wait_for,
                args=(me, worker, self._stopping),
                name=f"tp-rank-{worker.rank}",
                daemon=True,
            ).start()


def _wait_for(runner_ref, worker: _Worker, stopping: threading.Event) -> None:
    code = worker.proc.wait()
    runner = runner_ref()
    if stopping.is_set() or runner is None or runner.failed:
        return
    runner.failed = f"tensor-parallel rank {worker.rank} exited with code {code}"
    logger.error("%s; stopping the engine", runner.failed)
    del runner
    _thread.interrupt_main(signal.SIGUSR1)


def _stop_ranks(workers: list[_Worker], stopping: threading.Event) -> None:
    stopping.set()
    for worker in workers:
        worker.stop()


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    conn: Connection

    @classmethod
    def start(cls, setup: dict) -> _Worker:
        ours, theirs = multiprocessing.Pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "servelm.worker.tp", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        ours.send(setup)
        return cls(setup["rank"], proc, ours)

    def send(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError as exc:
            raise RankFailed(self._gone()) from exc

    def reply(self):
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailed(self._gone()) from exc
        if status == "error":
            raise RankFailed(f"tensor-parallel rank {self.rank}: {value}")
        return value

    def _gone(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "none yet"
        return f"tensor-parallel rank {self.rank} exited with code {code}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send(("stop", ()))
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()


def _die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent (rank 0) dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)


def _rank_main(fd: int) -> None:
    """A rank other than 0: load its share, then run what rank 0 sends until told to stop."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    conn = Connection(fd)
    setup = conn.recv()
    rank, size = setup["rank"], setup["size"]
    logging.basicConfig(
        level=setup["log_level"],
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
    )
    from servelm.engine.core_process import bound_openmp_spin

    bound_openmp_spin()
    try:
        from servelm.worker.model_runner import ModelRunner

        store = dist.TCPStore(
            "127.0.0.1", setup["port"], size, is_master=False, timeout=COLLECTIVE_TIMEOUT
        )
        if setup["backend"] == "nccl":
            torch.cuda.set_device(rank)
        shm = ShmAllReduce(rank, size, setup["shm"]) if setup["shm"] else None
        conn.send(("ok", "joining"))
        group = process_group(setup["backend"], store, rank, size, COLLECTIVE_TIMEOUT, shm)
        runner = ModelRunner(setup["model_dir"], setup["spec"], tp=group, **setup["kwargs"])
        conn.send(("ok", TPRunner._info(runner, rank)))
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if name == "stop":
            return
        try:
            result = getattr(runner, name)(*args)
        except Exception as exc:
            logger.exception("tensor-parallel rank %d failed in %s", rank, name)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from exc
        conn.send(("ok", None if name == "execute" else result))


if __name__ == "__main__":
    # through the module's own name, so that what this rank pickles (RankInfo) unpickles there
    from servelm.worker import tp

    tp._rank_main(int(sys.argv[1]))
