#!/usr/bin/env bash
# The test command: installs what is missing, builds, runs every test suite.
# GPU tests skip cleanly on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh
ctest --test-dir "${TQKV_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
