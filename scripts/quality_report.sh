#!/usr/bin/env bash
# The per-preset quality report (markdown on stdout): synthetic keys, real
# K/V of SmolLM2-135M and Gemma 3 270M, their perplexity and pass-key
# retrieval with attention served by tqkv-server, next to vLLM's scheme
# emulated in numpy. Builds and sets up the venv first (with the second model
# and matplotlib: TQKV_QUALITY_MODELS=all). Arguments go to
# tools/quality/quality_report.py (--models, --tokens N, --texts, --windows,
# --presets a,b, --vllm, --recipes, --sections a,b,c,d, --passkey-*, --json
# FILE, --chart PNG; --help lists them). The default sections a,b,c take
# about an hour on 2 shared cores; docs/quality.md has the commands behind
# its tables.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >&2
scripts/build.sh >&2
TQKV_QUALITY_MODELS=${TQKV_QUALITY_MODELS:-all} scripts/python_env.sh >&2
exec "${TQKV_BUILD_DIR:-build}/venv/bin/python" tools/quality/quality_report.py "$@"
