#!/usr/bin/env bash
# Configures and builds tqkv into build/ (Release). Extra arguments go to the
# CMake configure step, e.g. scripts/build.sh -DTQKV_CUDA=OFF. TQKV_TARGETS
# (space-separated) builds only those targets and what they need, e.g.
# TQKV_TARGETS="tqkv-server tqkv" scripts/build.sh; unset: everything.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${TQKV_BUILD_DIR:-build}
generator=()
if command -v ninja >/dev/null && [ ! -f "$build_dir/Makefile" ]; then generator=(-G Ninja); fi
# nvcc lives outside PATH on a stock CUDA install; let CMake find it there.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
targets=()
for target in ${TQKV_TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" -j "$(nproc)" "${targets[@]}"
