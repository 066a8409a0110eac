#!/usr/bin/env bash
# One-shot device check for a machine with an NVIDIA GPU: builds with CUDA
# forced on, then runs the GPU tests (which compare every CUDA kernel with the
# CPU backend). Finishes in a few minutes. Usage: tests/gpu/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
export TQKV_BUILD_DIR=${TQKV_BUILD_DIR:-build-cuda}
scripts/setup.sh
scripts/build.sh -DTQKV_CUDA=ON -DTQKV_BUILD_BENCHMARKS=OFF
"$TQKV_BUILD_DIR/bin/gpu_test"
