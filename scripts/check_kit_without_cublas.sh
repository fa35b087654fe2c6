#!/usr/bin/env bash
# The GPU validation kit on a machine without cuBLAS (the driver and the CUDA runtime only): in a
# private mount namespace where every libcublas file reads as empty, a dry run of the kit
# (scripts/gpu_validate.py, with the device bundle built) must pass, say that cuBLAS is missing,
# and still run every test binary and ess: nothing links cuBLAS (the rig loads it when its
# stand-in GEMMs are first made), so only those GEMMs need it. Needs unshare(1) with a mount
# namespace (root in CI); says so and skips elsewhere.
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
unshare -m sh -c "${mounts}python3 scripts/gpu_validate.py --dry-run '$OUT' probe tests kernels" > "$OUT.log" 2>&1 || {
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
not_run = sorted(r["binary"] for r in tests if r.get("run") is False)
assert not not_run, f"without cuBLAS every test binary must still run, not run: {not_run}"
ran = [r for r in tests if "exit" in r]
assert any(r["binary"] == "cuda_executor_test" for r in ran), "the executor's device test did not run"
assert ran and all(r["exit"] == 0 for r in ran), "a test binary failed without cuBLAS"
summary = tests[-1]["summary"]
assert summary["ok"] and summary["failures"] == 0, summary
kernels = [json.loads(l) for l in open(f"{out}/kernels.jsonl")]
assert kernels and all(r.get("run") is False and r["why"].startswith("dry run") for r in kernels), \
    f"ess must start and take every benchmark's flags without cuBLAS: {kernels}"
print(f"check_kit_without_cublas: passed ({len(ran)} test binaries and {len(kernels)} ess commands ran without cuBLAS)")
PY
