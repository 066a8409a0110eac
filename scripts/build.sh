#!/usr/bin/env bash
# Configures and builds tqkv into build/ (Release). Extra arguments go to the
# CMake configure step, e.g. scripts/build.sh -DTQKV_CUDA=OFF.
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
cmake --build "$build_dir" -j "$(nproc)"
