#!/usr/bin/env bash
# One-shot device check of the CUDA backend: the GPU tests (every CUDA kernel
# against the CPU backend), then the GPU benchmark (decode vs context and
# batch per preset next to bf16, effective bandwidth, store throughput), then
# the decode loop through a real tqkv-server on the GPU (`tqkv load`: unary vs
# fused vs stream, layer by layer, where the kernels shrink and the time
# outside them becomes the step).
# About 8 minutes on an H200 when it builds, 4 when it runs a bundle.
#
#   tests/gpu/device_check.sh             build with CUDA here, then run (a GPU
#                                         machine with the Debian packages)
#   tests/gpu/device_check.sh --bundle D  build here (no GPU needed) and pack
#                                         the test and benchmark binaries with
#                                         the shared libraries they need into D
#   tests/gpu/device_check.sh --run D     run a bundle made by --bundle (a GPU
#                                         machine without the build packages)
#
# With the device tool (a GPU machine that has nvcc and CMake but not the
# Debian packages): here `tests/gpu/device_check.sh --bundle .device-bundle`
# (git-ignored, about 11 MiB), then run `tests/gpu/device_check.sh --run
# .device-bundle` there with `.device-bundle` carried.
#
# Logs and the benchmark's JSON go to $OUT when it is set (else to
# build-cuda/device-check/).
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=${1:-build}
export TQKV_BUILD_DIR=${TQKV_BUILD_DIR:-build-cuda}
out=${OUT:-$TQKV_BUILD_DIR/device-check}

build() {
  scripts/setup.sh
  scripts/build.sh -DTQKV_CUDA=ON -DTQKV_BUILD_TESTS=ON -DTQKV_BUILD_BENCHMARKS=ON
}

run() {  # run BIN_DIR [LIB_DIR]
  local bin=$1
  if [ -n "${2:-}" ]; then export LD_LIBRARY_PATH="$2${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  local status=0
  "$bin/gpu_test" 2>&1 | tee "$out/gpu_test.log" || status=$?
  # The benchmark runs even when a test failed: its figures help find why.
  "$bin/tqkv_gpu_bench" 2>&1 | tee "$out/gpu_bench.txt" || status=$?
  "$bin/tqkv_gpu_bench" --json --contexts=32768 --batches=8,64 > "$out/gpu_bench.json" || status=$?
  # The fp32 CUDA-core kernel at the same points, for comparison.
  "$bin/tqkv_gpu_bench" --tensor_cores=false --contexts=32768 --batches=8,64 2>&1 |
    tee "$out/gpu_bench_fp32.txt" || status=$?
  decode_loop "$bin" || status=$?
  return $status
}

# The decode loop through tqkv-server --backend cuda on a loopback port (the
# default config: Llama-3.1-8B shape, the default preset), bounded in time.
decode_loop() {  # decode_loop BIN_DIR
  local bin=$1 port=50999 status=0
  [ -x "$bin/tqkv-server" ] && [ -x "$bin/tqkv" ] || { echo "decode loop: no tqkv-server/tqkv"; return 0; }
  "$bin/tqkv-server" --backend cuda --host 127.0.0.1 --port $port --metrics_port -1 \
    --memory_budget_gib 16 > "$out/decode_server.log" 2>&1 &
  local server=$!
  for _ in $(seq 50); do
    "$bin/tqkv" info --target 127.0.0.1:$port > /dev/null 2>&1 && break
    sleep 0.2
  done
  for batch in 8 64; do
    timeout 240 "$bin/tqkv" load --target 127.0.0.1:$port --context 1024 --batch $batch \
      --decode-steps 16 --quiet 2>&1 | tee "$out/decode_loop_b$batch.txt" || status=$?
  done
  kill $server 2>/dev/null; wait $server 2>/dev/null || true
  return $status
}

case "$mode" in
  build)
    build
    run "$TQKV_BUILD_DIR/bin"
    ;;
  --bundle)
    dir=${2:?usage: device_check.sh --bundle DIR}
    build
    rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/lib"
    cp "$TQKV_BUILD_DIR/bin/gpu_test" "$TQKV_BUILD_DIR/bin/tqkv_gpu_bench" \
      "$TQKV_BUILD_DIR/bin/tqkv-server" "$TQKV_BUILD_DIR/bin/tqkv" "$dir/bin/"
    # Every shared library but the C library's own (the target's loader and
    # libc stay) and the driver (libcuda comes with the GPU machine).
    for binary in "$dir"/bin/*; do
      ldd "$binary" | awk '/=> \// {print $3}'
    done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
      while read -r lib; do cp -L "$lib" "$dir/lib/"; done
    cp tests/gpu/device_check.sh "$dir/"
    du -sh "$dir"
    ;;
  --run)
    dir=${2:?usage: device_check.sh --run DIR}
    run "$dir/bin" "$dir/lib"
    ;;
  *)
    echo "usage: device_check.sh [--bundle DIR | --run DIR]" >&2
    exit 2
    ;;
esac
