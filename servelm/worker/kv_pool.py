"""The memory of the KV pool: every layer's K and V in one zero-filled allocation.

On a GPU that is `torch.zeros`. On the CPU it is an anonymous mapping, and what matters is when
its pages get mapped. A page left to be mapped on its first write costs a fault inside the
engine's threaded ops; mapping them all before serving (`MAP_POPULATE`) costs a noticeable part
of every start, and on a VM that serializes page faults no second thread or process maps them
faster (docs/performance.md).

So the pages are mapped by a background thread while the engine is idle: the model runner
holds it while a step runs (`held`), and it runs at the lowest priority (nice 19), so it yields
to the API process too. It asks the kernel to map them with `madvise(MADV_POPULATE_WRITE)`
(Linux 5.14 and later), which leaves the data as it is, so a page the engine wrote first keeps
what it wrote, and it goes in the order the scheduler first hands blocks out (block 0 first, in
every layer's K and V), 16 pages at a time (tens of microseconds). A burst that starts before
it is done faults in the pages its own blocks need (a 16-token block's K and V over 30 layers
are 90 pages). Where that call is missing (another OS, an older kernel) the pages are mapped
before the pool is returned, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it before 3.13
# Bytes of each K or V region the thread maps per call: 16 pages, a few 16-token blocks.
CHUNK = 16 * mmap.PAGESIZE
# The thread waits this long after a step before it maps more (steps of a burst follow each
# other within a few milliseconds).
IDLE_S = 0.01


def kv_pool(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, PageFiller | None]:
    """Zeros of `shape` ([layers, 2, tokens, ...]) for the KV caches of every layer, and the
    thread mapping their pages (None where they were mapped at once, or on a GPU)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    flat = np.frombuffer(mmap.mmap(-1, max(1, nbytes), flags=flags), np.uint8, count=nbytes)
    filler = PageFiller(flat, math.prod(shape[:2]))
    if not filler.start():
        filler, flat = None, _populated(nbytes)
    return torch.from_numpy(flat).view(dtype).view(shape), filler


def _populated(nbytes: int) -> np.ndarray:
    """An anonymous mapping of `nbytes` whose pages are all mapped now."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, max(1, nbytes), flags=flags), np.uint8, count=nbytes)


class PageFiller:
    """Maps the pages of `memory` (`regions` equal parts: one per layer's K and V) in a
    background thread, the same offsets of every region at a time."""

    def __init__(self, memory: np.ndarray, regions: int) -> None:
        self.memory = memory  # held until done: the mapping stays valid
        self.address, self.nbytes, self.regions = memory.ctypes.data, memory.nbytes, regions
        self.seconds: float | None = None  # how long the thread took, once done
        self.done = threading.Event()
        self._madvise = _libc_madvise()
        self._steps = 0  # steps running (the engine runs one at a time)
        self._idle_from = 0.0  # time.monotonic() from which the thread may map pages

    @contextlib.contextmanager
    def held(self):
        """No pages are mapped in the background inside this block (nor for IDLE_S after),
        but for one call of 16 pages (tens of microseconds) that may have begun before it."""
        self._steps += 1
        try:
            yield
        finally:
            self._idle_from = time.monotonic() + IDLE_S
            self._steps -= 1

    def start(self) -> bool:
        """Start the thread, after mapping one chunk to see that the kernel can (else False)."""
        if self._madvise is None or self.nbytes == 0 or not self._populate(0, CHUNK):
            return False
        threading.Thread(target=self._run, name="servelm-kv-pages", daemon=True).start()
        return True

    def _populate(self, start: int, length: int) -> bool:
        """Map the pages of bytes [start, start + length), rounded out to whole pages."""
        page = mmap.PAGESIZE
        first = start // page * page
        end = min(-(-(start + length) // page) * page, -(-self.nbytes // page) * page)
        return self._madvise(self.address + first, end - first, MADV_POPULATE_WRITE) == 0

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
        except OSError:
            pass
        region = self.nbytes // self.regions
        try:
            for offset in range(0, region, CHUNK):
                for r in range(self.regions):
                    while self._steps or time.monotonic() < self._idle_from:
                        time.sleep(IDLE_S / 2)
                    if not self._populate(r * region + offset, min(CHUNK, region - offset)):
                        logger.warning("KV pool: madvise failed; the rest is mapped on first write")
                        return
            self.seconds = time.perf_counter() - t0
            logger.debug(
                "KV pool: %.0f MiB of pages mapped in %.2f s", self.nbytes / 2**20, self.seconds
            )
        finally:  # done or failed, the thread lets go of the mapping
            self.memory = None
            self.done.set()


def _libc_madvise():
    """libc's `madvise` on Linux, else None (whether the kernel knows MADV_POPULATE_WRITE,
    `PageFiller.start` finds out)."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
