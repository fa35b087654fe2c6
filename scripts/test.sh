#!/usr/bin/env bash
# The test command: sets up, builds, and runs every test twice: once in the release build
# (CUDA target included when nvcc exists; GPU tests skip themselves without a device) and
# once under AddressSanitizer + UndefinedBehaviorSanitizer; in between, the installed
# package (cmake --install, then examples/consumer built against it and run; the Python
# wheel built with pip, installed into a fresh venv, its tests, example and `ess` run there), the GPU
# bring-up kit (device bundle, its fallback configure check, a dry run of the GPU
# validation, and that dry run again where cuBLAS is hidden) and a short libFuzzer run of the trace reader. The pinned SGLang release is downloaded
# first (scripts/upstream.sh): the SGLang and vLLM adapters are tested against their sources.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

bash scripts/setup.sh
bash scripts/upstream.sh   # the pinned SGLang and vLLM releases' sources, for the adapters' tests

# The official safetensors reader, for the trace reader's cross-check (tests/trace): every file it
# refuses, ess must refuse.
if [[ ! -x build/venv-safetensors/bin/python ]]; then
  /usr/bin/python3 -m venv --system-site-packages build/venv-safetensors
fi
build/venv-safetensors/bin/pip install -q safetensors==0.8.0

echo "== release build =="
cmake --preset release -DESS_SAFETENSORS_PYTHON="$PWD/build/venv-safetensors/bin/python" >/dev/null
cmake --build --preset release -j "$JOBS"
ctest --preset release -j "$JOBS"

echo "== installed package: examples/consumer against cmake --install =="
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/release --prefix "$prefix/ess" >/dev/null
cmake -S examples/consumer -B "$prefix/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/ess" >/dev/null
cmake --build "$prefix/consumer"
"$prefix/consumer/ess_consumer"
test -x "$prefix/ess/bin/ess"

echo "== Python wheel: pip wheel . in a fresh venv, installed into another, tested from outside the checkout =="
# The wheel compiles libess and the ess program once more (no tests, no benchmarks; build/wheel is kept,
# so a second run only relinks what changed). The venv it is installed into sees Debian's numpy, pytest and
# torch (--system-site-packages) but no ess: the tests, the example and `ess` run on the installed package.
checkout=$PWD
/usr/bin/python3 -m venv "$prefix/venv-build"
"$prefix/venv-build/bin/pip" wheel -q --no-deps -w "$prefix/dist" --config-settings=build-dir=build/wheel .
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

echo "== GPU bring-up kit: device bundle, fallback configure check, validation dry run =="
if ./build/release/tools/ess/ess --version | grep -q "CUDA target: built"; then
  bash scripts/device_bundle.sh --no-build --check-fallback=configure
  bash scripts/gpu_validate.sh --dry-run build/gpu-validate-dry-run probe tests sanitize kernels profile step python
  bash scripts/check_kit_without_cublas.sh build/gpu-validate-no-cublas
else
  echo "skipped: this build has no CUDA target (nvcc not found)"
fi

echo "== fuzz: trace reader (${FUZZ_SECONDS:-45} s) =="
bash scripts/fuzz.sh "${FUZZ_SECONDS:-45}"

echo "== ASan + UBSan build =="
cmake --preset asan -DESS_SAFETENSORS_PYTHON="$PWD/build/venv-safetensors/bin/python" >/dev/null
cmake --build --preset asan -j "$JOBS"
ctest --preset asan -j "$JOBS"
