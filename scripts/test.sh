#!/usr/bin/env bash
# The test command: installs what is missing, builds, makes the Python venv
# (scripts/python_env.sh: the Python client, pytest, the SmolLM2 test model),
# runs every test suite (ctest, the pytest suite included).
# GPU tests skip cleanly on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh
scripts/python_env.sh
ctest --test-dir "${TQKV_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
