#!/usr/bin/env bash
# GPU validation, for a machine with a CUDA device (H100 / H200). Writes JSON and logs to
# OUT (default docs/results/). Stages, so that each fits a time-limited device call:
#   build     the release preset
#   tests     the gpu-labelled tests
#   memcheck  the tests/cuda binaries once under compute-sanitizer
#   kernels   ess bench transfer | swap | attention | indexer, ess verify --backend cuda
#   step      ess bench profile, then ess bench step with the simulator's predictions
# Usage: scripts/gpu_validate.sh [OUT_DIR] [STAGE...]   (no stage: all of them, in order)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results}
shift || true
STAGES=${*:-build tests memcheck kernels step}
mkdir -p "$OUT"
ESS=./build/release/tools/ess/ess
day=$(date -u +%Y-%m-%d)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' '-' | tr -cd '[:alnum:]-')
for stage in $STAGES; do
  case $stage in
    build)
      cmake --preset release -DESS_BUILD_BENCHMARKS=OFF >/dev/null
      cmake --build --preset release -j "$(nproc)" ;;
    tests)
      ctest --preset release -L gpu --output-on-failure 2>&1 | tee "$OUT/gpu-tests.log" ;;
    memcheck)
      SAN=/usr/local/cuda/bin/compute-sanitizer
      for t in build/release/tests/cuda/*_test; do
        "$SAN" --tool memcheck --error-exitcode 1 "$t" --gtest_brief=1 2>&1 | tail -n 5 | tee -a "$OUT/gpu-memcheck.log"
      done ;;
    kernels)
      $ESS bench transfer --format json > "$OUT/transfer-$gpu-$day.json"
      $ESS bench swap --format json > "$OUT/swap-$gpu-$day.json"
      $ESS bench attention --format json > "$OUT/attention-$gpu-$day.json"
      $ESS bench indexer --format json > "$OUT/indexer-$gpu-$day.json"
      $ESS verify --backend cuda --format json > "$OUT/verify-cuda-$gpu-$day.json" ;;
    step)
      $ESS bench profile --out "$OUT/profile-$gpu-$day"
      # Two batches keep the stage inside one 10-minute device call (each point builds its own
      # executor: host pool, caches, warm-up); add batches in further calls.
      $ESS bench step --format json --batch 16,64 \
        --profile-hardware "$OUT/profile-$gpu-$day-hardware.json" --profile-table "$OUT/profile-$gpu-$day-ops.csv" \
        > "$OUT/step-$gpu-$day.json" ;;
    *)
      echo "unknown stage '$stage' (build, tests, memcheck, kernels, step)" >&2
      exit 2 ;;
  esac
done
echo "results in $OUT"
