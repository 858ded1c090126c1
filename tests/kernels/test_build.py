"""Building the C kernels: the cache, the variants (`servelm.kernels.variants`), and one compiler
choice for every build of a process and for every process."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from servelm.kernels import build, variants
from servelm.kernels.build import compiler, load_library
from tests.tiny_model import build_tiny_model

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
SOURCES = ["cpu_ops", "decode_stack", "paged_decode", "paged_prefill", "quant_matmul"]


@needs_compiler
@pytest.mark.parametrize("v", variants.VARIANTS, ids=lambda v: v.name)
def test_each_variants_flags_take_its_features_away(v):
    # checked by the compiler's own feature macros, which the C files' #if chains read: on any
    # x86 host, since taking a feature away needs no CPU that has it
    got = variants.macros(variants.flags(v))
    assert not [m for m in got if m.startswith(v.absent)]
    if variants.unavailable(v) is None:
        assert set(v.macros) <= got


@needs_compiler
def test_the_variants_this_host_runs_are_distinct_builds_and_one_is_native():
    runs = variants.available()
    assert runs, "not even the plain C build"
    features = [variants.macros(variants.flags(v)) for v in runs]
    for more, fewer in zip(features, features[1:], strict=False):
        assert fewer < more  # each variant a strict subset of the one before: its own code
    # the engine's build is one of them (here, and on Ice Lake or an EPYC before Zen 4, where
    # this checks that the variant named for that CPU takes nothing away from it)
    assert variants.flags(variants.native()) == ()
    # a variant that lacks the features of the CPU it names is not offered
    for v in variants.VARIANTS:
        if not set(v.cpu) <= variants.cpu_flags():
            assert v not in runs


@needs_compiler
def test_a_variant_is_its_own_build_in_the_cache(tmp_path, monkeypatch):
    # The cache key holds the flags: two variants of one source are two libraries, each its own.
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "cache")
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) {\n#ifdef __AVX2__\nreturn 1;\n#endif\nreturn 0; }\n")
    runs = variants.available()
    first, last = runs[0], runs[-1]
    has_avx2 = "__AVX2__" in variants.macros(variants.flags(first))
    assert load_library(source, variants.flags(first)).probe() == has_avx2
    assert load_library(source, variants.flags(last)).probe() == 0  # plain C
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == (2 if len(runs) > 1 else 1)
    # $SERVELM_KERNEL_VARIANT: the same build, chosen for the whole process
    monkeypatch.setenv(variants.ENV, last.name)
    assert load_library(source).probe() == 0
    monkeypatch.setenv(variants.ENV, "avx3")
    with pytest.raises(ValueError, match="choose one of"):
        load_library(source)


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
        build._load.cache_clear()
        assert load_library(source).probe() == value
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 2
    build._load.cache_clear()


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
    env.pop(variants.ENV, None)
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


@needs_compiler
def test_an_avx512_cpu_without_bf16_attends_with_its_own_build(monkeypatch):
    # Its own build of paged_prefill.c has the float32 path in 16 lanes (the AVX2 build's in 8
    # until session 31): no fallback build, for prompt and decode tokens alike.
    selected = "avx512-nobf16"
    if variants.unavailable(variants.get(selected)):
        pytest.skip(f"this host cannot run {selected}")
    monkeypatch.setenv(variants.ENV, selected)
    assert variants.prefill_fallback() is None
    import torch

    from servelm.kernels.paged_prefill import PagedPrefillKernel

    kernel = PagedPrefillKernel.load(torch.bfloat16, 64, 16)
    assert kernel is not None and kernel.name.endswith("(AVX-512)")
    built = build.build_all()
    assert [p.name.split("-")[0] for p in built] == SOURCES
    prefill = build.build(build.SOURCES_BY_STEM["paged_prefill"], variants.selected())
    assert prefill in built  # its own build, the one the kernel loaded


@needs_compiler
def test_an_amx_cpu_refused_its_tiles_attends_with_the_avx512_build(monkeypatch):
    # The AMX build's path needs the tiles; where Linux refuses them, the vectors of the same
    # layout (the avx512 build, which such a CPU executes) take the prefill attention.
    if variants.unavailable(variants.get("avx512")):
        pytest.skip("this host cannot run avx512")
    monkeypatch.delenv(variants.ENV, raising=False)
    with_amx = variants.cpu_flags() | {"amx_tile"}
    monkeypatch.setattr(variants, "cpu_flags", lambda: with_amx)
    monkeypatch.setattr(variants, "amx_granted", lambda: False)
    assert variants.prefill_fallback() == variants.flags(variants.get("avx512"))


@needs_compiler
def test_a_build_with_its_own_prefill_path_needs_no_fallback(monkeypatch):
    for name in ("avx2", "avx512-nobf16", "avx512", "amx"):
        if not variants.unavailable(variants.get(name)):
            monkeypatch.setenv(variants.ENV, name)
            assert variants.prefill_fallback() is None
