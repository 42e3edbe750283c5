#!/usr/bin/env bash
# The GPU suite in one command: a clean build, every GPU test, the GPU
# benchmarks (main job W1-W3, W5 sweep, W4, W2 through the KV hooks and cache,
# the permutation engine, expert parallelism on two GPUs when there are two)
# and compute-sanitizer (memcheck and racecheck, each within
# SANITIZER_SECONDS, over the GPU tests of SANITIZER_FILES that
# SANITIZER_TESTS selects with pytest -k). Results (JSON, plots), the updated README and docs tables and
# one log go to OUT_DIR; README.md and docs/*.md are updated in place.
# --no-models skips W4, the KV hooks, M1/M2/H1 (and M1's compiled run and its
# run of our options), the MoE layer's host cost and decode ceiling, the
# small-M GEMM, the profiled decode step, T1, P1 and expert parallelism.
#   bash benchmarks/scripts/gpu_suite.sh OUT_DIR [--no-sanitizer] [--no-sweep] [--no-tests] [--no-models]
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
run python -m imoe_bench bench --workloads W1,W2,W3 --out "$out"
run python -m imoe_bench readme "$out/main-cuda.json" --readme docs/results.md
if [ "$sweep" = 1 ]; then
  step "W5 sweep"
  run python -m imoe_bench sweep --out "$out"
fi
if [ "$models" = 1 ]; then
  step "W4: a Mixtral block"
  run python -m imoe_bench w4 --out "$out" --doc docs/results.md
  step "W2 through the KV hooks and the cache"
  run python -m imoe_bench kv --device cuda --out "$out" --doc docs/kv.md
  step "M1, M2 and H1: whole models in generate(), host cost per call"
  run python -m imoe_bench model --device cuda --out "$out" --doc docs/results.md --readme README.md
  # Runs of M1 beside it (JSON only: docs/results.md summarises them in prose).
  for run_name in static options; do
    if [ "$run_name" = static ]; then
      step "M1 compiled (static cache)"
      args=(--caches static --impls grouped_mm,idempotent,idempotent+gemm)
    else
      step "M1: the options of ours (small-M GEMM, fused routers)"
      args=(--caches dynamic --impls grouped_mm,idempotent,idempotent+gemm,idempotent+gemm+router)
    fi
    run python -m imoe_bench model --device cuda "${args[@]}" --skip-m2 --skip-h1 --no-plot \
      --out "$out/$run_name"
    cp "$out/$run_name/model-cuda.json" "$out/model-$run_name-cuda.json"
  done
  step "the MoE layer's host time, kernels and decode ceiling"
  run python benchmarks/scripts/moe_host_cost.py --out "$out/moe-host-cost-cuda.json"
  run python benchmarks/scripts/moe_host_cost.py --cache static --batches 1,8 \
    --out "$out/moe-host-cost-static-cuda.json"
  step "the small-M grouped GEMM against grouped_mm"
  run python benchmarks/scripts/moe_gemm_cuda.py --out "$out/moe-gemm-cuda.json"
  step "one decode step, profiled (compiled, batch 1)"
  run python benchmarks/scripts/decode_profile.py --cache static --batch 1 --out "$out/decode-profile-cuda.json"
  step "T1: training steps and the experts layer alone"
  run python -m imoe_bench train --out "$out" --doc docs/moe.md
  step "T1's layer taken apart: time per kernel, bytes per saved tensor"
  run python -m imoe_bench train --profile --out "$out"
  step "T1's models taken apart: what is alive at a step's memory peak"
  run python -m imoe_bench train --memory --out "$out"
  step "P1: the experts forward, routing given (with vLLM's fused_moe where VLLM_PATH names a checkout)"
  run python benchmarks/p1_experts.py --out "$out/p1-cuda.json" ${VLLM_PATH:+--vllm-path "$VLLM_PATH"}
fi
step "permutation engine"
run python -m imoe_bench permute --device cuda --out "$out" --doc docs/results.md
if [ "$models" = 1 ] && [ "$gpus" -ge 2 ]; then
  step "expert parallelism on two GPUs (NCCL)"
  run python benchmarks/scripts/ep_bench.py --experts scale mlp --passes forward train --out "$out" \
    --docs docs/distributed.md
fi

if [ "$sanitizer" = 1 ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer --tool $tool over the GPU tests"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_SECONDS:-300}" compute-sanitizer --tool "$tool" \
      --error-exitcode 99 python -m pytest -q -p no:cacheprovider -m gpu ${SANITIZER_FILES:-tests/core/test_compact_gpu.py tests/moe/test_experts_gemm.py tests/moe/test_moe_train.py} \
      -k "${SANITIZER_TESTS:-not allocates_nothing and not graph}" 2>&1 | tail -8 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi

step "done (status $status)"
exit $status
