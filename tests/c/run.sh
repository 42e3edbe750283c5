#!/usr/bin/env bash
# Builds and runs the C tests of the core under ASan and UBSan, once
# without and once with OpenMP, then (where clang has libFuzzer) the two fuzz
# targets for ${FUZZ_SECONDS:-30} seconds in all. Exits non-zero on any failure.
#   CC            compiler for the unit tests (default gcc)
#   BUILD_DIR     where binaries go (default: a temporary directory)
#   FUZZ_SECONDS  fuzzing time; 0 skips the fuzzer
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cc=${CC:-gcc}
if [ -n "${BUILD_DIR:-}" ]; then
  out=$BUILD_DIR
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi

lib=("$root"/csrc/*.c)
support=("$here/gemm_support.c" "$here/parity.c" "$here/perm_parity.c" "$here/ref.c" "$here/tensor.c")
tests=("$here/test_core.c" "$here/test_status.c" "$here/test_permute.c" "$here/test_moe_gemm.c"
       "$here/test_router.c" "$here/test_moe_shapes.c" "$here/test_experts_gemm.c")
flags=(-std=c11 -Wall -Wextra -Werror -Wno-missing-field-initializers -O1 -g -fsanitize=address,undefined
       -fno-sanitize-recover=all -fno-omit-frame-pointer -I"$root/csrc")
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

run_tests() {
  local name=$1
  shift
  echo "== $name: build"
  "$cc" "${flags[@]}" "$@" "${lib[@]}" "${support[@]}" "${tests[@]}" -lm -o "$out/$name"
  echo "== $name: run"
  "$out/$name"
}

run_tests test_core_serial
OMP_NUM_THREADS=4 run_tests test_core_openmp -fopenmp

fuzz_seconds=${FUZZ_SECONDS:-30}
if [ "$fuzz_seconds" = 0 ]; then
  echo "== fuzz: skipped (FUZZ_SECONDS=0)"
elif ! command -v clang >/dev/null 2>&1; then
  echo "== fuzz: skipped (no clang on PATH)"
else
  # Two targets share the time: compaction parity (fuzz_compact.c) and
  # aliased arguments carved out of one arena (fuzz_alias.c).
  half=$(( (fuzz_seconds + 1) / 2 ))
  for target in compact alias; do
    echo "== fuzz $target: build"
    clang -std=c11 -Wall -Wextra -Werror -Wno-missing-field-initializers -O1 -g \
      -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I"$root/csrc" "${lib[@]}" \
      $([ $target = compact ] && echo "${support[@]}") "$here/fuzz_$target.c" -lm \
      -o "$out/fuzz_$target"
    seeds=("$here"/fuzz_regressions/$target/*)
    echo "== fuzz $target: inputs that once failed"
    "$out/fuzz_$target" "${seeds[@]}"
    echo "== fuzz $target: run for ${half}s"
    mkdir -p "$out/corpus_$target"
    cp "${seeds[@]}" "$out/corpus_$target/"
    "$out/fuzz_$target" -max_total_time="$half" -print_final_stats=1 "$out/corpus_$target"
  done
fi
echo "== all C tests passed"
