#!/usr/bin/env bash
# Installs the Debian packages the build and tests need (idempotent; needs root or sudo when
# something is missing). CUDA is optional: when /usr/local/cuda/bin/nvcc exists the CUDA
# target is built as well.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build   # toolchain
  ccache                              # every compile of scripts/test.sh cached (~/.cache/ccache): a rerun compiles what changed
  libfmt-dev                          # formatting of messages and tables
  nlohmann-json3-dev                  # model / profile / trace metadata JSON
  libcli11-dev                        # the `ess` command line
  libgtest-dev libgmock-dev           # unit, property and soak tests
  libboost-context-dev                # Boost.Context fibers: the CTA emulator runs kernels' device code on the CPU
  libbenchmark-dev                    # CPU benchmarks
  libbenchmark-tools                  # Google Benchmark's compare.py (gbench): scripts/bench_compare.sh's U test
  libtbb-dev                          # oneTBB: parallel trace replay (ess trace analyze)
  python3-numpy                       # python/ess_trace.py writer; Python -> C++ trace round-trip test
  python3-matplotlib                  # scripts/plot_trace_analysis.py figures
  clang-14 libclang-rt-14-dev         # libFuzzer target of the trace reader (scripts/fuzz.sh)
  xz-utils                            # the device bundle packs its binaries into one xz archive
  libdlpack-dev                       # DLPack: the C ABI's tensor type (libess.so, the Python package)
  python3-pytest python3-pip python3-venv  # the Python package's tests; pip install . (its wheel, in a venv)
  python3-torch                       # CPU torch: the SGLang adapter's replay of SGLang's decode loop
  python3-pycparser                   # ess_c.h parsed: the Python package's ctypes declarations checked against it
  unzip                               # scripts/upstream.sh unpacks the pinned SGLang and vLLM wheels' sources
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all build packages present"
fi
