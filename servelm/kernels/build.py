"""Compile a C source shipped with servelm into a shared library, once per machine and source.

The library is built with `-march=native` for the CPU it runs on, so the cache key holds the
CPU's feature flags as well as the source, the compiler and its flags: a cache folder shared
between machines never hands one of them code for another's instruction set. OpenMP comes from
the libgomp torch has already loaded (same soname), so the kernel and torch share one thread
pool and `torch.set_num_threads` governs both. `variants.py` builds the paths of other CPUs
(flags taking features away from -march=native), for the tests and $SERVELM_KERNEL_VARIANT.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import platformdirs

from servelm.kernels import variants

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-std=gnu11", "-fopenmp", "-fPIC", "-shared"]
# Only against a hung compiler: quant_matmul.c takes about 55 s of CPU, and build_all compiles
# every source side by side, so a 2-core machine under load needs minutes (120 s was hit once
# at load average 9).
COMPILE_TIMEOUT_S = 400
SOURCES = sorted(Path(__file__).parent.glob("*.c"))  # every kernel servelm ships
SOURCES_BY_STEM = {source.stem: source for source in SOURCES}


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("servelm")) / "kernels"


def compiler() -> list[str] | None:
    """$CC, else the compiler Python was built with, else `cc`; None when none is installed."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if candidate:
            argv = shlex.split(candidate)
            if shutil.which(argv[0]):
                return argv
    return None


_compiler_lock = threading.Lock()


def _compiler_with_version() -> tuple[list[str], str] | None:
    """The compiler and what `--version` says, chosen once per process for every library.
    Under a lock: `build_all` asks from several threads at once, and `sysconfig` fills its
    variables lazily and without a lock, so a thread could read no CC, take `cc` where the
    others took `gcc` (one binary, another name) and build everything again under another
    cache key."""
    with _compiler_lock:
        return _chosen_compiler()


@cache
def _chosen_compiler() -> tuple[list[str], str] | None:
    cc = compiler()
    if cc is None:
        return None
    return cc, subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout


@cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """The compiled library file for `source`, built if it is not cached yet; None (with a
    warning) when there is no C compiler or the build fails."""
    found = _compiler_with_version()
    if found is None:
        logger.warning("no C compiler found ($CC, cc): %s is not built; using torch", source.name)
        return None
    cc, version = found
    # The source and the headers it may include from its folder (common.h) make one key.
    texts = [source.read_text()] + [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\0".join(
            [*texts, " ".join(cc), version, " ".join([*CFLAGS, *extra_flags]), _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        # What made the key, so that an unexpected rebuild can be traced to its cause.
        parts = {"source": texts[0], "headers": "\0".join(texts[1:]), "compiler": version}
        parts["cpu flags"] = _cpu_flags()
        logger.info(
            "compiling %s as %s (%s; %s)",
            source.name,
            target.name,
            " ".join(cc + [*CFLAGS, *extra_flags]),
            ", ".join(
                f"{k} {hashlib.sha256(v.encode()).hexdigest()[:8]}" for k, v in parts.items()
            ),
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [*cc, *CFLAGS, *extra_flags, "-o", tmp, str(source), "-lm"],
                check=True,
                capture_output=True,
                text=True,
                timeout=COMPILE_TIMEOUT_S,
            )
            os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
        except (subprocess.SubprocessError, OSError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            logger.warning("building %s failed; using torch:\n%s", source.name, detail[-2000:])
            Path(tmp).unlink(missing_ok=True)
            return None
    return target


def build_all() -> list[Path]:
    """Every kernel servelm ships, built at once (one compiler per source, side by side): the
    engine calls this before loading any of them, so a first start on a new machine waits for
    the slowest source, not for their sum (docs/performance.md). The builds `load_library` then
    loads."""
    flags = variants.selected()
    if flags:
        logger.info("C kernels: %s=%s", variants.ENV, os.environ[variants.ENV])
    jobs = [(source, flags) for source in SOURCES]
    fallback = variants.prefill_fallback()
    if fallback is not None:  # this CPU's prefill attention comes from another build, alone
        jobs = [(s, (*f, *fallback) if s.stem == "paged_prefill" else f) for s, f in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        built = pool.map(lambda job: build(*job), jobs)
        return [path for path in built if path is not None]


def load_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library for `source` (see `build`), loaded; None (with a warning) when
    it cannot be built or loaded. `extra_flags` follow the usual ones and those of
    $SERVELM_KERNEL_VARIANT (tests pass a variant's, `variants.flags`, to build another CPU's
    path of a kernel here)."""
    return _load(source, (*variants.selected(), *extra_flags))


@cache
def _load(source: Path, extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    target = build(source, extra_flags)
    if target is None:
        return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        logger.warning("loading %s failed; using torch: %s", target, e)
        return None


def main() -> None:
    """`python -m servelm.kernels.build`: build every kernel for this machine ahead of time."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build_all()
    print(f"servelm kernels: {len(built)} of {len(SOURCES)} built in {cache_dir()}")


if __name__ == "__main__":
    main()
