#!/usr/bin/env bash
# Downloads the pinned releases of the engines ESS plugs into, checks their digests and unpacks
# their Python sources under build/upstream/ (the adapters' conformance and replay tests read them
# there). The wheels are kept in a per-user cache (ESS_UPSTREAM_CACHE, default ~/.cache/ess/upstream), so a
# machine downloads each pinned wheel once, whatever the clone (vllm's is 336 MB; only its .py files are
# unpacked). Nothing is installed. A failed download or a wrong digest fails: the tests that read
# upstream's code never skip for want of it.
#
#   scripts/upstream.sh            # build/upstream/sglang-0.5.23/sglang/..., vllm-0.33.0/vllm/...
#   ESS_UPSTREAM_DIR=DIR ESS_UPSTREAM_CACHE=DIR scripts/upstream.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${ESS_UPSTREAM_DIR:-build/upstream}
cache=${ESS_UPSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ess/upstream}
mkdir -p "$out" "$cache"

# name version wheel sha256 platform abi (the wheel's own tags, so the download does not depend on
# this machine's Python)
PINS=(
  "sglang 0.5.23 sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl 00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 manylinux_2_34_x86_64 cp311"
  "vllm 0.33.0 vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa manylinux_2_28_x86_64 abi3"
)

for pin in "${PINS[@]}"; do
  read -r name version wheel digest platform abi <<<"$pin"
  dest="$out/$name-$version"
  if [[ -f "$dest/.complete" ]]; then
    echo "upstream: $name $version present ($dest)"
    continue
  fi
  if [[ ! -f "$cache/$wheel" ]] || ! echo "$digest  $cache/$wheel" | sha256sum -c --status; then
    rm -f "$cache/$wheel"
    if [[ -f "$out/$wheel" ]] && echo "$digest  $out/$wheel" | sha256sum -c --status; then
      mv "$out/$wheel" "$cache/$wheel"   # a wheel an earlier version of this script left in the build
    else
      echo "upstream: downloading $name==$version"
      /usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform "$platform" --implementation cp --abi "$abi" -d "$cache" "$name==$version"
    fi
  fi
  if ! echo "$digest  $cache/$wheel" | sha256sum -c --status; then
    echo "upstream: $cache/$wheel does not have the pinned sha256 $digest" >&2
    exit 1
  fi
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  unzip -q -o "$cache/$wheel" "$name/*.py" -d "$dest.tmp"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  touch "$dest/.complete"
  echo "upstream: $name $version unpacked in $dest"
done
