"""The KV pool's memory on the CPU: zeros whose pages a background thread maps while the engine
is idle, keeping whatever the engine wrote first."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
import torch

from servelm.worker import kv_pool as kv_pool_module
from servelm.worker.kv_pool import CHUNK, IDLE_S, PageFiller, kv_pool

pytestmark = pytest.mark.skipif(
    kv_pool_module._libc_madvise() is None, reason="needs Linux's madvise"
)

MIB = 2**20


def mapped_bytes(address: int) -> int:
    """Resident bytes of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split()[0] and int(line.split("-")[0], 16) == address:
            for entry in lines[i + 1 :]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def anonymous(nbytes: int) -> np.ndarray:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)


def test_pool_is_zeros_and_its_pages_get_mapped():
    shape = (4, 2, 4096, 2, 64)  # 4 layers' K and V, 4,096 tokens: 16 MiB of bf16
    pool, filler = kv_pool(shape, torch.bfloat16, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.bfloat16
    assert filler is not None
    assert filler.done.wait(30)
    assert mapped_bytes(pool.data_ptr()) == pool.numel() * 2
    assert not pool.any()


def test_what_is_written_first_is_kept():
    shape = (3, 2, 8192, 1, 64)  # regions of 1 MiB, not a whole number of chunks apart
    pool, filler = kv_pool(shape, torch.float32, torch.device("cpu"))
    assert filler is not None
    flat = pool.view(-1)
    where = torch.arange(0, flat.numel(), 4093)  # a value in every page, written at once
    flat[where] = where.float() + 1
    assert filler.done.wait(30)
    assert torch.equal(flat[where], where.float() + 1)
    flat[where] = 0
    assert not flat.any()


def test_no_pages_are_mapped_while_held():
    memory = anonymous(8 * MIB)
    filler = PageFiller(memory, regions=2)
    with filler.held():
        assert filler.start()
        time.sleep(0.3)
        assert mapped_bytes(memory.ctypes.data) == CHUNK  # the first chunk, mapped by start()
        assert not filler.done.is_set()
    assert filler.done.wait(30)
    assert mapped_bytes(memory.ctypes.data) == 8 * MIB
    assert filler.seconds is not None


def test_without_madvise_the_pages_are_mapped_at_once(monkeypatch):
    monkeypatch.setattr(kv_pool_module, "_libc_madvise", lambda: None)
    pool, filler = kv_pool((2, 2, 1024, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert filler is None
    assert mapped_bytes(pool.data_ptr()) == pool.numel() * 2
    assert not pool.any()


def test_a_step_holds_the_filler(tiny_model_dir):
    """The model runner holds the thread during `execute`, and drops it once it is done."""
    from servelm.engine.outputs import SchedulerOutput
    from servelm.model.config import load_spec
    from servelm.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, load_spec(tiny_model_dir), max_model_len=64)
    runner.allocate_kv_cache(64)
    pages = runner.kv_pages
    assert pages is not None
    before = time.monotonic()
    runner.execute(SchedulerOutput(requests=[]))
    assert pages._idle_from >= before + IDLE_S  # released at the end of the step
    assert pages.done.wait(30)
    runner.execute(SchedulerOutput(requests=[]))
    assert runner.kv_pages is None
