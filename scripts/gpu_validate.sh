#!/usr/bin/env bash
# GPU validation, for a machine with a CUDA device (H100 / H200): builds the release
# preset, runs the gpu-labelled tests, runs them once more under compute-sanitizer
# (memcheck), and runs the GPU benchmarks, writing their JSON to $OUT (default
# docs/results/). Usage: scripts/gpu_validate.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
mkdir -p "$OUT"
cmake --preset release -DESS_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build --preset release -j "$(nproc)"
ctest --preset release -L gpu --output-on-failure 2>&1 | tee "$OUT/gpu-tests.log"
SAN=/usr/local/cuda/bin/compute-sanitizer
if [[ -x $SAN ]]; then
  for t in build/release/tests/cuda/*_test; do
    "$SAN" --tool memcheck --error-exitcode 1 "$t" --gtest_brief=1 2>&1 | tail -n 5 | tee -a "$OUT/gpu-memcheck.log"
  done
fi
day=$(date -u +%Y-%m-%d)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' '-' | tr -cd '[:alnum:]-')
./build/release/tools/ess/ess bench transfer --format json > "$OUT/transfer-$gpu-$day.json"
./build/release/tools/ess/ess bench swap --format json > "$OUT/swap-$gpu-$day.json"
./build/release/tools/ess/ess verify --backend cuda --format json > "$OUT/verify-cuda-$gpu-$day.json"
echo "results in $OUT"
