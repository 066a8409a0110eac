#!/usr/bin/env bash
# Installs cuobjdump and nvdisasm, which tools/gpu_budget/sass_budget.py (the
# ctest Tool.GpuBudget) reads the CUDA kernels' cubins with, into
# build/cuda-binutils (TQKV_BUILD_DIR/cuda-binutils): the CUDA toolkit's
# Debian-style installs often lack them, PyPI's NVIDIA packages ship them.
# pip --target from the build's venv (scripts/python_env.sh), or from a venv
# of its own when there is none. Nothing to do without nvcc (no CUDA
# objects to read). Skips the work when the pinned versions are there.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${TQKV_BUILD_DIR:-build}
target="$build_dir/cuda-binutils"
PINS=("nvidia-cuda-cuobjdump==13.4.92" "nvidia-cuda-nvdisasm==13.4.92")

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "cuda_binutils: no nvcc, no CUDA kernels to read; nothing to install"
  exit 0
fi
if [ "$(cat "$target/.tqkv-pins" 2>/dev/null)" = "${PINS[*]}" ] &&
  compgen -G "$target/nvidia/*/bin/cuobjdump" >/dev/null && compgen -G "$target/nvidia/*/bin/nvdisasm" >/dev/null; then
  echo "cuda_binutils: $target up to date"
  exit 0
fi
python="$build_dir/venv/bin/python"
if [ ! -x "$python" ]; then
  python="$build_dir/cuda-binutils-venv/bin/python"
  [ -x "$python" ] || python3 -m venv "$build_dir/cuda-binutils-venv" || {
    echo "cuda_binutils: 'python3 -m venv' failed; on Debian install python3-venv" >&2
    exit 1
  }
fi
rm -rf "$target"
if ! "$python" -m pip --disable-pip-version-check -q install --no-deps --target "$target" "${PINS[@]}"; then
  # Not fatal: Tool.GpuBudget then skips, saying that it has no cuobjdump.
  echo "cuda_binutils: WARNING: pip could not install ${PINS[*]}; Tool.GpuBudget will skip" >&2
  exit 0
fi
echo "${PINS[*]}" >"$target/.tqkv-pins"
echo "cuda_binutils: $(ls "$target"/nvidia/*/bin/ | tr '\n' ' ')in $target"
