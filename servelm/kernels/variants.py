"""The builds of servelm's C kernels, one for each kind of x86 CPU it serves on.

Each kernel picks its code path with `#if` on the compiler's feature macros, and `build.py`
compiles it with `-march=native`, so a machine would build (and test) only the path its own CPU
selects. A variant takes features away from `-march=native` with `-mno-...` flags: one machine
then also builds the paths of the CPUs with fewer features, and runs them (a CPU runs code for a
subset of its features). The tests run every variant the host can execute:

    amx             native on a Sapphire Rapids: AMX tiles, AVX-512 with BF16
    avx512          AVX-512 with BF16, without AMX or FP16 (Cooper Lake, AMD Zen 4 and 5)
    avx512-nobf16   AVX-512 without BF16, FP16 or AVX-VNNI (Skylake-X, Ice Lake)
    avx2            AVX2, FMA and F16C, no AVX-512 (AMD EPYC before Zen 4)
    c               none of those: the plain C loops

`SERVELM_KERNEL_VARIANT=avx2` (say) makes a process build and load that variant instead of
the native build: the engine then runs another CPU's paths on this one.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV = "SERVELM_KERNEL_VARIANT"
X86 = platform.machine() in ("x86_64", "AMD64")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # after -march=native: the features this build leaves out
    cpu: tuple[str, ...]  # the /proc/cpuinfo flags a CPU needs for this build to be itself
    macros: tuple[str, ...]  # feature macros its build defines (on such a CPU)
    absent: tuple[str, ...]  # prefixes of the feature macros its build must not define


# Later AMX and VEX extensions are listed too: a compiler that does not know a flag cannot
# target that feature, and `flags` drops it.
_AMX = ("amx-tile", "amx-int8", "amx-bf16", "amx-fp16", "amx-complex")
_VEX_VNNI = ("avxvnni", "avxvnniint8", "avxifma", "avxneconvert")
_NO_AMX = tuple(f"-mno-{f}" for f in _AMX)
_NO_AVX512 = ("-mno-avx512f", *_NO_AMX, *(f"-mno-{f}" for f in _VEX_VNNI))
_AMX_MACROS = "__AMX_"
_VNNI_MACROS = ("__AVXVNNI", "__AVXIFMA__", "__AVXNECONVERT__")

VARIANTS: tuple[Variant, ...] = (
    (
        Variant(
            "amx",
            (),
            ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw"),
            ("__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__", "__AVX512F__", "__AVX512BW__"),
            (),
        ),
        # AVX-VNNI stays: no path of this build reads it (only the AVX2 build's integer tiles
        # do), and Zen 5 has it, so that there the engine's native build is this one.
        Variant(
            "avx512",
            (*_NO_AMX, "-mno-avx512fp16", *(f"-mno-{f}" for f in _VEX_VNNI[1:])),
            ("avx512f", "avx512bw", "avx512_bf16"),
            ("__AVX512F__", "__AVX512BW__", "__AVX512BF16__"),
            (_AMX_MACROS, "__AVX512FP16__", "__AVXVNNIINT", *_VNNI_MACROS[1:]),
        ),
        Variant(
            "avx512-nobf16",
            (*_NO_AMX, "-mno-avx512bf16", "-mno-avx512fp16", *(f"-mno-{f}" for f in _VEX_VNNI)),
            ("avx512f", "avx512bw"),
            ("__AVX512F__", "__AVX512BW__", "__AVX2__", "__FMA__", "__F16C__"),
            (_AMX_MACROS, "__AVX512BF16__", "__AVX512FP16__", *_VNNI_MACROS),
        ),
        Variant(
            "avx2",
            _NO_AVX512,
            ("avx2", "fma", "f16c"),
            ("__AVX2__", "__FMA__", "__F16C__"),
            (_AMX_MACROS, "__AVX512", *_VNNI_MACROS),
        ),
        Variant(
            "c",
            ("-mno-avx2", "-mno-fma", "-mno-f16c", *_NO_AVX512),
            (),
            (),
            (_AMX_MACROS, "__AVX512", "__AVX2__", "__FMA__", "__F16C__", *_VNNI_MACROS),
        ),
    )
    if X86
    else (Variant("c", (), (), (), ()),)  # elsewhere the C loops are the only path
)
BY_NAME = {v.name: v for v in VARIANTS}


def get(name: str) -> Variant:
    if name not in BY_NAME:
        raise ValueError(f"kernel variant {name!r}: choose one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


@cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def amx_granted() -> bool:
    """Whether Linux lets this process use the AMX tile registers (the C code asks the same
    way, once per library; asking twice is harmless)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 Linux
        args = (ctypes.c_long(arch_prctl), ctypes.c_long(req_xcomp_perm), ctypes.c_long(xtiledata))
        return libc.syscall(*args) == 0
    except (OSError, AttributeError):
        return False


def _run(flags: tuple[str, ...], *args: str) -> subprocess.CompletedProcess | None:
    from servelm.kernels.build import compiler

    cc = compiler()
    if cc is None:
        return None
    argv = [*cc, "-march=native", *flags, *args, "-x", "c", "-"]
    return subprocess.run(argv, input="", capture_output=True, text=True)


@cache
def macros(flags: tuple[str, ...] = ()) -> frozenset[str]:
    """The feature macros (`__AVX2__`, ...) the C compiler defines with -march=native and
    `flags` here."""
    done = _run(flags, "-dM", "-E")
    if done is None or done.returncode:
        return frozenset()
    defines = (line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define"))
    return frozenset(m for m in defines if m.startswith("__") and m.endswith("__"))


@cache
def flags(variant: Variant) -> tuple[str, ...]:
    """The flags that build `variant` here: those the compiler knows, and none at all where
    they change nothing (then the variant is this machine's native build, and shares its
    cached libraries)."""
    accepted = variant.flags
    done = _run(accepted, "-E")
    if done is not None and done.returncode:  # an older compiler: keep the flags it knows
        accepted = tuple(f for f in accepted if _accepted(f))
    return () if macros(accepted) == macros() else accepted


@cache
def _accepted(flag: str) -> bool:
    done = _run((flag,), "-E")
    return done is not None and not done.returncode


@cache
def unavailable(variant: Variant) -> str | None:
    """Why this host cannot build and run `variant` as itself; None where it can."""
    missing = [f for f in variant.cpu if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {' '.join(missing)}"
    from servelm.kernels.build import compiler

    if compiler() is None:
        return "no C compiler on this machine"
    lacking = sorted(set(variant.macros) - macros(flags(variant)))
    if lacking:
        return f"the C compiler does not define {' '.join(lacking)} here"
    if "amx_tile" in variant.cpu and not amx_granted():
        return "Linux does not grant this process the AMX tile registers"
    return None


def available() -> list[Variant]:
    """The variants this host builds and runs, most features first."""
    return [v for v in VARIANTS if unavailable(v) is None]


def native() -> Variant | None:
    """The variant whose paths the plain -march=native build takes here: the one with the most
    features this host runs (on the three kinds servelm serves on, the very same build)."""
    runs = available()
    return runs[0] if runs else None


def selected() -> tuple[str, ...]:
    """The flags for this process's kernels: those of $SERVELM_KERNEL_VARIANT, else none.
    A variant this host cannot run is refused (its code could stop on an illegal instruction)."""
    from servelm.kernels.build import compiler

    name = os.environ.get(ENV, "")
    if not name or name == "native" or compiler() is None:  # (build.py warns of the latter)
        return ()
    variant = get(name)
    reason = unavailable(variant)
    if reason is not None:
        raise ValueError(f"{ENV}={name}: {reason}")
    return flags(variant)


def prefill_fallback() -> tuple[str, ...] | None:
    """The flags of the build whose prefill attention this CPU runs where its own build has
    none; None where its own build has one (or none can). `paged_prefill.c` has a path on AMX
    tiles, the same in AVX-512 BF16 vectors for CPUs with those and no AMX (Zen 4 and 5), and
    one in float32 vectors for the others (AVX-512 or AVX2). An AMX CPU whose tiles Linux
    refuses runs the avx512 build's, which it executes, rather than torch's SDPA, and so
    attends prompt and decode tokens alike in C (batch invariance). Decided from the CPU's
    flags, without asking the compiler, since every start asks."""
    name = os.environ.get(ENV, "")
    if name and name != "native":  # the selected build's features, not the CPU's
        cpu, amx = frozenset(get(name).cpu), "amx_tile" in get(name).cpu
    else:
        cpu = cpu_flags()
        amx = "amx_tile" in cpu and amx_granted()
    if amx or "amx_tile" not in cpu or "avx512_bf16" not in cpu or not X86:
        return None
    fallback = BY_NAME["avx512"]  # tiles refused: the vectors of the same layout
    return None if unavailable(fallback) is not None else flags(fallback)
