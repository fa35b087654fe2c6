#!/usr/bin/env bash
# scripts/bench_compare.sh's argument handling and its gate list, without building or timing
# anything: bad arguments and bad lists are refused by name (exit 2), and every benchmark the
# list names exists in this build's programs.
#   bench_compare_args_test.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
SRC=$1
BUILD=$2
SCRIPT="$SRC/scripts/bench_compare.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0

# expect_refusal "what" "message part" args...: exit status 2 and the message on stderr.
expect_refusal() {
  local what=$1 want=$2
  shift 2
  bash "$SCRIPT" --cache "$tmp/cache" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [[ $rc -ne 2 ]] || ! grep -qF -- "$want" "$tmp/err"; then
    echo "FAIL: $what: exit $rc (want 2), stderr: $(cat "$tmp/err")"
    fails=$((fails + 1))
  fi
}

expect_refusal "no BASE" "missing BASE"
expect_refusal "three commits" "too many commits" a b c
expect_refusal "unknown option" "unknown option '--bogus'" --bogus HEAD
expect_refusal "--runs 1" "--runs '1' must be an integer in [2, 1000]" --runs 1 HEAD
expect_refusal "--runs x" "--runs 'x'" --runs x HEAD
expect_refusal "--runs without value" "option --runs needs a value" HEAD --runs
expect_refusal "--min-time" "--min-time 'soon'" --min-time soon HEAD
expect_refusal "--bench" "--bench 'a b'" --bench "a b" HEAD
expect_refusal "missing list" "gate list '$tmp/none.txt' not found" --list "$tmp/none.txt" HEAD
printf 'BM_A\n' >"$tmp/no_threshold.txt"
expect_refusal "list without threshold" "no 'threshold R' line" --list "$tmp/no_threshold.txt" HEAD
printf 'threshold 0.9\nBM_A\nBM_A\n' >"$tmp/twice.txt"
expect_refusal "name listed twice" "twice.txt:3: 'BM_A' is listed twice" --list "$tmp/twice.txt" HEAD
printf 'threshold 0\nBM_A\n' >"$tmp/zero.txt"
expect_refusal "threshold 0" "zero.txt:1: threshold 0.0 outside (0, 10]" --list "$tmp/zero.txt" HEAD
expect_refusal "unknown commit" "'no-such-commit-xyz' is not a commit" no-such-commit-xyz

bash "$SCRIPT" --help | grep -q "usage: scripts/bench_compare.sh" || { echo "FAIL: --help"; fails=$((fails + 1)); }

# The checked-in list against this build's programs.
PY=/usr/bin/python3
[[ -x $PY ]] || PY=python3
if ! "$PY" "$SRC/scripts/bench_compare.py" check-list --list "$SRC/bench/hot_paths.txt" --dir "$BUILD" --src "$SRC"; then
  echo "FAIL: bench/hot_paths.txt names a benchmark this build lacks"
  fails=$((fails + 1))
fi
printf 'threshold 0.9\nBM_NoSuchBenchmark\n' >"$tmp/unknown.txt"
if "$PY" "$SRC/scripts/bench_compare.py" check-list --list "$tmp/unknown.txt" --dir "$BUILD" 2>"$tmp/err"; then
  echo "FAIL: a list naming BM_NoSuchBenchmark was accepted"
  fails=$((fails + 1))
fi

[[ $fails -eq 0 ]] && echo "bench_compare arguments: all checks passed"
exit $((fails > 0))
