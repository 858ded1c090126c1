"""common.h's float32 -> bfloat16 stores round as `float_to_bf16` promises in every build: to
nearest even, as torch does, and a NaN stays a NaN (its sign and top payload bits kept). One
difference, the ISA's: AVX-512 BF16's convert instruction takes float32 subnormals (below
2^-126, far below any activation) as zeros."""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from servelm.kernels import variants
from servelm.kernels.build import compiler, load_library
from tests.kernels.variants import flags

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")

SOURCE = Path(__file__).with_name("bf16_rounding.c")
KERNELS = Path(__file__).parents[2] / "servelm" / "kernels"


def rounding(variant: str):
    # (the build's cache key holds the headers beside a source only: common.h's hash as a flag)
    digest = hashlib.sha256((KERNELS / "common.h").read_bytes()).hexdigest()[:16]
    lib = load_library(SOURCE, (*flags(variant), f"-I{KERNELS}", f"-DCOMMON_H_{digest}"))
    fn = lib.round_to_bf16
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


def float_to_bf16(bits: np.ndarray) -> np.ndarray:
    """What the kernels promise, from a float32's bits."""
    u = bits.astype(np.uint64)
    nearest_even = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, nearest_even).astype(np.uint16)


def test_stores_round_to_nearest_even_and_keep_nans(variant):
    rng = np.random.default_rng(0)
    high = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    # every kind of low half: ties (0x8000) below even and odd highs, either side of a tie,
    # none, and random ones; and the highs that carry into the exponent (0x7f7f: to infinity)
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    # the largest finite (to infinity), infinities, NaNs (one that rounding would carry), subnormals
    edges = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001]
    edges += [0x7F800001, 0x7FBF8000, 0x00008000, 0x80018000, 0x00400000, 0x807FFFFF]
    random = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([(high[:, None] | lows[None, :]).ravel(), random, np.uint32(edges)])
    bits = np.concatenate([bits, np.zeros(-len(bits) % 16, dtype=np.uint32)])
    x = torch.from_numpy(bits.view(np.float32).copy())
    out = torch.empty(len(bits), dtype=torch.int16)
    rounding(variant)(x.data_ptr(), out.data_ptr(), len(bits))
    want = float_to_bf16(bits)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
    if "__AVX512BF16__" in variants.get(variant).macros:
        want[subnormal] = (bits[subnormal] >> 16) & 0x8000  # a zero of the same sign
    assert np.array_equal(out.numpy().view(np.uint16), want)
    normal = torch.from_numpy(~subnormal) & torch.isfinite(x)  # the promise: torch's rounding
    assert torch.equal(out[normal], x[normal].bfloat16().view(torch.int16))
