#!/usr/bin/env bash
# Nsight Compute profile of the W1 select kernel (k_select_small, moves fused)
# with per-source-line counters, for the next step on W1's selection latency.
#   bash benchmarks/scripts/profile_select.sh OUT_DIR
# Writes OUT_DIR/select.ncu-rep (open it in the Nsight Compute GUI), the
# details page (select-details.txt) and the SASS lines with their stall
# samples and instruction counts (select-source.csv; Nsight Compute 2023.1 or
# newer for --print-source).
set -euo pipefail
out=${1:?usage: profile_select.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
bash tests/cuda/run.sh --quick > "$out/harness-quick.log"
ncu --set full --import-source yes --kernel-name regex:k_select_small --launch-skip 2 --launch-count 1 \
  -f -o "$out/select" tests/cuda/build/harness --profile > "$out/ncu.log" 2>&1
ncu --import "$out/select.ncu-rep" --page details > "$out/select-details.txt"
ncu --import "$out/select.ncu-rep" --page source --csv --print-source sass > "$out/select-source.csv"
echo "wrote $out/select.ncu-rep, select-details.txt, select-source.csv"
