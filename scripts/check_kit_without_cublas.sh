#!/usr/bin/env bash
# The GPU validation kit on a machine without cuBLAS (the driver and the CUDA runtime only): in a
# private mount namespace where every libcublas file reads as empty, a dry run of the kit
# (scripts/gpu_validate.sh, with the device bundle built) must pass, say that cuBLAS is missing,
# record ess and the executor's tests as not run for that reason, and run every other test
# binary. Needs unshare(1) with a mount namespace (root in CI); says so and skips elsewhere.
#
# Usage: scripts/check_kit_without_cublas.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-validate-no-cublas}
if ! unshare -m true 2>/dev/null; then
  echo "check_kit_without_cublas: unshare -m not permitted here: skipped"
  exit 0
fi
mapfile -t libs < <( {
  ldconfig -p 2>/dev/null | awk '/libcublas/ {print $NF}' || true
  find /usr/local -maxdepth 4 -name 'libcublas*.so*' 2>/dev/null || true
} | xargs -r -n1 readlink -f | sort -u)
((${#libs[@]})) || { echo "check_kit_without_cublas: no libcublas on this machine: nothing to hide"; exit 0; }
mounts=""
for l in "${libs[@]}"; do mounts+="mount --bind /dev/null '$l' && "; done
rm -rf "$OUT"
unshare -m sh -c "${mounts}bash scripts/gpu_validate.sh --dry-run '$OUT' probe tests kernels" > "$OUT.log" 2>&1 || {
  tail -n 30 "$OUT.log" >&2
  echo "check_kit_without_cublas: the dry run failed without cuBLAS" >&2
  exit 1
}
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
probe = json.loads(open(f"{out}/probe.jsonl").readline())
assert probe["cublas"] == "not found", f"the probe found cuBLAS at {probe['cublas']} though every copy was hidden"
tests = [json.loads(l) for l in open(f"{out}/tests.jsonl")]
not_run = {r["binary"] for r in tests if r.get("run") is False}
assert "cuda_executor_test" in not_run and not_run <= {"cuda_executor_test", "cuda_executor_host_test"}, \
    f"without cuBLAS exactly the executor's tests must be recorded as not run, got {sorted(not_run)}"
assert all("libcublas" in r["why"] for r in tests if r.get("run") is False)
ran = [r for r in tests if "exit" in r]
assert ran and all(r["exit"] == 0 for r in ran), "a test binary that needs no cuBLAS failed"
summary = tests[-1]["summary"]
assert summary["ok"] and summary["failures"] == 0, summary
kernels = [json.loads(l) for l in open(f"{out}/kernels.jsonl")]
assert kernels and all(r.get("run") is False and "libcublas" in r["why"] for r in kernels), "ess ran without cuBLAS"
print(f"check_kit_without_cublas: passed ({len(ran)} test binaries ran, not run: {', '.join(sorted(not_run))})")
PY
