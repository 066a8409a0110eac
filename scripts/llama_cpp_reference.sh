#!/usr/bin/env bash
# Reference figure for the README: llama.cpp's CPU flash-attention decode time
# (ggml's GGML_OP_FLASH_ATTN_EXT on the CPU backend) for the shape tqkv
# benchmarks, measured on this machine: head dim 128, 32 query heads over 8 KV
# heads (GQA 4), 1 query token, masked, K/V as f16 / q8_0 / q4_0, contexts
# 1024 / 8192 / 32768, 2 threads. One call is one layer's attention for one
# sequence; the median of repeated calls is printed, with p10/p90, the error
# against a double-precision reference, and the CPU that other processes used
# meanwhile (other_cpu, in cores: a row above ~0.1 is not a clean figure).
# Layout "cache" is K/V as llama.cpp's KV cache holds them (one row per token
# with all KV heads, a strided view: what llama.cpp decode runs); "heads" has
# each KV head's rows contiguous (test-backend-ops' layout, the kernel alone).
#
# llama.cpp version: the copy vendored in llama-cpp-python 0.3.36 from PyPI
# (llama.cpp commit 0c1e57098, ggml 0.25.3). Nothing of llama.cpp is kept in
# this repository: the sdist is downloaded and ggml built (CPU only,
# -march=native, OpenMP) under build/llama_cpp/, once (2-4 min on 2 cores);
# reruns only measure (about a minute). The timing program is ours,
# tools/llama_cpp_reference/fa_bench.cc, on ggml's public API. llama.cpp's own
# `test-backend-ops perf` is not used: it runs the CPU backend on nproc/2
# threads and has this shape only for f16 at 8192 and 32768.
#
# Usage: scripts/llama_cpp_reference.sh [--json] [--threads N] [--contexts a,b]
#   [--types f16,q8_0] [--layouts cache,heads] [--seconds S per row]
# Table (or with --json one JSON object a row) on stdout, the rest on stderr.
# Measure on an idle machine: the load average is printed first, and each
# row's other_cpu tells whether something else ran meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
dir=${TQKV_BUILD_DIR:-build}/llama_cpp
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
obj="$dir/cmake-build"
bench="$dir/fa_bench"
mkdir -p "$dir"

if [ ! -f "$src/ggml/include/ggml.h" ]; then
  if [ ! -f "$dir/llama_cpp_python-$version.tar.gz" ]; then
    echo "llama_cpp_reference: downloading llama-cpp-python $version (sdist)" >&2
    ${PYTHON:-python3} -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dir" >&2
  fi
  tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
fi

if [ ! -f "$obj/build.ninja" ] && [ ! -f "$obj/Makefile" ]; then
  generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake -S "$src" -B "$obj" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_CCACHE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
fi
# Only ggml (base + CPU backend) is needed; a no-op once built.
cmake --build "$obj" -j "$(nproc)" --target ggml >&2

libs=("$obj/ggml/src/libggml.a" "$obj/ggml/src/libggml-cpu.a" "$obj/ggml/src/libggml-base.a")
if [ ! -x "$bench" ] || [ tools/llama_cpp_reference/fa_bench.cc -nt "$bench" ] || [ "${libs[1]}" -nt "$bench" ]; then
  ${CXX:-g++} -O2 -std=c++17 -march=native -I"$src/ggml/include" tools/llama_cpp_reference/fa_bench.cc \
    "${libs[@]}" -fopenmp -lpthread -lm -o "$bench"
fi

echo "llama_cpp_reference: llama.cpp 0c1e57098 (llama-cpp-python $version), $(nproc) CPUs," \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'); loadavg: $(cat /proc/loadavg)" >&2
exec "$bench" "$@"
