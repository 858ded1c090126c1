"""An all-reduce for tensor-parallel ranks on one x86 host, through shared memory.

gloo sums over loopback TCP: an all-reduce of a decode step's few KiB costs tens to hundreds
of microseconds of socket round trips, and a step makes two per layer (docs/performance.md).
Here each rank copies its tensor into its slot of one shared mapping (a file in /dev/shm),
publishes a sequence number, waits until every rank has published the same one, and sums the
slots itself in rank order, so that every rank gets the same bits.

Ordering: x86 keeps stores in program order (TSO), so a rank that reads another's sequence
number and then that rank's slot sees the data written before the number. Other architectures
use gloo (`usable`). Two sets of slots alternate: a rank starting all-reduce s has seen every
rank publish s - 1, so every rank is done reading the slots of s - 2, which s reuses. A tensor
larger than a slot, or not on the CPU, goes through gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # a 2,048-token prompt chunk of hidden 1,024 in bf16
_HEADER = 64  # one cache line: a sequence number (int64) per rank, so at most 8 ranks
SPIN_CHECKS = 2000  # checks before each yield of the core (the API process shares it)
ENV = "SERVELM_TP_SHM"  # "0": every all-reduce through gloo (to compare the two)


def usable(size: int) -> bool:
    """Whether this host and group size can use it (x86, 2 to 8 ranks, /dev/shm there)."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    wanted = os.environ.get(ENV, "1") != "0"
    return wanted and x86 and 1 < size <= _HEADER // 8 and os.path.isdir("/dev/shm")


class ShmAllReduce:
    def __init__(
        self, rank: int, size: int, path: str | None = None, timeout: float = 300.0
    ) -> None:
        """Rank 0 creates the mapping (path None) and hands `self.path` to the others; once
        they have mapped it, `unlink` removes the file (the mappings stay), so that nothing
        is left in /dev/shm however the ranks end."""
        total = _HEADER + 2 * size * SLOT_BYTES
        self.owner = path is None
        if self.owner:
            fd, path = tempfile.mkstemp(prefix="servelm-tp-", dir="/dev/shm")
            os.ftruncate(fd, total)  # zeros: every sequence number starts at 0
        else:
            fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(fd, total)
        os.close(fd)
        self.path, self.rank, self.size, self.timeout = path, rank, size, timeout
        self.seq = np.ndarray((size,), dtype=np.int64, buffer=self.map, offset=0)
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, offset=_HEADER)
        self.count = 0

    def fits(self, x: torch.Tensor) -> bool:
        size = x.numel() * x.element_size()
        return x.device.type == "cpu" and x.is_contiguous() and size <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        self.count += 1
        n = x.numel() * x.element_size()
        base = (self.count % 2) * self.size * SLOT_BYTES
        slots = [
            self.data[base + r * SLOT_BYTES : base + r * SLOT_BYTES + n].view(x.dtype).view(x.shape)
            for r in range(self.size)
        ]
        slots[self.rank].copy_(x)
        self.seq[self.rank] = self.count  # after the data: published
        checks, start = 0, 0.0
        while int(self.seq.min()) < self.count:
            checks += 1
            if checks % SPIN_CHECKS == 0:
                time.sleep(0)  # a rank descheduled on a shared core must get to run
                now = time.monotonic()
                start = start or now
                if now - start > self.timeout:
                    late = [r for r in range(self.size) if self.seq[r] < self.count]
                    raise RuntimeError(f"all-reduce: rank(s) {late} did not arrive")
        x.copy_(slots[0])
        for slot in slots[1:]:
            x.add_(slot)
        return x

    def unlink(self) -> None:
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
