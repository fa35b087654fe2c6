#!/usr/bin/env bash
# The main job: sets up, builds, and runs `ess` with the given arguments (default: the
# built-in verify run, a lossless offloaded decode loop on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target ess
if (($# == 0)); then set -- verify; fi
exec ./build/release/tools/ess/ess "$@"
