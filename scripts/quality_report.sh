#!/usr/bin/env bash
# The per-preset quality report (markdown on stdout): synthetic keys, real
# SmolLM2-135M K/V, and the model's perplexity with attention served by
# tqkv-server. Builds and sets up the venv first. Arguments go to
# tools/quality/quality_report.py (--tokens N, --presets a,b, --sections a,b,c,
# --json FILE). About 5 minutes on 2 cores at the default 1024 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >&2
scripts/build.sh >&2
scripts/python_env.sh >&2
exec "${TQKV_BUILD_DIR:-build}/venv/bin/python" tools/quality/quality_report.py "$@"
