"""The KV pool's memory on the CPU: zeros whose pages a background thread maps while the engine
is idle, keeping whatever the engine wrote first."""

from __future__ import annotations

import ctypes
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


def mapped_bytes(address: int, nbytes: int) -> int:
    """Resident bytes of this process's memory in [address, address + nbytes), page by page
    (mincore). /proc/self/smaps would count a whole mapping, which the kernel may have merged
    with a neighbour of the same kind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    assert address % page == 0
    pages = (nbytes + page - 1) // page
    resident = (ctypes.c_ubyte * pages)()
    assert libc.mincore(address, nbytes, resident) == 0, ctypes.get_errno()
    return sum(b & 1 for b in resident) * page


def anonymous(nbytes: int) -> np.ndarray:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)


def test_pool_is_zeros_and_its_pages_get_mapped():
    shape = (4, 2, 4096, 2, 64)  # 4 layers' K and V, 4,096 tokens: 16 MiB of bf16
    pool, filler = kv_pool(shape, torch.bfloat16, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.bfloat16
    assert filler is not None
    assert filler.done.wait(30)
    assert mapped_bytes(pool.data_ptr(), pool.nbytes) == pool.nbytes
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
        # the first chunk, mapped by start()
        assert mapped_bytes(memory.ctypes.data, memory.nbytes) == CHUNK
        assert not filler.done.is_set()
    assert filler.done.wait(30)
    assert mapped_bytes(memory.ctypes.data, memory.nbytes) == 8 * MIB
    assert filler.seconds is not None


def test_without_madvise_the_pages_are_mapped_at_once(monkeypatch):
    monkeypatch.setattr(kv_pool_module, "_libc_madvise", lambda: None)
    pool, filler = kv_pool((2, 2, 1024, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert filler is None
    assert mapped_bytes(pool.data_ptr(), pool.nbytes) == pool.nbytes
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
