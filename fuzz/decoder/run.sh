#!/usr/bin/env bash
# Coverage-guided fuzzing of the message decoder and the content checks (harness.c says what the
# oracle checks). Usage: fuzz/decoder/run.sh [seconds] [extra libFuzzer flags...]
#   seconds      how long to fuzz (default 180); the long profile is `run.sh 3600`
# Needs clang with libFuzzer (Debian: apt-get install clang, which brings libclang-rt-14-dev).
# Builds into build/fuzz-decoder/, seeds from tests/golden/*.bin and fuzz/decoder/corpus/, writes new
# inputs to build/fuzz-decoder/work/ and crashing ones to build/fuzz-decoder/crash-*. Afterwards,
# `run.sh merge` folds the work corpus into fuzz/decoder/corpus/ (kept inputs only).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$ROOT/build/fuzz-decoder"
CLANG="${CLANG:-clang}"
mkdir -p "$OUT/work" "$OUT/seeds"
build() {  # build OUTPUT [-D...]
  local output="$1"
  shift
  "$CLANG" -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$ROOT/cffi_build" -DAIB_VERSION='"fuzz"' "$@" \
    "$ROOT/fuzz/decoder/harness.c" "$ROOT/fuzz/decoder/core_stubs.c" "$ROOT/cffi_build/base.c" "$ROOT/cffi_build/wire_"{model,describe,encode,decode,rebuild}.c \
    "$ROOT/cffi_build/layout.c" "$ROOT/cffi_build/content_check.c" -o "$output"
}
build "$OUT/harness"
# Golden messages as seeds: length prefix, the message, no region bytes (zero-filled regions).
for f in "$ROOT"/tests/golden/*.bin; do
  python3 -c 'import sys; m = open(sys.argv[1], "rb").read(); sys.stdout.buffer.write(len(m).to_bytes(2, "little") + m)' \
    "$f" > "$OUT/seeds/$(basename "$f")"
done
if [[ "${1:-}" == "--self-test" ]]; then
  # The oracle must catch what the checks exist for: with the checks off, fuzzing from the seeds
  # finds an out-of-region read within seconds.
  build "$OUT/harness-unchecked" -DCHECK_LEVEL=AIB_CHECK_NONE
  mkdir -p "$OUT/self-test"
  if "$OUT/harness-unchecked" -max_total_time=120 -artifact_prefix="$OUT/self-test/" "$OUT/self-test" \
    "$ROOT/fuzz/decoder/corpus" 2>"$OUT/self-test.log"; then
    echo "self-test FAILED: no oracle violation found with the checks off"
    exit 1
  fi
  grep -m1 "ORACLE\|ERROR: AddressSanitizer" "$OUT/self-test.log"
  echo "self-test passed: the oracle catches unchecked contents"
  exit 0
fi
if [[ "${1:-}" == "merge" ]]; then
  mkdir -p "$OUT/merged"
  "$OUT/harness" -merge=1 "$OUT/merged" "$ROOT/fuzz/decoder/corpus" "$OUT/work"
  echo "merged corpus in $OUT/merged ($(ls "$OUT/merged" | wc -l) files); copy it to fuzz/decoder/corpus to keep it"
  exit 0
fi
SECONDS_TO_RUN="${1:-180}"
shift || true
cd "$OUT"
exec "$OUT/harness" -max_total_time="$SECONDS_TO_RUN" -max_len=16384 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$OUT/" "$@" "$OUT/work" "$OUT/seeds" "$ROOT/fuzz/decoder/corpus"
