#!/usr/bin/env bash
# The GPU suite in one command: a clean build, every GPU test, the GPU
# benchmarks (main job W1-W3, W5 sweep, W4, W2 through the KV hooks and cache,
# the permutation engine, expert parallelism on two GPUs when there are two)
# and compute-sanitizer (memcheck and racecheck, each within
# SANITIZER_SECONDS, over the GPU tests of SANITIZER_FILES that
# SANITIZER_TESTS selects with pytest -k). Results (JSON, plots), the updated README and docs tables and
# one log go to OUT_DIR; README.md and docs/*.md are updated in place.
# --no-models skips W4, the KV hooks, M1/M2/H1, the MoE layer's host cost and
# expert parallelism.
#   bash benchmarks/gpu_suite.sh OUT_DIR [--no-sanitizer] [--no-sweep] [--no-tests] [--no-models]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [--no-sanitizer] [--no-sweep] [--no-tests] [--no-models]}
shift
sanitizer=1 sweep=1 tests=1 models=1
for arg in "$@"; do
  case $arg in
    --no-sanitizer) sanitizer=0 ;;
    --no-sweep) sweep=0 ;;
    --no-tests) tests=0 ;;
    --no-models) models=0 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
log="$out/suite.log"
export PYTHONUNBUFFERED=1
status=0
step() { echo "== $* ($(date +%T))" | tee -a "$log"; }
run() { "$@" 2>>"$log" | tee -a "$log" || status=1; }

step "clean build"
rm -rf build python/idempotent_moe/_C*.so
python -m pip install --no-build-isolation -e . >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
python -c "import idempotent_moe as m, torch; print('cuda build:', m.cuda_compiled(), 'device:', m.cuda_available(), \
  torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), 'torch', torch.__version__)" 2>&1 | tee -a "$log"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")

if [ "$tests" = 1 ]; then
  step "GPU tests"
  # W4 runs in full below; its smoke test would only repeat it.
  python -m pytest -q -p no:cacheprovider -m gpu tests -k "not test_gpu_w4_benchmark" -rs 2>&1 \
    | tail -40 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

step "main job: W1 W2 W3"
run python -m idempotent_moe bench --workloads W1,W2,W3 --out "$out" --readme README.md
run python -m idempotent_moe readme "$out/main-cuda.json" --readme docs/results.md
if [ "$sweep" = 1 ]; then
  step "W5 sweep"
  run python -m idempotent_moe sweep --out "$out"
fi
if [ "$models" = 1 ]; then
  step "W4: a Mixtral block"
  run python -m idempotent_moe w4 --out "$out" --doc docs/moe.md
  step "W2 through the KV hooks and the cache"
  run python -m idempotent_moe kv --device cuda --out "$out" --doc docs/kv.md
  step "M1, M2 and H1: whole models in generate(), host cost per call"
  run python -m idempotent_moe model --device cuda --out "$out" --doc docs/results.md --readme README.md
  step "the MoE layer's host time, kernels and decode ceiling"
  run python benchmarks/moe_host_cost.py --out "$out/moe-host-cost-cuda.json"
fi
step "permutation engine"
run python -m idempotent_moe permute --device cuda --out "$out" --doc docs/results.md
if [ "$models" = 1 ] && [ "$gpus" -ge 2 ]; then
  step "expert parallelism on two GPUs (NCCL)"
  run python benchmarks/ep_bench.py --out "$out" --docs docs/distributed.md
fi

if [ "$sanitizer" = 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer --tool $tool over the GPU tests"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_SECONDS:-300}" compute-sanitizer --tool "$tool" \
      --error-exitcode 99 python -m pytest -q -p no:cacheprovider -m gpu ${SANITIZER_FILES:-tests/test_gpu.py} \
      -k "${SANITIZER_TESTS:-not allocates_nothing and not graph}" 2>&1 | tail -8 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi

step "done (status $status)"
exit $status
