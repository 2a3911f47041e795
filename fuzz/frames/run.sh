#!/usr/bin/env bash
# Build the frame-parser fuzzer (fuzz_channel.c over cffi_build/channel.c) and run it.
#
#   fuzz/frames/run.sh [seconds] [jobs]        default: 60 seconds, 1 job
#
# Needs clang with libFuzzer (Debian/Ubuntu: apt-get install clang; libFuzzer ships with it in
# clang 14+ as libclang_rt.fuzzer). Builds into fuzz/frames/build/ (ignored by git), mutates a
# working copy of corpus/ there (the kept corpus stays small; copy interesting finds into it by
# hand), and stops at the first crash, leaving crash-* / leak-* files in build/. The long profile
# is `fuzz/frames/run.sh 600 16` or longer: at least 1,000,000 inputs. Prints how many inputs ran.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
seconds="${1:-60}"
jobs="${2:-1}"
build="$here/build"
mkdir -p "$build/corpus"
cc="${CC:-clang}"
"$cc" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -DAIB_VERSION='"fuzz"' -I"$here/../../cffi_build" \
  "$here/fuzz_channel.c" "$here/../../cffi_build/channel.c" "$here/../../cffi_build/base.c" -o "$build/fuzz_channel"
cp -n "$here"/corpus/* "$build/corpus/" 2>/dev/null || true
cd "$build"
args=(-max_total_time="$seconds" -max_len=140000 -dict="$here/frames.dict" -print_final_stats=1
      -artifact_prefix="$build/" -close_fd_mask=0)
status=0
if [ "$jobs" -gt 1 ]; then
  # -jobs runs independent fuzzers sharing the corpus directory; each writes fuzz-<n>.log.
  ./fuzz_channel "${args[@]}" -jobs="$jobs" -workers="$jobs" corpus >/dev/null 2>&1 || status=$?
  total=$(grep -h "stat::number_of_executed_units" fuzz-*.log | awk '{s += $2} END {print s + 0}')
  grep -h "ERROR\|SUMMARY\|leak" fuzz-*.log || true
else
  ./fuzz_channel "${args[@]}" corpus 2>fuzz-0.log || status=$?
  tail -n 8 fuzz-0.log
  total=$(grep -h "stat::number_of_executed_units" fuzz-0.log | awk '{s += $2} END {print s + 0}')
fi
echo "inputs executed: $total (exit status $status; crash files: $(ls "$build" | grep -c '^crash-\|^leak-\|^timeout-' || true))"
exit "$status"
