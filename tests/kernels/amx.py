"""Whether servelm's AMX and AVX2-only paths should be there on this machine, for the tests
that check it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from servelm.kernels.build import compiler


def amx_expected() -> bool:
    """True where the CPU has AMX tiles and the C compiler targets them, False where the CPU
    has none; skips the calling test where the CPU has them but the compiler does not (or
    there is no compiler), since nothing could be built to use them."""
    if compiler() is None:
        pytest.skip("no C compiler on this machine")
    cpuinfo = Path("/proc/cpuinfo")
    has_amx = cpuinfo.exists() and " amx_bf16" in cpuinfo.read_text()
    macros = subprocess.run(
        [*compiler(), "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True
    ).stdout
    if has_amx and "__AMX_BF16__" not in macros:
        pytest.skip("this CPU has AMX, but the C compiler does not target it")
    return has_amx


def avx2_only() -> bool:
    """True where the CPU has AVX2 and FMA but no AVX-512: where the kernels' AVX2 paths run."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return "avx2" in flags and "fma" in flags and "avx512f" not in flags
