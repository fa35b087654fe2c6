#!/usr/bin/env bash
# The test command: sets up, builds, and runs every test twice: once in the release build
# (CUDA target included when nvcc exists; GPU tests skip themselves without a device) and
# once under AddressSanitizer + UndefinedBehaviorSanitizer; in between, the installed
# package (cmake --install, then examples/consumer built against it and run; the Python
# wheel built with pip, installed into a fresh venv, its tests, example and `ess` run there), the GPU
# bring-up kit (device bundle, its fallback configure check, a dry run of the GPU validation, and
# that dry run again where cuBLAS is hidden) and a short libFuzzer run of the trace reader. The
# pinned SGLang and vLLM releases are downloaded first (scripts/upstream.sh): the adapters are
# tested against their sources, and, in each engine's own venv (scripts/engines.sh: PyPI's torch, the
# engine, what its CPU-side modules import), among the engine's own classes.
#
# Every compile goes through ccache (Debian's, cached under ~/.cache/ccache; CCACHE_DIR moves it):
# the wheel compiles the release build's sources with its flags, so it reuses their objects, and a
# second run compiles nothing that did not change. Each stage's time is printed at the end, and
# each ctest run lists its slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

STAGES=()
stage_start=$SECONDS
# stage NAME: closes the previous stage's timing and starts NAME's.
stage() {
  if ((${#STAGES[@]})); then STAGES[-1]="${STAGES[-1]}|$((SECONDS - stage_start))"; fi
  STAGES+=("$1")
  stage_start=$SECONDS
  echo "== $1 =="
}
report_stages() {
  if ((${#STAGES[@]})); then STAGES[-1]="${STAGES[-1]}|$((SECONDS - stage_start))"; fi
  echo "== stage times (total $((SECONDS / 60)) min $((SECONDS % 60)) s) =="
  local s
  for s in "${STAGES[@]}"; do printf '  %6d s  %s\n' "${s##*|}" "${s%|*}"; done
  if command -v ccache >/dev/null; then ccache --show-stats 2>/dev/null | grep -iE "hits|misses|cache size" | sed 's/^/  ccache: /' || true; fi
}
# slowest LOG: the 20 longest tests of a ctest run's output.
slowest() {
  echo "slowest tests:"
  # awk, not head: a reader that stops early would end sort with SIGPIPE, a failure under pipefail.
  sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/p' "$1" | sort -rn |
    awk 'NR <= 20 {printf "  %8.2f s  %s\n", $1, $2}'
}

stage "setup: Debian packages, the pinned engine releases, safetensors"
bash scripts/setup.sh
bash scripts/upstream.sh   # the pinned SGLang and vLLM releases' sources, for the adapters' tests

# The official safetensors reader, for the trace reader's cross-check (tests/trace): every file it
# refuses, ess must refuse.
if [[ ! -x build/venv-safetensors/bin/python ]]; then
  /usr/bin/python3 -m venv --system-site-packages build/venv-safetensors
fi
build/venv-safetensors/bin/pip install -q safetensors==0.8.0

# ccache for every compile: CMake takes the launchers from the environment; paths under the
# checkout are hashed relative to it, so two build folders of one checkout share objects. ccache
# hashes the compiler's name too: CC and CXX name the compilers CMake picks by default, which the
# wheel's build backend would otherwise replace with Python's (x86_64-linux-gnu-g++, the same
# compiler under another name).
export CC=${CC:-cc} CXX=${CXX:-c++}
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
  ccache --zero-stats >/dev/null
fi
logs=$(mktemp -d)
prefix=$(mktemp -d)
trap 'rm -rf "$prefix" "$logs"' EXIT

stage "release build"
cmake --preset release -DESS_SAFETENSORS_PYTHON="$PWD/build/venv-safetensors/bin/python" >/dev/null
cmake --build --preset release -j "$JOBS"

stage "release tests"
ctest --preset release -j "$JOBS" --timeout 1200 | tee "$logs/release.log"
slowest "$logs/release.log"

stage "engines: the adapters among SGLang 0.5.23's and vLLM 0.33.0's own classes (their venvs, cached)"
# scripts/engines.sh builds each engine's venv once per lock (wheels cached under ~/.cache/ess); the tests
# under python/tests/engines/<engine> import the engine itself: a failed import fails the stage.
# In vLLM's venv the vLLM replays run again over vLLM's own imported classes (vllm_upstream.load, which
# compiles them from the release's source for the plain suite).
engines=$(bash scripts/engines.sh)   # a failed build stops here (set -e)
while read -r engine python; do
  tests=("python/tests/engines/$engine")
  if [[ $engine == vllm ]]; then tests+=(python/tests/test_vllm_replay.py python/tests/test_vllm_runtime.py); fi
  (cd "$logs" && ESS_ENGINE=$engine "$python" -m pytest -q -p no:cacheprovider "${tests[@]/#/$OLDPWD/}")
done <<<"$engines"

stage "installed package: examples/consumer against cmake --install"
cmake --install build/release --prefix "$prefix/ess" >/dev/null
cmake -S examples/consumer -B "$prefix/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/ess" >/dev/null
cmake --build "$prefix/consumer"
"$prefix/consumer/ess_consumer"
test -x "$prefix/ess/bin/ess"

stage "Python wheel: pip wheel . in a fresh venv, installed into another, tested from outside the checkout"
# The wheel's CMake compiles libess and the ess program with the release build's flags (-Werror
# included), so ccache hands it the release build's objects; build/wheel is kept, so a second run
# only relinks what changed. The venv it is installed into sees Debian's numpy, pytest and torch
# (--system-site-packages) but no ess: the tests, the example and `ess` run on the installed package.
checkout=$PWD
/usr/bin/python3 -m venv "$prefix/venv-build"
"$prefix/venv-build/bin/pip" wheel -q --no-deps -w "$prefix/dist" --config-settings=build-dir=build/wheel \
  --config-settings=cmake.define.ESS_WERROR=ON .
/usr/bin/python3 -m venv --system-site-packages "$prefix/venv"
"$prefix/venv/bin/pip" install -q "$prefix"/dist/ess-*.whl
mkdir "$prefix/examples" && cp examples/engine_loop.py "$prefix/examples/"
(
  cd "$prefix"
  unset ESS_LIBRARY
  export PATH="$prefix/venv/bin:$PATH"
  python -c "import ess, ess.integrations.sglang, ess.integrations.vllm, ess_trace; print('ess', ess.__version__, ess.library_path)"
  ESS_TEST_INSTALLED=1 python -m pytest -q -p no:cacheprovider "$checkout/python/tests"
  python examples/engine_loop.py --steps 4 --format json | python -c "
import json, sys; r = json.load(sys.stdin)
assert r['bitwise_equal'] and r['library'].startswith('$prefix/venv/'), r"
  ess --version
  ess sim --batch 64 >/dev/null
)
/usr/bin/python3 examples/engine_loop.py --steps 4   # the checkout's package finds build/release's libess itself

stage "GPU bring-up kit: device bundle, fallback configure check, validation dry run"
if ./build/release/tools/ess/ess --version | grep -q "CUDA target: built"; then
  bash scripts/device_bundle.sh --no-build --check-fallback=configure
  python3 scripts/gpu_validate.py --dry-run build/gpu-validate-dry-run probe tests sanitize kernels profile step python
  bash scripts/check_kit_without_cublas.sh build/gpu-validate-no-cublas
else
  echo "skipped: this build has no CUDA target (nvcc not found)"
fi

stage "fuzz: trace reader (${FUZZ_SECONDS:-45} s)"
bash scripts/fuzz.sh "${FUZZ_SECONDS:-45}"

stage "ASan + UBSan build"
cmake --preset asan -DESS_SAFETENSORS_PYTHON="$PWD/build/venv-safetensors/bin/python" >/dev/null
cmake --build --preset asan -j "$JOBS"

stage "ASan + UBSan tests"
ctest --preset asan -j "$JOBS" --timeout 1200 | tee "$logs/asan.log"
slowest "$logs/asan.log"

report_stages
