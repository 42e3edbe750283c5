#!/usr/bin/env bash
# The GPU suite in one command: build, the GPU tests, compute-sanitizer
# (memcheck and racecheck, each within SANITIZER_SECONDS, over the tests that
# SANITIZER_TESTS selects with pytest -k) over them, the main
# benchmark (W1, W2, W3) and the W5 sweep. Results and one log go to OUT_DIR.
#   bash benchmarks/gpu_suite.sh OUT_DIR [--no-sanitizer] [--no-sweep]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [--no-sanitizer] [--no-sweep]}
shift
sanitizer=1 sweep=1
for arg in "$@"; do
  case $arg in
    --no-sanitizer) sanitizer=0 ;;
    --no-sweep) sweep=0 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
log="$out/suite.log"
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $*" | tee -a "$log"; }

step "build"
python -m pip install --no-build-isolation -e . >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
python -c "import idempotent_moe as m, torch; print('cuda build:', m.cuda_available(), \
  torch.cuda.get_device_name(0))" 2>&1 | tee -a "$log"

step "GPU tests"
python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -25 | tee -a "$log" \
  || status=1

step "benchmark W1 W2 W3"
python -m idempotent_moe bench --workloads W1,W2,W3 --out "$out" 2>>"$log" | tee -a "$log" \
  || status=1

if [ "$sweep" = 1 ]; then
  step "W5 sweep"
  python -m idempotent_moe sweep --out "$out" 2>>"$log" | tee -a "$log" || status=1
fi
if [ "$sanitizer" = 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer --tool $tool over the GPU tests"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_SECONDS:-300}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
      -k "${SANITIZER_TESTS:-not allocates_nothing and not graph}" 2>&1 | tail -8 | tee -a "$log" || status=1
  done
fi

step "done (status $status)"
exit $status
