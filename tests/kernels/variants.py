"""The kernel builds of `servelm.kernels.variants` as test parameters, and which code path each
kernel's `#if` chain takes in each of them.

A test that takes the `variant` fixture (tests/conftest.py) runs once per variant, with the
variant's name as its id (`[avx2]`); it is skipped only for a variant this host cannot run.
A test of one path takes `@pytest.mark.parametrize("variant", params(NAMES), indirect=True)`.
"""

from __future__ import annotations

import pytest

from servelm.kernels import variants

# The paths the C files select, by variant (on a CPU that has the variant's features):
TILES = {"amx"}  # quant_matmul's q4 on AMX tiles from 6 rows
DECODE_VECTOR = {"avx2"}  # paged_decode's AVX2 path (AVX2 without AVX-512)
# paged_prefill's paths
PREFILL = {"amx": "AMX", "avx512": "AVX-512 BF16", "avx512-nobf16": "AVX-512", "avx2": "AVX2"}
INTEGERS = {"avx512-nobf16", "avx2"}  # q4 and q8 take x in integers by default
INTEGER_PATHS = INTEGERS | {"avx512"}  # ... or when asked (--int4-activations)


def params(names=None) -> list:
    """One parameter per variant (of `names`, else all), skipped where this host cannot run it."""
    out = []
    for v in variants.VARIANTS:
        if names is not None and v.name not in names:
            continue
        reason = variants.unavailable(v)
        marks = [pytest.mark.skip(reason=f"kernel variant {v.name}: {reason}")] if reason else []
        out.append(pytest.param(v.name, id=v.name, marks=marks))
    return out


def flags(name: str) -> tuple[str, ...]:
    """The compiler flags that build variant `name` here (for a kernel's `load`)."""
    return variants.flags(variants.get(name))


def native() -> str | None:
    """The variant the engine's own build is on this host."""
    found = variants.native()
    return found.name if found else None
