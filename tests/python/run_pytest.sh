#!/usr/bin/env bash
# Runs the pytest suite with the venv's python, with the reason of every skip
# (-rs). With SUMMARY, also writes there the suite's last line ("41 passed,
# 2 skipped in 60.1s") after its SKIPPED lines: scripts/test.sh prints it
# after ctest, whose own output shows a test's log only when it fails.
# Usage: run_pytest.sh VENV TQKV_SERVER TQKV_CLI TEST_DIR [SUMMARY]
set -u
venv=$1
export TQKV_SERVER=$2 TQKV_CLI=$3
tests=$4
summary=${5:-}
[ -n "$summary" ] && rm -f "$summary"
if [ ! -x "$venv/bin/python" ]; then
  echo "no Python venv at $venv: run scripts/python_env.sh (scripts/test.sh does)"
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  exit 77  # skipped
fi
# Exit code 5 (no tests collected) must not pass: treat it as a failure.
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$tests" 2>&1 | tee "$out"
code=${PIPESTATUS[0]}
if [ -n "$summary" ]; then
  { grep -E '^SKIPPED ' "$out"; tail -n 1 "$out"; } >"$summary"
fi
if [ "$code" -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi
exit "$code"
