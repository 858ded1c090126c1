"""Building the C kernels: the cache, and one compiler choice for every build of a process and
for every process."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from servelm.kernels import build
from servelm.kernels.build import compiler, load_library
from tests.tiny_model import build_tiny_model

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
SOURCES = ["cpu_ops", "decode_stack", "paged_decode", "paged_prefill", "quant_matmul"]


@needs_compiler
def test_a_source_that_does_not_compile_falls_back_with_a_warning(tmp_path, caplog):
    bad = tmp_path / "broken.c"
    bad.write_text("int f( {\n")
    with caplog.at_level(logging.WARNING, logger="servelm.kernels.build"):
        assert load_library(bad) is None
    assert "building broken.c failed; using torch" in caplog.text
    assert "error" in caplog.text  # the compiler's own message is passed on


@needs_compiler
def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    # Kernel sources share common.h; a stale library built from an older header must not load.
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "cache")
    source, header = tmp_path / "probe.c", tmp_path / "probe.h"
    source.write_text('#include "probe.h"\nint probe(void) { return VALUE; }\n')
    for value in (1, 2):
        header.write_text(f"#define VALUE {value}\n")
        load_library.cache_clear()
        assert load_library(source).probe() == value
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 2
    load_library.cache_clear()


@needs_compiler
def test_the_compiler_is_chosen_once_for_all_threads(monkeypatch):
    # `build_all` asks from one thread per source. A choice that can differ between threads
    # (as it did: sysconfig fills its variables lazily, without a lock) builds some sources
    # with `gcc` and some with `cc`, under other cache keys than the engine's next start.
    calls = []

    def slow_and_changing():
        calls.append(1)
        time.sleep(0.05)
        return ["gcc"] if len(calls) == 1 else ["cc"]

    monkeypatch.setattr(build, "compiler", slow_and_changing)
    build._chosen_compiler.cache_clear()
    try:
        got = []
        threads = [
            threading.Thread(target=lambda: got.append(build._compiler_with_version()[0]))
            for _ in range(5)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        build._chosen_compiler.cache_clear()
    assert got == [["gcc"]] * 5 and len(calls) == 1


ENGINE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from servelm import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", quantization="int4", kv_cache_memory="4MiB", device="cpu")
assert llm.engine.executor.decode_stack is not None  # every kernel loaded
with open("/proc/self/maps") as maps:
    print("\\n".join(sorted({line.split()[-1] for line in maps if sys.argv[2] in line})))
"""


@needs_compiler
def test_build_all_then_the_engine_load_the_same_files(tmp_path):
    # `make serve` on a fresh clone: `python -m servelm.kernels.build`, then the engine, in
    # another process, must find every library built and compile nothing.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cache = tmp_path / "xdg" / "servelm" / "kernels"
    first = subprocess.run(
        [sys.executable, "-m", "servelm.kernels.build"], env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    built = sorted(cache.glob("*.so"))
    assert [p.name.split("-")[0] for p in built] == SOURCES  # side by side, one of each
    assert len(set(re.findall(r"^compiling \S+ as \S+ \((\S+)", first.stderr, re.M))) == 1

    model = build_tiny_model(tmp_path / "model", head_dim=32)  # 32: the prefill kernel's too
    second = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), str(cache)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr
    assert second.stdout.split() == [str(p) for p in built]
    assert sorted(cache.glob("*.so")) == built
