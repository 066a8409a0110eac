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
#   tests/gpu/device_check.sh --dry-run B the same run, step for step, on the
#                                         emulated device from build dir B's
#                                         bin/ (gpu_emulation_test,
#                                         tqkv_gpu_bench_emulated, small
#                                         sizes; the decode loop on
#                                         --backend auto): what CI runs
#                                         (ctest DeviceCheck.DryRun), so the
#                                         script's own path is tested
#                                         before GPU time is spent on it
#
# With the device tool (a GPU machine that has nvcc and CMake but not the
# Debian packages): here `tests/gpu/device_check.sh --bundle .device-bundle`
# (git-ignored, about 45 MiB: the four binaries and the shared libraries they
# load), then run `tests/gpu/device_check.sh --run .device-bundle` there with
# `.device-bundle` carried. --bundle fails when the bundle and the tracked
# source tree together exceed the device tool's 64 MiB.
#
# Everything worth keeping goes to $OUT when it is set (else to
# build-cuda/device-check/), written as each step ends: the device
# (device.txt), each step's log, the benchmark's JSON, and summary.txt, one
# line per step with its exit status, written last. The exit status is
# non-zero when any step failed; every step runs regardless.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=${1:-build}
export TQKV_BUILD_DIR=${TQKV_BUILD_DIR:-build-cuda}
out=${OUT:-$TQKV_BUILD_DIR/device-check}

build() {
  scripts/setup.sh
  scripts/build.sh -DTQKV_CUDA=ON -DTQKV_BUILD_TESTS=ON -DTQKV_BUILD_BENCHMARKS=ON
}

# What the steps run: the device's programs and sizes, or (dry run) the
# emulated device's with sizes that take seconds there.
gpu_test=gpu_test
gpu_bench=tqkv_gpu_bench
decode_backend=cuda
bench_small=()
bench_json=(--contexts=32768 --batches=8,64)
test_args=()
load_args=(--context 1024 --decode-steps 16)
load_batches=(8 64)
server_memory_gib=16
dry_run() {
  gpu_test=gpu_emulation_test
  gpu_bench=tqkv_gpu_bench_emulated
  decode_backend=auto
  bench_small=(--prefill_tokens=64 --contexts=96 --context_batch=2 --batches=1,2 --batch_context=64
               --presets=turboquant_k3v4_nc --min_seconds=0)
  bench_json=("${bench_small[@]}")
  test_args=(--gtest_filter='CudaFormat.*:CudaBackendTest.CopyPage*:CudaBackendTest.Calls*:CudaBackend.*')
  load_args=(--context 32 --decode-steps 2)
  load_batches=(2)
  server_memory_gib=0.25
  DEVICE_CHECK_PORT=${DEVICE_CHECK_PORT:-0}
}

summary=()
step() {  # step NAME COMMAND...: runs it, notes its status
  local name=$1 status=0
  shift
  "$@" || status=$?
  summary+=("$name $status")
  return 0
}

run() {  # run BIN_DIR [LIB_DIR]
  local bin=$1
  if [ -n "${2:-}" ]; then export LD_LIBRARY_PATH="$2${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  mkdir -p "$out"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true; } |
    tee "$out/device.txt"
  step gpu_test bash -c '"$0" "${@:2}" 2>&1 | tee "$1/gpu_test.log"; exit ${PIPESTATUS[0]}' \
    "$bin/$gpu_test" "$out" "${test_args[@]}"
  # The benchmark runs even when a test failed: its figures help find why.
  step gpu_bench bash -c '"$0" "${@:2}" 2>&1 | tee "$1/gpu_bench.txt"; exit ${PIPESTATUS[0]}' \
    "$bin/$gpu_bench" "$out" "${bench_small[@]}"
  step gpu_bench_json bash -c '"$0" "${@:2}" > "$1/gpu_bench.json"' "$bin/$gpu_bench" "$out" --json "${bench_json[@]}"
  # The fp32 CUDA-core kernel at the same points, for comparison.
  step gpu_bench_fp32 bash -c '"$0" "${@:2}" 2>&1 | tee "$1/gpu_bench_fp32.txt"; exit ${PIPESTATUS[0]}' \
    "$bin/$gpu_bench" "$out" --tensor_cores=false "${bench_json[@]}"
  step decode_loop decode_loop "$bin"
  printf '%s\n' "${summary[@]}" > "$out/summary.txt"
  echo "device check: $out/summary.txt"
  cat "$out/summary.txt"
  ! grep -qv ' 0$' "$out/summary.txt"
}

# The decode loop through tqkv-server on a loopback port (the default
# config: Llama-3.1-8B shape, the default preset), bounded in time.
decode_loop() {  # decode_loop BIN_DIR
  local bin=$1 port=${DEVICE_CHECK_PORT:-50999} status=0
  if [ "$port" = 0 ]; then  # any free port (the dry run: CI runs tests side by side)
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  fi
  [ -x "$bin/tqkv-server" ] && [ -x "$bin/tqkv" ] || { echo "decode loop: no tqkv-server/tqkv in $bin"; return 1; }
  "$bin/tqkv-server" --backend "$decode_backend" --host 127.0.0.1 --port "$port" --metrics_port -1 \
    --memory_budget_gib "$server_memory_gib" > "$out/decode_server.log" 2>&1 &
  local server=$!
  local up=1
  for _ in $(seq 100); do
    if "$bin/tqkv" info --target "127.0.0.1:$port" > /dev/null 2>&1; then up=0; break; fi
    kill -0 $server 2>/dev/null || break
    sleep 0.2
  done
  if [ $up -ne 0 ]; then
    echo "decode loop: the server did not come up (decode_server.log):"; cat "$out/decode_server.log"
    kill $server 2>/dev/null; wait $server 2>/dev/null || true
    return 1
  fi
  for batch in "${load_batches[@]}"; do
    timeout 240 "$bin/tqkv" load --target "127.0.0.1:$port" "${load_args[@]}" --batch "$batch" \
      --quiet 2>&1 | tee "$out/decode_loop_b$batch.txt" || status=$?
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
    # What the device tool carries: the working tree and the bundle, 64 MiB
    # in all.
    bundle_kib=$(du -sk "$dir" | cut -f1)
    source_kib=0
    if command -v git > /dev/null && git rev-parse --git-dir > /dev/null 2>&1; then
      source_kib=$(( $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) / 1024 ))
    fi
    echo "bundle ${bundle_kib} KiB + tracked source ${source_kib} KiB (limit 65536 KiB)"
    if [ $((bundle_kib + source_kib)) -gt 65536 ]; then
      echo "device_check.sh: the bundle and the source tree exceed 64 MiB" >&2
      exit 1
    fi
    ;;
  --run)
    dir=${2:?usage: device_check.sh --run DIR}
    run "$dir/bin" "$dir/lib"
    ;;
  --dry-run)
    dir=${2:?usage: device_check.sh --dry-run BUILD_DIR}
    dry_run
    run "$dir/bin"
    ;;
  *)
    echo "usage: device_check.sh [--bundle DIR | --run DIR | --dry-run BUILD_DIR]" >&2
    exit 2
    ;;
esac
