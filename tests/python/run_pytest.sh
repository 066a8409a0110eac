#!/usr/bin/env bash
# Runs the pytest suite with the venv's python.
# Usage: run_pytest.sh VENV TQKV_SERVER TQKV_CLI TEST_DIR
set -u
venv=$1
export TQKV_SERVER=$2 TQKV_CLI=$3
tests=$4
if [ ! -x "$venv/bin/python" ]; then
  echo "no Python venv at $venv: run scripts/python_env.sh (scripts/test.sh does)"
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  exit 77  # skipped
fi
# Exit code 5 (no tests collected) must not pass: treat it as a failure.
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$tests"
code=$?
if [ "$code" -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit "$code"
