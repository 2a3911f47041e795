#!/usr/bin/env bash
# The whole GPU check. On a machine with an NVIDIA GPU and the CUDA driver, run:
#
#   bash scripts/gpu-check.sh [quick|full|sanitize|multigpu]
#
# quick and full differ in the benchmark's length; sanitize runs the GPU tests alone under
# compute-sanitizer's memcheck (much slower) and fails on any error it reports; multigpu (a machine
# with two GPUs or more) runs doctor's topology, the multi-GPU tests and benchmarks/bench_multigpu.py
# (--quick) alone, and fails when fewer than two GPUs make its tests skip.
# It installs the Python packages the checks need that the machine lacks (from an optional local
# wheel folder `.whl/` when one is present, for a machine without network access; otherwise from the
# package index) into a private folder, builds the C core in place, runs the GPU tests, a host smoke
# test, the README demo and the benchmarks, and writes log.txt, gpu-tests.xml and the benchmark JSON
# under $OUT (default /tmp/aib-out).
#
# cuDF: RAPIDS' wheels are not installed by this script (they are too large to fetch per run); where
# `import pylibcudf` works with the PYTHONPATH given, every cuDF test, doc snippet and example among
# the GPU tests must run (a skip fails the check, except the cudf-DataFrame ones where cudf itself is
# not importable), and benchmarks/bench_cudf.py prints get + from_arrow against the host upload.
#
# Exit status: 0 only when every step passed and at least one GPU test ran. Non-zero when the install
# or the build fails, when any GPU test fails or errors, when no GPU test ran (no GPU, all skipped,
# none collected), when pylibcudf is importable and a cuDF check skipped, or when a later step (smoke
# tests, demo, benchmarks) fails; the summary at the end of the log names each failed step.
#
# Environment: PYTHON (default python3) is the interpreter to test with; AIB_SOURCE_COMMIT=<commit>
# labels the benchmark results when this tree's .git is absent or not the commit being tested (for
# example a copy of a working tree); AIB_SITE (default /tmp/aib-site) is where missing packages go.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-quick}
case "$mode" in
  quick | full | sanitize | multigpu) ;;
  *)
    echo "usage: bash scripts/gpu-check.sh [quick|full|sanitize|multigpu]" >&2
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/aib-out}
PYTHON=${PYTHON:-python3}
AIB_SITE=${AIB_SITE:-/tmp/aib-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# What the checks import (each module's distribution on the package index has the same name).
NEEDED_MODULES=(cffi pycparser pyarrow numpy pytest pytest_timeout hypothesis nanoarrow polars)

failed=()
fail() {
  failed+=("$1")
  echo "FAIL: $1"
}

install_missing() {
  local missing=() module
  for module in "${NEEDED_MODULES[@]}"; do
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
      missing+=("$module")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    echo "every needed package is installed"
    return 0
  fi
  echo "installing into $AIB_SITE: ${missing[*]}"
  if compgen -G ".whl/*.whl" >/dev/null; then
    # An offline machine: the wheels were put in .whl/ beforehand; nothing is fetched.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$AIB_SITE" .whl/*.whl
  else
    "$PYTHON" -m pip install -q --no-compile --upgrade --target "$AIB_SITE" "${missing[@]}"
  fi
}

# Reads pytest's JUnit XML and prints "<ran> <skipped> <wrongly skipped>" for the cuDF tests: those
# of tests/test_cudf.py, the cuDF doc snippets and the pylibcudf example (any test whose module or
# name says cudf). $2 is 1 where cudf itself is importable: a skip is wrong unless cudf is not
# importable and the skip says so (the DataFrame checks need cudf on top of pylibcudf).
cudf_counts() {
  "$PYTHON" - "$1" "$2" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 1")  # no report: count it as wrong
    raise SystemExit
have_cudf = sys.argv[2] == "1"
ran = skipped = wrong = 0
for case in root.iter("testcase"):
    if "cudf" not in case.get("classname", "") + case.get("name", ""):
        continue
    skip = case.find("skipped")
    if skip is None:
        ran += 1
        continue
    skipped += 1
    reason = skip.get("message", "")
    print(f"  skipped: {case.get('classname')}::{case.get('name')}: {reason}", file=sys.stderr)
    if have_cudf or "pylibcudf" in reason or "cudf" not in reason:
        wrong += 1
print(ran, skipped, wrong)
EOF
}

# Reads pytest's JUnit XML and prints "<ran> <failed> <errors> <skipped>".
junit_counts() {
  "$PYTHON" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 1 0")  # no report: count it as an error
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
total = sum(int(s.get("tests", 0)) for s in suites)
failures = sum(int(s.get("failures", 0)) for s in suites)
errors = sum(int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(total - skipped, failures, errors, skipped)
EOF
}

main() {
  echo "== install"
  if ! install_missing; then
    fail "install of the missing packages"
    return
  fi
  # A PYTHONPATH given stays after ours (where RAPIDS' pylibcudf was put, for the cuDF checks).
  export PYTHONPATH="$AIB_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

  echo "== GPU"
  local have_gpu=1
  if ! command -v nvidia-smi >/dev/null; then
    echo "nvidia-smi not found: no NVIDIA driver on this machine"
    have_gpu=0
  elif ! timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; then
    echo "nvidia-smi failed: no usable GPU"
    have_gpu=0
  fi

  echo "== build the C core"
  local build_log="$OUT/build.log"
  if ! "$PYTHON" setup.py -q build_ext --inplace --force >"$build_log" 2>&1; then
    cat "$build_log"
    fail "build of the C core (setup.py build_ext)"
    return
  fi
  grep -Ev "^(running|copying|creating)" "$build_log" || true
  "$PYTHON" -m arrow_ipc_bridge doctor || fail "arrow_ipc_bridge doctor"

  if [ "$mode" = multigpu ]; then
    multigpu_checks
    return
  fi

  echo "== GPU tests"
  local xml="$OUT/gpu-tests.xml" rc
  rm -f "$xml"
  # Every test module with a GPU-marked test, so a new one cannot be left out.
  local gpu_files
  mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
  local runner=() deselect=()
  if [ "$mode" = sanitize ]; then
    # memcheck over every process the tests start (producers and consumers are separate processes);
    # any memory error it reports makes the run fail through its exit code. Driver calls that return
    # an error are not reported: several tests provoke them on purpose (opening a handle in the
    # process that made it, importing from a pool that is gone, a pool without IPC).
    runner=(compute-sanitizer --tool memcheck --target-processes all --report-api-errors no
      --error-exitcode 86 --print-limit 50)
    # memcheck serialises kernel launches, so a test that needs a kernel still running when the
    # message is sent cannot hold there.
    deselect=(-k "not test_consumer_sees_final_data_of_a_running_kernel")
  fi
  timeout 1800 "${runner[@]}" "$PYTHON" -m pytest -p no:cacheprovider -q -m gpu -rs "${gpu_files[@]}" \
    "${deselect[@]}" --junitxml="$xml"
  rc=$?
  local ran nfail nerr nskip
  read -r ran nfail nerr nskip < <(junit_counts "$xml")
  echo "pytest exit $rc: $ran GPU tests ran, $nfail failed, $nerr errors, $nskip skipped"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    fail "GPU tests (pytest exit $rc: $nfail failed, $nerr errors)"
  elif [ "$nfail" -ne 0 ] || [ "$nerr" -ne 0 ]; then
    fail "GPU tests ($nfail failed, $nerr errors)"
  fi
  if [ "$ran" -eq 0 ]; then
    fail "no GPU test ran ($nskip skipped; pytest exit $rc): this check needs a GPU"
  fi

  if [ "$mode" = sanitize ]; then
    return # the sanitizer run checks the GPU tests only
  fi

  cudf_checks "$xml" "$have_gpu"

  echo "== host suites (smoke)"
  timeout 900 "$PYTHON" -m pytest -p no:cacheprovider -q -x tests/test_metadata.py tests/test_layout.py -k "not fuzz" ||
    fail "host smoke tests"

  echo "== the README's main job"
  timeout 300 "$PYTHON" -m arrow_ipc_bridge demo --rows 1000000 || fail "README demo"

  echo "== benchmarks"
  timeout 600 "$PYTHON" benchmarks/bench_metadata.py --json "$OUT/bench-metadata.json" || fail "bench_metadata.py"
  if [ "$have_gpu" -eq 0 ]; then
    echo "bench_gpu.py not run: no GPU"
  else
    local quick=(--quick) limit=240
    if [ "$mode" = full ]; then
      quick=()
      limit=480
    fi
    timeout "$limit" "$PYTHON" benchmarks/bench_gpu.py "${quick[@]}" --json "$OUT/bench-gpu.json"
    rc=$?
    echo "bench_gpu.py exit $rc"
    if [ "$rc" -eq 124 ]; then
      fail "bench_gpu.py (timed out after ${limit}s)"
    elif [ "$rc" -ne 0 ]; then
      fail "bench_gpu.py (exit $rc)"
    fi
  fi
}

# The cuDF tests, snippets and example ran (not skipped) where pylibcudf is importable, then the
# get + from_arrow figures against the host upload. $1: the GPU tests' JUnit XML; $2: have_gpu.
cudf_checks() {
  echo "== cuDF"
  if ! "$PYTHON" -c "import pylibcudf" 2>/dev/null; then
    echo "pylibcudf is not importable: no cuDF check (put RAPIDS' pylibcudf on PYTHONPATH to run them)"
    return
  fi
  local have_cudf=0 version ran skipped wrong rc
  if "$PYTHON" -c "import cudf" 2>/dev/null; then
    have_cudf=1
  fi
  version=$("$PYTHON" -c 'import pylibcudf; print(getattr(pylibcudf, "__version__", "?"))')
  read -r ran skipped wrong < <(cudf_counts "$1" "$have_cudf")
  echo "pylibcudf $version (cudf importable: $have_cudf): $ran cuDF tests ran, $skipped skipped"
  if [ "$wrong" -ne 0 ]; then
    fail "cuDF checks: $wrong skipped although pylibcudf is importable (reasons above)"
  fi
  if [ "$ran" -eq 0 ]; then
    fail "cuDF checks: none ran although pylibcudf is importable"
  fi
  if [ "$2" -eq 0 ]; then
    return
  fi
  echo "== bench_cudf.py (get + from_arrow against the host upload)"
  timeout 300 "$PYTHON" benchmarks/bench_cudf.py --json "$OUT/bench-cudf.json"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "bench_cudf.py (exit $rc)"
  fi
}

# Several GPUs: the multi-GPU tests (the GPU ones must run, not skip) and their benchmark.
multigpu_checks() {
  echo "== multi-GPU tests"
  local xml="$OUT/multigpu-tests.xml" rc ran nfail nerr nskip
  rm -f "$xml"
  # The GPU file alone is counted: none of its tests may skip here. The CPU-side file runs after it
  # (one of its tests skips where a driver is present, by design).
  timeout 1800 "$PYTHON" -m pytest -p no:cacheprovider -q -rs tests/test_multigpu.py --junitxml="$xml"
  rc=$?
  read -r ran nfail nerr nskip < <(junit_counts "$xml")
  echo "pytest exit $rc: $ran tests ran, $nfail failed, $nerr errors, $nskip skipped"
  if [ "$rc" -ne 0 ]; then
    fail "multi-GPU tests (pytest exit $rc: $nfail failed, $nerr errors)"
  fi
  if [ "$nskip" -ne 0 ]; then
    fail "multi-GPU tests: $nskip skipped (this check needs two GPUs and CuPy)"
  fi
  timeout 600 "$PYTHON" -m pytest -p no:cacheprovider -q -rs tests/test_multigpu_cpu.py ||
    fail "tests/test_multigpu_cpu.py"

  echo "== bench_multigpu.py"
  timeout 900 "$PYTHON" benchmarks/bench_multigpu.py --quick --json "$OUT/bench-multigpu.json"
  rc=$?
  echo "bench_multigpu.py exit $rc"
  if [ "$rc" -ne 0 ]; then
    fail "bench_multigpu.py (exit $rc)"
  fi
}

summary() {
  echo "== summary"
  if [ "${#failed[@]}" -eq 0 ]; then
    echo "gpu-check: PASS"
    return 0
  fi
  echo "gpu-check: FAILED (${#failed[@]})"
  printf '  - %s\n' "${failed[@]}"
  return 1
}

# The log is written through tee; the pipeline's status would be tee's, so the verdict is taken
# from main's own record of failures, inside the same shell as main (a pipeline member runs in a
# subshell: its variables do not come back), and returned as the pipeline's first status.
{
  main
  summary
} 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
