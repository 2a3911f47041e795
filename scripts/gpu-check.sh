#!/usr/bin/env bash
# The whole GPU run, in one call on the lent GPU machine:
#   run(command="AIB_SOURCE_COMMIT=<git rev-parse --short HEAD here> bash scripts/gpu-check.sh [quick|full]",
#       carry=[".whl"])
# (the machine's copy of the tree may carry an older .git; the benchmark records the commit given)
# Installs the carried wheels (cffi, pycparser, nanoarrow, polars: the machine lacks them), builds
# the C core in place, runs the GPU tests and the GPU benchmark, and writes results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-quick}
OUT=${OUT:-/tmp/aib-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 setup.py -q build_ext --inplace 2>&1 | grep -Ev "^(running|copying|creating)" || true
  python3 -m arrow_ipc_bridge doctor
  echo "== GPU tests"
  python3 -m pytest -p no:cacheprovider -q -m gpu -rs tests/test_gpu.py tests/test_cuda_driver.py \
    --junitxml="$OUT/gpu-tests.xml"
  echo "pytest exit: $?"
  echo "== host suites on the GPU machine (smoke)"
  # polars is not carried (its runtime wheel is 54 MB), so test_capsules (which imports it) runs in CI
  python3 -m pytest -p no:cacheprovider -q -x tests/test_metadata.py tests/test_layout.py -k "not fuzz"
  echo "== the README's main job, on the GPU"
  python3 -m arrow_ipc_bridge demo --rows 1000000
  echo "== benchmarks"
  python3 benchmarks/bench_metadata.py --json "$OUT/bench-metadata.json"
  if [ -f benchmarks/bench_gpu.py ]; then
    if [ "$mode" = full ]; then
      timeout 480 python3 benchmarks/bench_gpu.py --json "$OUT/bench-gpu.json"
    else
      timeout 240 python3 benchmarks/bench_gpu.py --quick --json "$OUT/bench-gpu.json"
    fi
    echo "bench exit: $?"
  fi
} 2>&1 | tee "$OUT/log.txt"
