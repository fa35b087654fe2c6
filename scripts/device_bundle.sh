#!/usr/bin/env bash
# Builds here what a GPU validation run needs and collects it into one folder that travels to
# a bare GPU machine (scripts/gpu_validate.py; docs/gpu-validation.md):
#
#   DIR/bin.tar.xz ess, every kernel test binary (device runs and host runs) and libess.so, one solid xz
#                  archive: the binaries share most of their code (the runtime and harness are
#                  linked into each), so the archive is a tenth of their size; gpu_validate.py
#                  unpacks it to DIR/bin there (tar, or Python's tarfile where xz is missing)
#   DIR/lib/       every shared library they load beyond glibc, libstdc++, libgcc and the
#                  CUDA driver / toolkit (libfmt, oneTBB, ...)
#   DIR/prefix/    the fallback if a carried binary does not start there: the headers,
#                  libraries and CMake package files of our Debian -dev packages, unpacked
#                  from their .deb files (use with -DCMAKE_PREFIX_PATH=DIR/prefix/usr)
#   DIR/manifest.json   sha256 and size of every file; per binary its ldd output and the
#                  newest GLIBC / GLIBCXX / CXXABI symbol versions it requires; the build
#                  (commit, compiler, nvcc, CUDA architectures, OS)
#
# Usage: scripts/device_bundle.sh [DIR] [--no-build] [--no-prefix] [--check-fallback[=configure]]
#   DIR               default build/device-bundle (ignored by git; carry it to the device)
#   --no-build        collect from the existing build/release instead of building it
#   --no-prefix       skip the fallback prefix (no .deb downloads)
#   --check-fallback  prove the fallback: configure and build ess and the executor's and swap
#                     engine's tests with only DIR/prefix able to satisfy find_package (the
#                     system prefixes ignored, and the system's copies of those packages hidden
#                     in a private mount namespace when unshare(1) allows it), then check that
#                     no header or library of them came from the system and run the result;
#                     =configure stops after the configure step (CI: every find_package
#                     resolves from the bundle)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DIR=build/device-bundle
BUILD=1 PREFIX=1 CHECK=0
for arg in "$@"; do
  case $arg in
    --no-build) BUILD=0 ;;
    --no-prefix) PREFIX=0 ;;
    --check-fallback) CHECK=2 ;;
    --check-fallback=configure) CHECK=1 ;;
    -*) echo "device_bundle: unknown option '$arg'" >&2; exit 2 ;;
    *) DIR=$arg ;;
  esac
done
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
RELEASE=build/release
LIMIT_MIB=48  # the work tree and the bundle travel together, 64 MiB in all

# The -dev packages of the build (scripts/setup.sh) and the runtime libraries their CMake
# package files name, as installed here.
DEB_PACKAGES=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
              libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libdlpack-dev)

if ((BUILD)); then
  cmake --preset release >/dev/null
  cmake --build --preset release -j "${JOBS:-$(nproc)}"
fi
[[ -x $RELEASE/tools/ess/ess ]] || { echo "device_bundle: no $RELEASE/tools/ess/ess (build first)" >&2; exit 1; }
"$RELEASE/tools/ess/ess" --version | grep -q "CUDA target: built" ||
  { echo "device_bundle: $RELEASE was built without the CUDA target (nvcc missing?)" >&2; exit 1; }

rm -rf "$DIR/bin" "$DIR/bin.tar.xz" "$DIR/lib" "$DIR/manifest.json"
mkdir -p "$DIR/bin" "$DIR/lib"
cp "$RELEASE/tools/ess/ess" "$DIR/bin/"
# The kernel tests live beside their sources (src/runtime/ops/<op>, src/runtime/offload, src/harness/rig).
while IFS= read -r t; do cp "$t" "$DIR/bin/"; done < <(find "$RELEASE/src" -type f -name 'cuda_*_test' -perm -u+x | sort)
# The C ABI's library, for the Python package's tests there (gpu_validate.py's python stage).
[[ -f $RELEASE/src/capi/libess.so ]] && cp -L "$RELEASE/src/capi/libess.so" "$DIR/bin/libess.so"

# Libraries the machine there is expected to have: glibc, libstdc++, libgcc, the CUDA driver
# and toolkit (cudart, cuBLAS).
is_system_lib() {
  case $1 in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libstdc++.so*|libgcc_s.so*) return 0 ;;
    libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libnvidia*|libnvrtc*) return 0 ;;
  esac
  return 1
}
for bin in "$DIR"/bin/*; do
  while read -r name _ path _; do
    [[ $path == /* ]] || continue
    is_system_lib "$name" && continue
    [[ -e $DIR/lib/$name ]] || cp -L "$path" "$DIR/lib/$name"
  done < <(ldd "$bin")
done

if ((PREFIX)); then
  debs=$(mktemp -d)
  chmod a+rwx "$debs"  # apt downloads as its own user
  trap 'rm -rf "$debs"' EXIT
  specs=()
  for p in "${DEB_PACKAGES[@]}"; do
    v=$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null) || { echo "device_bundle: $p is not installed (scripts/setup.sh)" >&2; exit 1; }
    specs+=("$p=$v")
  done
  (cd "$debs" && apt-get download -qq "${specs[@]}")
  rm -rf "$DIR/prefix"
  mkdir -p "$DIR/prefix"
  for d in "$debs"/*.deb; do dpkg-deb -x "$d" "$DIR/prefix"; done
  rm -rf "$DIR/prefix/usr/share/doc" "$DIR/prefix/usr/share/man" "$DIR/prefix/usr/share/lintian"
  ls "$debs" > "$DIR/prefix/PACKAGES"
fi

# The manifest: every file's sha256 and size; per binary, ldd and the symbol versions it needs.
python3 - "$DIR" "$ROOT" <<'PY'
import hashlib, json, os, re, subprocess, sys, datetime
d, root = sys.argv[1], sys.argv[2]
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
def newest(names, prefix):
    vs = sorted({tuple(int(x) for x in n[len(prefix):].split(".")) for n in names if re.fullmatch(re.escape(prefix) + r"[0-9.]+", n)})
    return prefix + ".".join(map(str, vs[-1])) if vs else None
files = {}
for base, _, names in os.walk(d):
    for n in sorted(names):
        p = os.path.join(base, n)
        rel = os.path.relpath(p, d)
        if rel == "manifest.json" or os.path.islink(p):
            continue
        h = hashlib.sha256(open(p, "rb").read()).hexdigest()
        files[rel] = {"sha256": h, "bytes": os.path.getsize(p)}
binaries = {}
for n in sorted(os.listdir(os.path.join(d, "bin"))):
    p = os.path.join(d, "bin", n)
    syms = set(re.findall(r"\b((?:GLIBC|GLIBCXX|CXXABI)_[0-9.]+)\b", run("objdump", "-T", p)))
    binaries[n] = {"ldd": run("ldd", p).splitlines(),
                   "requires": {k: newest(syms, k + "_") for k in ("GLIBC", "GLIBCXX", "CXXABI")}}
libs = {}
for n in sorted(os.listdir(os.path.join(d, "lib"))):
    syms = set(re.findall(r"\b((?:GLIBC|GLIBCXX|CXXABI)_[0-9.]+)\b", run("objdump", "-T", os.path.join(d, "lib", n))))
    libs[n] = {k: newest(syms, k + "_") for k in ("GLIBC", "GLIBCXX", "CXXABI")}
os_release = dict(l.split("=", 1) for l in open("/etc/os-release").read().split("\n") if "=" in l)
ninja = open(os.path.join(root, "build/release/build.ninja")).read()
arch = sorted(set(re.findall(r"--generate-code=arch=(compute_\w+),code=", ninja)))
manifest = {
    "bundle": "ess device bundle (scripts/device_bundle.sh)",
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "build": {
        "commit": run("git", "-C", root, "rev-parse", "HEAD").strip(),
        "dirty": bool(run("git", "-C", root, "status", "--porcelain", "--untracked-files=no").strip()),
        "os": os_release.get("PRETTY_NAME", "").strip('"'),
        "glibc": run("ldd", "--version").splitlines()[0] if run("ldd", "--version") else "",
        "cxx": run("c++", "--version").splitlines()[0],
        "nvcc": (run("/usr/local/cuda/bin/nvcc", "--version").strip().splitlines() or [""])[-1],
        "cuda_architectures": arch,
        "preset": "release",
    },
    "expected_there": "glibc, libstdc++, libgcc, the CUDA driver and the CUDA 13 toolkit (libcudart.so.13, libcublas.so.13)",
    "binaries": binaries,
    "libraries": libs,
    "files": files,
}
json.dump(manifest, open(os.path.join(d, "manifest.json"), "w"), indent=1)
PY

# The binaries travel as one archive (the manifest above holds each one's hash).
tar -C "$DIR" -cJf "$DIR/bin.tar.xz" bin
rm -rf "$DIR/bin"

size_kib=$(du -sk "$DIR" | cut -f1)
echo "device bundle: $DIR, $((size_kib / 1024)) MiB ($(tar -tJf "$DIR/bin.tar.xz" | grep -c '^bin/.') binaries, $(ls "$DIR/lib" | wc -l) libraries$( ((PREFIX)) && echo ", fallback prefix"))"
if ((size_kib > LIMIT_MIB * 1024)); then
  echo "device_bundle: the bundle is over $LIMIT_MIB MiB; the work tree and the bundle must travel within 64 MiB" >&2
  exit 1
fi

if ((CHECK)); then
  [[ -d $DIR/prefix/usr ]] || { echo "device_bundle: --check-fallback needs the prefix (drop --no-prefix)" >&2; exit 1; }
  FB=build/fallback-check
  rm -rf "$FB"
  # What the system has of our packages: hidden from the build, and never to appear in it.
  HIDE=(/usr/include/fmt /usr/include/nlohmann /usr/include/CLI /usr/include/gtest /usr/include/gmock
        /usr/include/tbb /usr/include/oneapi /usr/lib/x86_64-linux-gnu/cmake/fmt /usr/lib/x86_64-linux-gnu/cmake/GTest
        /usr/lib/x86_64-linux-gnu/cmake/TBB /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11
        /usr/include/dlpack /usr/lib/x86_64-linux-gnu/cmake/dlpack)
  configure_and_build="cmake -S . -B $FB -G Ninja -DCMAKE_BUILD_TYPE=Release -DESS_BUILD_BENCHMARKS=OFF \
    -DCMAKE_PREFIX_PATH=$DIR/prefix/usr -DCMAKE_IGNORE_PREFIX_PATH='/usr;/usr/local' >/dev/null"
  if ((CHECK == 2)); then
    configure_and_build+=" && cmake --build $FB -j ${JOBS:-$(nproc)} --target ess cuda_swap_engine_test \
      cuda_swap_engine_host_test cuda_offload_test cuda_executor_test"
  fi
  if unshare -m true 2>/dev/null; then
    echo "fallback check: building in a mount namespace with the system's copies hidden"
    empty=$(mktemp -d)
    mounts=""
    for h in "${HIDE[@]}"; do [[ -e $h ]] && mounts+="mount --bind $empty $h && "; done
    unshare -m sh -c "${mounts}cd '$ROOT' && $configure_and_build"
    rmdir "$empty"
  else
    echo "fallback check: unshare not permitted; building with the system prefixes ignored (headers checked below)"
    sh -c "$configure_and_build"
  fi
  for pkg in fmt nlohmann_json CLI11 GTest TBB dlpack; do
    dir=$(sed -n "s|^${pkg}_DIR:PATH=||p" "$FB/CMakeCache.txt")
    [[ $dir == "$DIR/prefix/"* ]] || { echo "fallback check FAILED: find_package($pkg) resolved to '$dir', not the bundle" >&2; exit 1; }
  done
  if ((CHECK == 1)); then
    echo "fallback check: passed (configure: every find_package resolved from the bundle's prefix)"
    exit 0
  fi
  # Every header and library of those packages came from the bundle.
  # (header dependencies of every object; every path token of the link commands)
  leaks=$( (ninja -C "$FB" -t deps; tr ' ' '\n' < "$FB/build.ninja") |
          grep -E '^ *(/usr/include/(fmt|nlohmann|CLI|gtest|gmock|tbb|oneapi)/|/usr/lib/x86_64-linux-gnu/lib(fmt|tbb|gtest|gmock))' | sort -u | head -5 || true)
  if [[ -n $leaks ]]; then
    echo "fallback check FAILED: the build used the system's copies:" >&2
    echo "$leaks" >&2
    exit 1
  fi
  "$FB/tools/ess/ess" --version
  ldd "$FB/tools/ess/ess" | grep -E "libfmt|libtbb"
  "$FB/src/runtime/ops/gpu_swap/cuda_swap_engine_host_test" --gtest_brief=1 --gtest_filter='*WarmupMatches*'
  echo "fallback check: passed (the bundle's prefix alone satisfied find_package and supplied every header and library)"
fi
