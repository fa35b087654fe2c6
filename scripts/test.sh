#!/usr/bin/env bash
# The test command: sets up, builds, and runs every test twice: once in the release build
# (CUDA target included when nvcc exists; GPU tests skip themselves without a device) and
# once under AddressSanitizer + UndefinedBehaviorSanitizer, with a short libFuzzer run of the
# trace reader in between.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

bash scripts/setup.sh

echo "== release build =="
cmake --preset release >/dev/null
cmake --build --preset release -j "$JOBS"
ctest --preset release -j "$JOBS"

echo "== fuzz: trace reader (${FUZZ_SECONDS:-45} s) =="
bash scripts/fuzz.sh "${FUZZ_SECONDS:-45}"

echo "== ASan + UBSan build =="
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$JOBS"
ctest --preset asan -j "$JOBS"
