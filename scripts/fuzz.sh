#!/usr/bin/env bash
# Builds the trace-reader fuzz target (tests/trace/fuzz) with Debian's clang-14 + libFuzzer and
# runs it briefly: scripts/fuzz.sh [SECONDS] (default 45, or $FUZZ_SECONDS). Exits 0 with a
# message when clang-14 is not installed; non-zero when the fuzzer finds a crash (the input is
# left in build/fuzz/ as crash-*).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_SECONDS=${1:-${FUZZ_SECONDS:-45}}
JOBS=${JOBS:-$(nproc)}
if ! command -v clang++-14 >/dev/null 2>&1; then
  echo "fuzz: clang++-14 is not installed (Debian: clang-14 libclang-rt-14-dev); skipped"
  exit 0
fi
BUILD=build/fuzz
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DESS_CUDA=OFF -DESS_FUZZ=ON -DESS_BUILD_BENCHMARKS=OFF -DESS_WERROR=OFF \
  "-DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer" >/dev/null
cmake --build "$BUILD" --target trace_reader_fuzz -j "$JOBS"

# Seed corpus: small valid traces (the fuzzer keeps what it finds in the corpus folder), plus
# tests/trace/fuzz/corpus/: the inputs of past findings (regression-*) and the structural cases
# of make_structure_cases.py (structure-*: holes, trailing bytes, overlapping tensors, ...).
CORPUS="$BUILD/fuzz-corpus"
mkdir -p "$CORPUS"
python3 - "$CORPUS" <<'PY'
import json, struct, sys
out = sys.argv[1]
def trace(name, steps, layers, mtp, topk, length, prefill=0):
    md = {"ess.format": "ess-topk-trace", "ess.version": "1", "ess.requests": "1", "ess.layers": str(layers),
          "ess.mtp": str(mtp), "ess.topk": str(topk), "ess.model": "seed", "ess.provenance": "fuzz seed",
          "ess.synthetic": "true", "requests.0.context": str(length)}
    ids = [(s + l + t * 3 + k * 5) % length if k < length else -1
           for s in range(steps) for l in range(layers) for t in range(mtp) for k in range(topk)]
    # Make every query row distinct ids.
    rows = []
    for r in range(steps * layers * mtp):
        row = [(r + 7 * k) % length for k in range(min(topk, length))] + [-1] * max(0, topk - length)
        rows += row
    data = struct.pack(f"<{len(rows)}i", *rows)
    h = {"__metadata__": md,
         "requests.0.topk": {"dtype": "I32", "shape": [steps, layers, mtp, topk], "data_offsets": [0, len(data)]}}
    lengths = struct.pack(f"<{steps}q", *[length] * steps)
    h["requests.0.lengths"] = {"dtype": "I64", "shape": [steps], "data_offsets": [len(data), len(data) + len(lengths)]}
    data += lengths
    if prefill:
        pf = struct.pack(f"<{layers * prefill * topk}i",
                         *[((w + 3 * k) % length if k < length else -1) for _ in range(layers) for w in range(prefill) for k in range(topk)])
        h["requests.0.prefill_topk"] = {"dtype": "I32", "shape": [layers, prefill, topk],
                                        "data_offsets": [len(data), len(data) + len(pf)]}
        data += pf
    text = json.dumps(h).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    open(f"{out}/{name}", "wb").write(struct.pack("<Q", len(text)) + text + data)
trace("seed-small", 3, 2, 2, 4, 11, prefill=2)
trace("seed-padded", 2, 1, 1, 8, 5)
trace("seed-wide", 4, 3, 1, 16, 40, prefill=1)
PY
echo "fuzz: running trace_reader_fuzz for ${RUN_SECONDS} s"
"$BUILD/tests/trace/fuzz/trace_reader_fuzz" -max_total_time="$RUN_SECONDS" -max_len=16384 -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix="$BUILD/" -print_final_stats=1 "$CORPUS" tests/trace/fuzz/corpus
