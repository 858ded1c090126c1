#!/usr/bin/env bash
# The CUDA checks, in one go, on a machine with a GPU and servelm's packages importable:
#
#   benchmarks/gpu_check.sh tests     # the fast suite; LLM() and `servelm serve` pick cuda
#   benchmarks/gpu_check.sh default   # the default model: golden tests, step times, workloads
#
# The test suite runs unchanged: with CUDA visible, device "auto" means cuda, so every engine
# the tests build (in-process and behind the HTTP server) runs the torch path on the GPU; tests
# of CPU-only features (int4 weights, the C kernels) pin device="cpu" themselves.
# Logs go to $OUT (default ./gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, "on", torch.cuda.get_device_name())' || exit 2

case ${1:-tests} in
tests)
    $PY -m pytest -q -m "not slow" -p no:cacheprovider --timeout 90 -rfE --tb=short 2>&1 |
        tee "$OUT/tests.log"
    ;;
default)
    $PY -m pytest -q -s -m slow -p no:cacheprovider -rfE --tb=short \
        tests/test_golden_default.py tests/text tests/store/test_store_default_real.py 2>&1 |
        tee "$OUT/golden.log"
    $PY benchmarks/step_time.py --batch 1,16,64 --kernels torch 2>&1 | tee "$OUT/step_time.log"
    $PY -m benchmarks.workloads --out "$OUT/workloads.json" 2>&1 | tee "$OUT/workloads.log"
    ;;
*)
    echo "usage: $0 tests|default" >&2
    exit 2
    ;;
esac
