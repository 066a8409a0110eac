#!/usr/bin/env bash
# The test command: installs what is missing, builds, makes the Python venv
# (scripts/python_env.sh: the Python client, pytest, the SmolLM2 test model),
# installs cuobjdump and nvdisasm for the kernels' static budget
# (scripts/cuda_binutils.sh; nothing without nvcc), runs every test suite
# (ctest, the pytest suite included), then prints
# pytest's count and the reason of every test it skipped.
# GPU tests skip cleanly on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh
scripts/python_env.sh
scripts/cuda_binutils.sh
build_dir=${TQKV_BUILD_DIR:-build}
summary="$build_dir/Testing/pytest-summary.txt"
rm -f "$summary"
code=0
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" || code=$?
# ctest shows a passing test's output nowhere: what pytest ran and skipped.
if [ -s "$summary" ]; then
  echo "pytest (Python.PytestSuite): $(tail -n 1 "$summary")"
  grep '^SKIPPED' "$summary" | sed 's/^/  /' || true
else
  echo "pytest (Python.PytestSuite): no summary; it did not run (see its ctest line above)"
fi
exit "$code"
