#!/usr/bin/env bash
# The main job: sets up, builds, and runs `ess` with the given arguments (default: `ess sim`,
# the simulator on the ESS paper's deployment, all-on-GPU baseline beside ESS).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target ess
if (($# == 0)); then set -- sim; fi
exec ./build/release/tools/ess/ess "$@"
