#!/usr/bin/env bash
# Builds the virtual environments in which SGLang and vLLM themselves import on this CPU, so that the
# adapters' tests under python/tests/engines/ drive ESS with the engines' own classes (not stand-ins).
# One venv per engine, since their pins differ (sglang==0.5.23 wants torch 2.14.1 and openai 2.8.0,
# vllm==0.33.0 torch 2.14.0 and openai >= 2.25): PyPI's torch (its CUDA wheel: it imports without a
# GPU), the engine's own wheel from scripts/upstream.sh's cache (digest-checked there), and the
# packages the engine's own requirements name that its CPU-side modules need to import, each pinned
# with its sha256 in scripts/engines/<engine>.txt (pip --require-hashes). The GPU-only requirements
# (kernel packages, FlashInfer, DeepEP, ...) are left out: the tests never reach them.
#
# Wheels are kept in ~/.cache/ess/wheels (ESS_WHEEL_CACHE) and the venvs in ~/.cache/ess/engines
# (ESS_ENGINES_DIR), named after their lock file's digest: a machine downloads ~6 GB once per lock,
# builds each venv once (about a minute from the cache), and a changed lock builds a new one.
# Prints each venv's python, one line per engine ("sglang PATH", "vllm PATH"), last.
#
#   scripts/engines.sh             # both
#   scripts/engines.sh sglang      # one
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/.."
cache=${ESS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ess}
wheels=${ESS_WHEEL_CACHE:-$cache/wheels}
envs=${ESS_ENGINES_DIR:-$cache/engines}
upstream=${ESS_UPSTREAM_CACHE:-$cache/upstream}
mkdir -p "$wheels" "$envs"
bash scripts/upstream.sh >/dev/null   # the engines' own wheels, digest-checked, in $upstream

declare -A WHEEL=(
  [sglang]=sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
  [vllm]=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
)
names=("$@")
((${#names[@]})) || names=(sglang vllm)
built=()
for name in "${names[@]}"; do
  lock=scripts/engines/$name.txt
  [[ -f $lock && -n ${WHEEL[$name]:-} ]] || { echo "engines: no engine named '$name' (sglang, vllm)" >&2; exit 2; }
  digest=$(cat "$lock" "$self" | sha256sum | cut -c1-16)
  venv=$envs/$name-$digest
  if [[ ! -f $venv/.complete ]]; then
    started=$SECONDS
    echo "engines: building $venv" >&2
    /usr/bin/python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: -d "$wheels" -r "$lock" >&2
    rm -rf "$venv"
    find "$envs" -maxdepth 1 -name "$name-*" ! -name "$name-$digest" -exec rm -rf {} +   # older locks' venvs
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-deps --require-hashes --no-index --find-links "$wheels" -r "$lock" >&2
    "$venv/bin/pip" install -q --no-deps "$upstream/${WHEEL[$name]}" >&2
    touch "$venv/.complete"
    echo "engines: $name built in $((SECONDS - started)) s" >&2
  fi
  built+=("$name $venv/bin/python")
done
printf '%s\n' "${built[@]}"
