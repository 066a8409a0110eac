#!/usr/bin/env bash
# Sets up, builds (only the server and the CLI) and runs tqkv-server with its
# embedded default configuration (one Llama-3.1-8B-shaped cache, preset
# tqkv_k3v4u_csw; tqkv-server --print_default_config prints it): gRPC on
# :50051, Prometheus metrics on 127.0.0.1:9464/metrics. Extra arguments go
# to tqkv-server (e.g. --config my.textproto --memory_budget_gib 16).
# Stop it with Ctrl-C (SIGINT): calls in flight finish first.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
# The server and the CLI only: the tests and benchmarks (scripts/test.sh
# builds them) are not needed to serve.
TQKV_TARGETS="tqkv-server tqkv" scripts/build.sh
exec "${TQKV_BUILD_DIR:-build}/bin/tqkv-server" "$@"
