#!/usr/bin/env bash
# Build the CUDA launchers and the standalone harness, then run it.
#   tests/cuda/run.sh [harness args...]      e.g. --quick, --bench, --cases 100
# Environment: NVCC (default nvcc), ARCH (default sm_90), BUILD (default
# tests/cuda/build), SKIP_BUILD=1 to reuse an existing binary.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-sm_90}
BUILD=${BUILD:-tests/cuda/build}
mkdir -p "$BUILD"
if [ "${SKIP_BUILD:-0}" != "1" ] || [ ! -x "$BUILD/harness" ]; then
  core=$(ls csrc/*.c | grep -v backend_none.c)
  "$NVCC" -O3 -std=c++17 -arch="$ARCH" -lineinfo -Icsrc -Icuda \
    cuda/*.cu $core tests/cuda/harness.cu -o "$BUILD/harness"
fi
exec "$BUILD/harness" "$@"
