#!/usr/bin/env bash
# GPU validation on a bare H100 / H200 (docs/gpu-validation.md): what the GPU must show, in
# four commands of well under 10 minutes each on 16 cores, with the device bundle
# (scripts/device_bundle.sh) carried along as build/device-bundle:
#
#   1. scripts/gpu_validate.sh $OUT probe tests      the machine, then every kernel test binary
#   2. scripts/gpu_validate.sh $OUT sanitize kernels compute-sanitizer; the kernel benchmarks
#   3. scripts/gpu_validate.sh $OUT profile python   the op profile (kept in build/gpu-validate for
#                                                    command 4); the Python package on torch CUDA
#                                                    tensors and the engine loop on the CUDA backend
#   4. scripts/gpu_validate.sh $OUT step             the decode step per schedule, with the
#                                                    simulator's prediction from command 3's profile
#
# Every stage writes as it goes into OUT (at most two files per stage, so that a command's
# files all come back): STAGE.jsonl, one JSON record per binary / run, appended when it ends,
# and STAGE.log, the full output. A command stopped at its time limit keeps what it finished.
# Every command first checks that the carried binaries start there; if they do not, it builds
# them from source against the bundle's prefix (build/device; kept between warm calls).
#
# Usage: scripts/gpu_validate.sh [--dry-run] [--bundle DIR] OUT STAGE...
#   stages: probe tests sanitize kernels profile step python
#   --dry-run  everything but the device work, on any machine (CI runs it): the probe, every
#              test binary (the device cases skip themselves), the planned sanitizer and
#              benchmark command lines (each benchmark's flags are parsed by ess itself: it
#              must fail only for want of a device), and the records they would write.
set -eEuo pipefail
# No step dies silently: a failing command names itself and its line.
# (Only where errexit holds: a command run under `set +e` may fail, its status is recorded.)
# It writes to the script's own stderr (fd 3), whatever the failing command's redirections.
exec 3>&2
trap 'rc=$?; [[ $- == *e* ]] && echo "gpu_validate: line $LINENO: \"$BASH_COMMAND\" failed (exit $rc)" >&3' ERR
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
BUNDLE=build/device-bundle
ARGS=()
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --bundle) BUNDLE=$2; shift ;;
    -*) echo "gpu_validate: unknown option '$1'" >&2; exit 2 ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
((${#ARGS[@]} >= 2)) || { sed -n '2,25p' "$0"; exit 2; }
OUT=${ARGS[0]}
STAGES=("${ARGS[@]:1}")
for s in "${STAGES[@]}"; do
  case $s in probe|tests|sanitize|kernels|profile|step|python) ;; *) echo "gpu_validate: unknown stage '$s'" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
SAN_TIMEOUT=${SAN_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}

# Scratch files live outside OUT, whose files all come back (at most 8).
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
# What one command leaves for a later one on the same (warm) machine: the op profile.
KEEP=$ROOT/build/gpu-validate
mkdir -p "$KEEP"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
# record STAGE JSON: appends one line to OUT/STAGE.jsonl.
record() { printf '%s\n' "$2" >> "$OUT/$1.jsonl"; }
json() { python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }

# ---- where the binaries come from ---------------------------------------------------------------
# The bundle carries them as one archive (scripts/device_bundle.sh), unpacked beside it (the
# bundle itself stays as it was carried).
UNPACKED=$ROOT/build/device-bundle-bin
rm -rf "$UNPACKED"
mkdir -p "$UNPACKED"
if [[ -f $ROOT/$BUNDLE/bin.tar.xz ]]; then
  tar -C "$UNPACKED" -xJf "$ROOT/$BUNDLE/bin.tar.xz" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$ROOT/$BUNDLE/bin.tar.xz" "$UNPACKED"
fi
# The CUDA runtime and cuBLAS, each wherever this machine keeps it: the toolkit, the loader's
# cache, or the CUDA wheels of its Python (nvidia/cu13/lib in CUDA 13's layout, nvidia/<lib>/lib
# before). Only ess and the executor's tests need cuBLAS.
# Whether a shared library exists and loads (an empty or foreign file does not).
loads() { [[ -e $1 ]] && python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$1" >/dev/null 2>&1; }
find_cuda_lib() {
  local name=$1 d p cache
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
    loads "$d/$name" && { echo "$d"; return 0; }
  done
  cache=$(ldconfig -p 2>/dev/null || true)
  p=$(awk -v n="$name" '!found && $1 == n {print $NF; found = 1}' <<< "$cache")  # reads to the end: no SIGPIPE
  [[ -n $p ]] && loads "$p" && { dirname "$p"; return 0; }
  python3 - "$name" 2>/dev/null <<'PY' || true
import glob, importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    hits = sorted(glob.glob(os.path.join(root, "*", "lib", sys.argv[1])))
    if hits:
        print(os.path.dirname(hits[0]))
        break
PY
}
CUDART_DIR=$(find_cuda_lib libcudart.so.13)
CUBLAS_DIR=$(find_cuda_lib libcublas.so.13)
CUDA_LIB_PATH=""
for d in "$CUDART_DIR" "$CUBLAS_DIR"; do
  [[ -n $d && ":$CUDA_LIB_PATH:" != *":$d:"* ]] && CUDA_LIB_PATH=${CUDA_LIB_PATH:+$CUDA_LIB_PATH:}$d
done
export LD_LIBRARY_PATH="$ROOT/$BUNDLE/lib${CUDA_LIB_PATH:+:$CUDA_LIB_PATH}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

starts() { "$@" >/dev/null 2>&1; }
needs_cublas() { [[ $(ldd "$1" 2>/dev/null || true) == *libcublas* ]]; }  # no pipe: grep -q would cut ldd off
BIN=$UNPACKED/bin
carried_ok=0
# Programs that cannot start here for want of cuBLAS alone (ess, the executor's tests): the
# stages that need them record why they did not run; everything else goes on.
NO_CUBLAS=()
if [[ -x $BIN/ess ]]; then
  carried_ok=1
  for t in "$BIN/ess" "$BIN"/cuda_*_test; do
    if [[ $t == "$BIN/ess" ]]; then starts "$t" --version && continue; else starts "$t" --gtest_list_tests && continue; fi
    if [[ -z $CUBLAS_DIR ]] && needs_cublas "$t"; then NO_CUBLAS+=("$(basename "$t")"); else carried_ok=0; fi
  done
fi
lacks_cublas() { [[ " ${NO_CUBLAS[*]} " == *" $1 "* ]]; }
if ((${#NO_CUBLAS[@]})); then
  log "cuBLAS (libcublas.so.13) is not on this machine: ${NO_CUBLAS[*]} cannot start; their stages record that they did not run"
fi
if ((!carried_ok)); then
  FB=$ROOT/build/device
  if [[ ! -x $FB/tools/ess/ess ]]; then
    log "carried binaries do not start here: building from source with $BUNDLE/prefix"
    prefix=$ROOT/$BUNDLE/prefix/usr
    [[ -d $prefix ]] || { echo "gpu_validate: no $prefix (scripts/device_bundle.sh without --no-prefix)" >&2; exit 1; }
    if ! cmake -S "$ROOT" -B "$FB" -G Ninja -DCMAKE_BUILD_TYPE=Release -DESS_BUILD_BENCHMARKS=OFF \
      -DCMAKE_PREFIX_PATH="$prefix" >"$OUT/build.log" 2>&1; then
      tail -n 30 "$OUT/build.log" >&2
      echo "gpu_validate: configuring the build from source failed (build.log)" >&2
      exit 1
    fi
    if ! cmake --build "$FB" -j "$(nproc)" >>"$OUT/build.log" 2>&1; then
      tail -n 30 "$OUT/build.log" >&2
      echo "gpu_validate: the build from source failed (build.log)" >&2
      exit 1
    fi
  fi
  BIN=$FB/bin-view
  mkdir -p "$BIN"
  ln -sf "$FB/tools/ess/ess" "$BIN/ess"
  while IFS= read -r t; do ln -sf "$t" "$BIN/"; done < <(find "$FB/src" -type f -name 'cuda_*_test' -perm -u+x)
  [[ -f $FB/src/capi/libess.so ]] && ln -sf "$FB/src/capi/libess.so" "$BIN/libess.so"
fi
ESS=$BIN/ess
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
log "binaries: $BIN ($( ((carried_ok)) && echo carried || echo built here)); CUDA runtime: ${CUDART_DIR:-not found}; cuBLAS: ${CUBLAS_DIR:-not found, and ess and cuda_executor_test need it}"

# ---- stages -------------------------------------------------------------------------------------
stage_probe() {
  local smi="" bins=()
  command -v nvidia-smi >/dev/null && smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm --format=csv,noheader 2>&1 || true)
  for b in "$BIN"/*; do
    local ok=false missing kind=program
    missing=$(ldd "$b" 2>/dev/null | awk '/not found/{print $1}' | tr '\n' ' ' || true)
    case $(basename "$b") in
      *.so|*.so.*) kind=library; [[ -z $missing ]] && ok=true ;;  # a library loads; it is not run
      ess) starts "$b" --version && ok=true ;;
      *) starts "$b" --gtest_list_tests && ok=true ;;
    esac
    bins+=("{\"binary\": \"$(basename "$b")\", \"kind\": \"$kind\", \"starts\": $ok, \"missing_libraries\": $(json "$missing")}")
  done
  local IFS=,
  record probe "{\"stage\": \"probe\", \"date\": \"$STAMP\", \"dry_run\": $( ((DRY)) && echo true || echo false), \
\"gpu\": $(json "${smi:-none}"), \"nvcc\": $(json "$("$NVCC" --version 2>/dev/null | tail -n 1 || echo none)"), \
\"compute_sanitizer\": $(json "$("$SAN" --version 2>/dev/null | tail -n 1 || echo none)"), \
\"cudart\": $(json "${CUDART_DIR:-not found}"), \"cublas\": $(json "${CUBLAS_DIR:-not found}"), \"glibc\": $(json "$(ldd --version 2>&1 | head -n 1)"), \
\"os\": $(json "$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"), \"cores\": $(nproc), \
\"binaries_from\": \"$( ((carried_ok)) && echo bundle || echo source)\", \"binaries\": [${bins[*]}]}"
  { echo "== probe"; echo "$smi"; ldd "$ESS" || true; } >> "$OUT/probe.log" 2>&1
  log "probe: ${smi:-no GPU}"
}

# The device test binaries, cheapest and most basic first (if a command is cut off, what it
# finished is what everything else rests on). Their host runs and the CPU-only tests pass in
# CI; a dry run (or HOST_RUNS=1) runs them too.
DEVICE_TESTS=(cuda_flashtrans_test cuda_swap_engine_test cuda_split_test cuda_offload_test cuda_sparse_mla_test
              cuda_indexer_test cuda_executor_test)

# Every test binary under its own timeout, with gtest's JSON report.
stage_tests() {
  local t name tmp rc start list=()
  for name in "${DEVICE_TESTS[@]}"; do list+=("$BIN/$name"); done
  if ((DRY)) || [[ ${HOST_RUNS:-0} == 1 ]]; then
    for t in "$BIN"/cuda_*_test; do [[ " ${DEVICE_TESTS[*]} " == *" $(basename "$t") "* ]] || list+=("$t"); done
  fi
  tmp=$(mktemp -d)
  for t in "${list[@]}"; do
    name=$(basename "$t")
    [[ -x $t ]] || { echo "gpu_validate: $name missing from $BIN" >&2; exit 1; }
    if lacks_cublas "$name"; then
      record tests "{\"stage\": \"tests\", \"binary\": \"$name\", \"run\": false, \"why\": \"needs libcublas.so.13, which this machine lacks\"}"
      log "tests: $name not run (no cuBLAS here)"
      continue
    fi
    start=$(date +%s)
    set +e
    timeout --kill-after=10 "$TEST_TIMEOUT" "$t" --gtest_output="json:$tmp/$name.json" >> "$OUT/tests.log" 2>&1
    rc=$?
    set -e
    python3 - "$tmp/$name.json" "$name" "$rc" "$(( $(date +%s) - start ))" "$TEST_TIMEOUT" >> "$OUT/tests.jsonl" <<'PY'
import json, sys
path, name, rc, secs, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rec = {"stage": "tests", "binary": name, "exit": rc, "seconds": secs, "timed_out": rc in (124, 137)}
try:
    g = json.load(open(path))
    cases = [(s["name"] + "." + t["name"], t) for s in g.get("testsuites", []) for t in s.get("testsuite", [])]
    # What a test recorded (RecordProperty: worst error over its bound, ...), beside gtest's own fields.
    own = {"name", "file", "line", "status", "result", "timestamp", "time", "classname", "failures", "value_param", "type_param"}
    rec.update(tests=g.get("tests"), failures=g.get("failures"), errors=g.get("errors"),
               skipped=sum(1 for _, t in cases if t.get("result") == "SKIPPED"),
               failed=[n for n, t in cases if t.get("failures")],
               recorded={n: {k: v for k, v in t.items() if k not in own} for n, t in cases if set(t) - own})
except (OSError, ValueError) as e:
    rec["report"] = f"no gtest report ({e.__class__.__name__}): crashed or killed"
print(json.dumps(rec))
PY
    log "tests: $name exit $rc ($(( $(date +%s) - start )) s)"
  done
  rm -rf "$tmp"
  # The stage's verdict. With a device, a device binary's case that skips did not see it.
  python3 - "$OUT/tests.jsonl" "$DRY" >> "$OUT/tests.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"binary"' in l]
not_run = [r["binary"] for r in recs if r.get("run") is False]
recs = [r for r in recs if r.get("run") is not False]
device = [r for r in recs if not r["binary"].endswith("_host_test") and r["binary"].startswith("cuda_")]
summary = {"binaries": len(recs), "not_run": not_run, "failed_binaries": [r["binary"] for r in recs if r["exit"] != 0],
           "failures": sum(r.get("failures") or 0 for r in recs),
           "skipped_in_device_binaries": sum(r.get("skipped") or 0 for r in device)}
summary["ok"] = not summary["failed_binaries"] and (sys.argv[2] == "1" or summary["skipped_in_device_binaries"] == 0)
print(json.dumps({"stage": "tests", "summary": summary}))
PY
  log "tests: $(tail -n 1 "$OUT/tests.jsonl")"
}

# compute-sanitizer on small filters (it runs kernels 10-100x slower). Memcheck: every device
# binary; racecheck and synccheck: the kernels with shared memory and barriers.
SAN_RUNS=(
  "memcheck cuda_flashtrans_test *"
  "memcheck cuda_swap_engine_test *WarmupMatches*:*BitForBit/1:*Smaller*"
  "memcheck cuda_sparse_mla_test *K64_bad*:*K41_some*:*RowLengths*:*MergeStates*"
  "memcheck cuda_indexer_test *B3_T2_H64_exact*:*ReportsTheFirstRow*"
  "memcheck cuda_split_test *SplitShapes*/1:*SplitShapes*/3"
  "memcheck cuda_offload_test *OffloadShapes*/1:*OffloadShapes*/2:*WriteBack*:*EngineBuffer*:*Reset*"
  "memcheck cuda_executor_test executor.OffloadedNoneIsBitIdenticalToResident"
  "racecheck cuda_sparse_mla_test *K64_bad*:*K41_some*"
  "racecheck cuda_swap_engine_test *BitForBit/1:*WarmupMatches*"
  "racecheck cuda_indexer_test *B3_T2_H64_exact*:*ReportsTheFirstRow*"
  "racecheck cuda_split_test *SplitShapes*/1"
  "racecheck cuda_offload_test *OffloadShapes*/1:*WriteBack*"
  "synccheck cuda_sparse_mla_test *K64_bad*:*K41_some*"
  "synccheck cuda_swap_engine_test *BitForBit/1"
  "synccheck cuda_indexer_test *B3_T2_H64_exact*:*ReportsTheFirstRow*"
  "synccheck cuda_split_test *SplitShapes*/1"
  "synccheck cuda_offload_test *OffloadShapes*/1:*WriteBack*"
)
stage_sanitize() {
  local run tool bin filter rc start summary
  local san=$SAN
  for run in "${SAN_RUNS[@]}"; do
    read -r tool bin filter <<< "$run"
    if lacks_cublas "$bin"; then
      record sanitize "{\"stage\": \"sanitize\", \"tool\": \"$tool\", \"binary\": \"$bin\", \"run\": false, \"why\": \"needs libcublas.so.13, which this machine lacks\"}"
      continue
    fi
    local cmd=("$san" --tool "$tool" --error-exitcode 99 --print-limit 50 "$BIN/$bin" "--gtest_filter=$filter" --gtest_brief=1)
    echo "== ${cmd[*]}" >> "$OUT/sanitize.log"
    if ((DRY)) || [[ ! -x $san ]]; then
      [[ -x $BIN/$bin ]] || { echo "gpu_validate: $bin missing from $BIN" >&2; exit 1; }
      record sanitize "{\"stage\": \"sanitize\", \"tool\": \"$tool\", \"binary\": \"$bin\", \"filter\": $(json "$filter"), \"run\": false, \"why\": $(json "$( ((DRY)) && echo 'dry run' || echo "no compute-sanitizer at $san")")}"
      continue
    fi
    start=$(date +%s)
    set +e
    timeout --kill-after=10 "$SAN_TIMEOUT" "${cmd[@]}" > "$SCRATCH/san.out" 2>&1
    rc=$?
    set -e
    cat "$SCRATCH/san.out" >> "$OUT/sanitize.log"
    summary=$(grep -o 'ERROR SUMMARY: [0-9]* error[s]*' "$SCRATCH/san.out" | tail -n 1 || true)
    record sanitize "{\"stage\": \"sanitize\", \"tool\": \"$tool\", \"binary\": \"$bin\", \"filter\": $(json "$filter"), \"run\": true, \"exit\": $rc, \"seconds\": $(( $(date +%s) - start )), \"summary\": $(json "$summary")}"
    log "sanitize: $tool $bin exit $rc ${summary}"
  done
}

# One ess command: its JSON output (or its text) into STAGE.jsonl. In a dry run ess must fail
# only for want of a device (its flags and the configuration it checks first are fine).
ess_run() {
  local stage=$1 name=$2
  shift 2
  local start rc
  echo "== ess $*" >> "$OUT/$stage.log"
  if lacks_cublas ess; then
    record "$stage" "{\"stage\": \"$stage\", \"name\": \"$name\", \"command\": $(json "ess $*"), \"run\": false, \"why\": \"ess needs libcublas.so.13, which this machine lacks\"}"
    log "$stage: $name not run (no cuBLAS here)"
    return 0
  fi
  start=$(date +%s)
  set +e
  timeout --kill-after=10 "$BENCH_TIMEOUT" "$ESS" "$@" > "$SCRATCH/out" 2> "$SCRATCH/err"
  rc=$?
  set -e
  cat "$SCRATCH/out" "$SCRATCH/err" >> "$OUT/$stage.log"
  if ((DRY)); then
    if grep -q "no CUDA device" "$SCRATCH/err" || { [[ $rc == 0 ]] && [[ $name == verify-cpu ]]; }; then
      record "$stage" "{\"stage\": \"$stage\", \"name\": \"$name\", \"command\": $(json "ess $*"), \"run\": false, \"why\": \"dry run: flags and configuration accepted, no device\"}"
    else
      echo "gpu_validate: dry run: 'ess $*' failed other than for want of a device (exit $rc):" >&2
      cat "$SCRATCH/err" >&2
      exit 1
    fi
  else
    python3 - "$SCRATCH/out" "$name" "$rc" "$(( $(date +%s) - start ))" "ess $*" "$stage" >> "$OUT/$stage.jsonl" <<'PY'
import json, sys
path, name, rc, secs, cmd, stage = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
text = open(path).read()
try:
    out = json.loads(text)
except ValueError:
    out = text[-4000:]
print(json.dumps({"stage": stage, "name": name, "command": cmd, "exit": rc, "seconds": secs, "timed_out": rc in (124, 137), "output": out}))
PY
    log "$stage: $name exit $rc ($(( $(date +%s) - start )) s)"
  fi
  rm -f "$SCRATCH/out" "$SCRATCH/err"
}

stage_kernels() {
  ess_run kernels transfer bench transfer --format json --blocks 4,8,16,24,32,48,64,132,264,1056 --concurrent
  ess_run kernels swap bench swap --format json
  ess_run kernels attention bench attention --format json --batches 1,2,8,32,64,128
  ess_run kernels indexer-32k bench indexer --format json --requests 64 --context 32768
  ess_run kernels indexer-128k bench indexer --format json --requests 16 --context 131072
  ess_run kernels verify-cuda verify --backend cuda --format json
  ess_run kernels verify-cuda-reserved verify --backend cuda --reserve-newest --mtp 3 --format json
  ess_run kernels verify-cuda-groups verify --backend cuda --mtp 4 --topk 128 --slots 160 --format json
  # The paper's MTP-4 deployment: top-2048 over 20 % of a 32K context (about 20 s of host work).
  ess_run kernels verify-cuda-mtp4-k2048 verify --backend cuda --mtp 4 --topk 2048 --context 32768 --ratio 0.2 \
    --requests 2 --layers 2 --steps 3 --reserve-newest --format json
}

# The op table `ess sim --rig-layers` reads; a copy stays on this machine for the step stage
# of a later command.
stage_profile() {
  ess_run profile profile bench profile --out "$OUT/profile"
  local f
  for f in "$OUT"/profile-*.csv "$OUT"/profile-*.json "$OUT"/profile.json; do
    [[ -f $f ]] && cp "$f" "$KEEP/"
  done
  return 0
}

stage_step() {
  local hw="$KEEP/profile-hardware.json" table="$KEEP/profile-ops.csv" pred=()
  if [[ -f $hw && -f $table ]]; then
    pred=(--profile-hardware "$hw" --profile-table "$table")
  else
    record step "{\"stage\": \"step\", \"note\": \"no op profile in $KEEP (run the profile stage first on this machine): no predictions\"}"
  fi
  # Each point is appended to step.jsonl as soon as it is measured (--points).
  ess_run step step bench step --format json --batch 1,2,16,64,128 --points "$OUT/step.jsonl" "${pred[@]}"
}

# The Python package (python/, in the work tree) on this libess: its pytest suite, whose CUDA
# cases (torch CUDA tensors, the CUDA backend, a CUDA graph) run where torch sees the GPU, and
# the engine-loop example.
stage_python() {
  local py="" cand rc start lib=$BIN/libess.so
  for cand in python3 /usr/bin/python3; do
    command -v "$cand" >/dev/null && "$cand" -c 'import numpy, pytest' 2>/dev/null && { py=$cand; break; }
  done
  if [[ -z $py || ! -e $lib ]]; then
    record python "{\"stage\": \"python\", \"run\": false, \"why\": $(json "$([[ -z $py ]] && echo 'no python3 with numpy and pytest' || echo "no $lib")")}"
    return
  fi
  for item in pytest example example-cuda; do
    if [[ $item == example-cuda ]] && ((DRY)); then
      record python "{\"stage\": \"python\", \"name\": \"$item\", \"run\": false, \"why\": \"dry run: no device\"}"
      continue
    fi
    start=$(date +%s)
    set +e
    case $item in
      pytest)
        ESS_LIBRARY=$lib timeout --kill-after=10 "$TEST_TIMEOUT" "$py" -m pytest -q -rs -p no:cacheprovider \
          "$ROOT/python/tests" > "$SCRATCH/py.out" 2>&1 ;;
      example)
        ESS_LIBRARY=$lib timeout --kill-after=10 "$TEST_TIMEOUT" "$py" "$ROOT/examples/engine_loop.py" --format json \
          > "$SCRATCH/py.out" 2>&1 ;;
      example-cuda)  # the CUDA backend, torch CUDA tensors: bit-identical to attention over the full cache
        ESS_LIBRARY=$lib timeout --kill-after=10 "$TEST_TIMEOUT" "$py" "$ROOT/examples/engine_loop.py" --backend cuda \
          --format json > "$SCRATCH/py.out" 2>&1 ;;
    esac
    rc=$?
    set -e
    cat "$SCRATCH/py.out" >> "$OUT/python.log"
    record python "{\"stage\": \"python\", \"name\": \"$item\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - start )), \"python\": $(json "$("$py" --version 2>&1)"), \"tail\": $(json "$(tail -n 15 "$SCRATCH/py.out")")}"
    log "python: $item exit $rc"
  done
}

for s in "${STAGES[@]}"; do
  log "stage $s"
  rm -f "$OUT/$s.jsonl" "$OUT/$s.log"  # a stage's files hold one run
  "stage_$s"
done
log "done: results in $OUT"
