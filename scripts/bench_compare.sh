#!/usr/bin/env bash
# Compares the CPU benchmarks of two commits in one run, on one machine:
#
#   scripts/bench_compare.sh [options] BASE [HEAD]
#
# Builds the Google Benchmark programs of BASE and HEAD (Release, no CUDA, no tests) in git
# worktrees of their own under a cache folder (a commit already built is reused), runs every
# selected benchmark interleaved, BASE then HEAD, round after round, and prints per benchmark
# the median time of each side and HEAD's speed relative to BASE with its spread over the
# rounds, beside Google Benchmark's own comparison (compare.py's U test). `python_overhead` is
# bench/python_overhead.py on each side's libess.so (the Python per-layer call). Writes the
# results as JSON. Exits 1 when a benchmark named in the gate list
# (bench/hot_paths.txt: the hot paths and the slowest ratio they may show) is slower than that.
# How to read the output: docs/benchmarks.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/bench_compare.sh [options] BASE [HEAD]

  BASE, HEAD      commits (anything git rev-parse accepts); HEAD defaults to HEAD.
                  '.' stands for this checkout's working tree, uncommitted changes included.
  -n, --runs N    interleaved rounds, each running every benchmark once per side (default 5)
  -f, --filter R  Google Benchmark filter (regex) choosing the benchmarks
                  (default: the benchmarks named in the gate list)
  -b, --bench L   comma-separated benchmark programs
                  (default: swap_engine_bench,offload_step_bench,prefix_admission_bench,trace_replay_bench,
                  python_overhead: bench/python_overhead.py on the side's libess.so)
  --list FILE     gate list (default: bench/hot_paths.txt)
  --no-gate       report only: exit 0 whatever the ratios
  --build-only    build both sides, print their build folders, run nothing
  --min-time S    --benchmark_min_time of each run (seconds; default: Google Benchmark's)
  --cache DIR     worktrees and builds (default: $ESS_BENCH_CACHE, else
                  ${XDG_CACHE_HOME:-~/.cache}/ess-bench-compare)
  --json FILE     results file (default: CACHE/last.json)
  -j, --jobs N    build parallelism (default: $JOBS, else nproc)
  -h, --help      this text

Exit status: 0 all gated benchmarks within the list's ratio, 1 one or more slower,
2 bad arguments or list, 3 a build failed.
EOF
}

die() { echo "bench_compare: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=5
FILTER=""
BENCHES="swap_engine_bench,offload_step_bench,prefix_admission_bench,trace_replay_bench,python_overhead"
LIST="$ROOT/bench/hot_paths.txt"
GATE=1
BUILD_ONLY=0
MIN_TIME=""
CACHE=${ESS_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ess-bench-compare}
JSON=""
JOBS=${JOBS:-$(nproc)}
POSITIONAL=()

need_value() { [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -n|--runs) need_value "$@"; RUNS=$2; shift 2 ;;
    -f|--filter) need_value "$@"; FILTER=$2; shift 2 ;;
    -b|--bench) need_value "$@"; BENCHES=$2; shift 2 ;;
    --list) need_value "$@"; LIST=$2; shift 2 ;;
    --no-gate) GATE=0; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --min-time) need_value "$@"; MIN_TIME=$2; shift 2 ;;
    --cache) need_value "$@"; CACHE=$2; shift 2 ;;
    --json) need_value "$@"; JSON=$2; shift 2 ;;
    -j|--jobs) need_value "$@"; JOBS=$2; shift 2 ;;
    --) shift; POSITIONAL+=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done

[[ ${#POSITIONAL[@]} -ge 1 ]] || die "missing BASE: the commit to compare against (see --help)"
[[ ${#POSITIONAL[@]} -le 2 ]] || die "too many commits: '${POSITIONAL[*]}' (BASE and at most one HEAD)"
[[ "$RUNS" =~ ^[0-9]+$ ]] && (( RUNS >= 2 && RUNS <= 1000 )) || die "--runs '$RUNS' must be an integer in [2, 1000]"
[[ "$JOBS" =~ ^[0-9]+$ ]] && (( JOBS >= 1 )) || die "--jobs '$JOBS' must be a positive integer"
if [[ -n "$MIN_TIME" ]]; then
  [[ "$MIN_TIME" =~ ^[0-9]*\.?[0-9]+$ ]] || die "--min-time '$MIN_TIME' must be a number of seconds"
fi
[[ "$BENCHES" =~ ^[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*$ ]] || die "--bench '$BENCHES' must be comma-separated program names"
[[ -f "$LIST" ]] || die "gate list '$LIST' not found"
PY=/usr/bin/python3
[[ -x "$PY" ]] || PY=python3
# The list is checked before anything is built: a bad line is refused now, not after the builds.
"$PY" "$ROOT/scripts/bench_compare.py" check-list --list "$LIST"

BASE_REF=${POSITIONAL[0]}
HEAD_REF=${POSITIONAL[1]:-HEAD}
resolve() {  # ref -> commit id, or "worktree" for '.'
  if [[ "$1" == "." ]]; then echo worktree; return; fi
  git -C "$ROOT" rev-parse --verify --quiet "$1^{commit}" || die "'$1' is not a commit of $ROOT"
}
BASE_ID=$(resolve "$BASE_REF")
HEAD_ID=$(resolve "$HEAD_REF")
[[ "$BASE_ID" != "$HEAD_ID" ]] || echo "bench_compare: note: BASE and HEAD are the same commit ($BASE_ID): an A/A run, the spread is the noise"

mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
JSON=${JSON:-$CACHE/last.json}

# ID -> the source folder of that side.
source_of() { if [[ "$1" == worktree ]]; then echo "$ROOT"; else echo "$CACHE/$1/src"; fi; }

# build ID -> prints the folder holding that commit's benchmark programs.
build() {
  local id=$1 src bdir
  if [[ "$id" == worktree ]]; then
    src=$ROOT
    bdir=$CACHE/worktree-$(printf '%s' "$ROOT" | cksum | cut -d' ' -f1)/build
  else
    src=$CACHE/$id/src
    bdir=$CACHE/$id/build
    if [[ ! -e "$src/.git" ]]; then
      rm -rf "$src"
      git -C "$ROOT" worktree prune
      git -C "$ROOT" worktree add --detach --quiet "$src" "$id" >&2
    fi
  fi
  if [[ ! -f "$bdir/CMakeCache.txt" ]]; then
    cmake -S "$src" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DESS_CUDA=OFF \
      -DESS_BUILD_TESTS=OFF -DESS_BUILD_BENCHMARKS=ON -DESS_WERROR=OFF >"$bdir.configure.log" 2>&1 ||
      { echo "bench_compare: configuring $id failed; see $bdir.configure.log" >&2; exit 3; }
  fi
  # Only the programs this commit has (an older commit may lack some).
  local targets=() all
  all=$(cmake --build "$bdir" --target help 2>/dev/null)
  local b
  for b in ${BENCHES//,/ }; do
    if [[ $b == python_overhead ]]; then  # the script runs on the side's C ABI library
      if grep -q "^ess_c:" <<<"$all"; then targets+=(ess_c); fi
    elif grep -q "^$b:" <<<"$all"; then targets+=("$b"); fi
  done
  if [[ ${#targets[@]} -gt 0 ]]; then
    echo "bench_compare: building ${targets[*]} of $id in $bdir" >&2
    cmake --build "$bdir" --target "${targets[@]}" -j "$JOBS" >"$bdir.build.log" 2>&1 ||
      { echo "bench_compare: building $id failed; see $bdir.build.log" >&2; tail -20 "$bdir.build.log" >&2; exit 3; }
  fi
  echo "$bdir"
}
BASE_DIR=$(build "$BASE_ID")
HEAD_DIR=$(build "$HEAD_ID")
if [[ $BUILD_ONLY -eq 1 ]]; then
  echo "BASE $BASE_REF: $BASE_DIR"
  echo "HEAD $HEAD_REF: $HEAD_DIR"
  exit 0
fi

args=(run --list "$LIST" --runs "$RUNS" --benches "$BENCHES" --json "$JSON"
      --base-ref "$BASE_REF" --base-id "$BASE_ID" --base-dir "$BASE_DIR" --base-src "$(source_of "$BASE_ID")"
      --head-ref "$HEAD_REF" --head-id "$HEAD_ID" --head-dir "$HEAD_DIR" --head-src "$(source_of "$HEAD_ID")")
[[ -n "$FILTER" ]] && args+=(--filter "$FILTER")
[[ -n "$MIN_TIME" ]] && args+=(--min-time "$MIN_TIME")
[[ $GATE -eq 1 ]] || args+=(--no-gate)
exec "$PY" "$ROOT/scripts/bench_compare.py" "${args[@]}"
