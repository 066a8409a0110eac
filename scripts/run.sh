#!/usr/bin/env bash
# Sets up, builds and runs tqkv-server with its embedded default configuration
# (one Llama-3.1-8B-shaped cache, preset turboquant_k3v4_nc, boundary layers at
# fp16): gRPC on :50051, Prometheus metrics on :9464/metrics. Extra arguments go
# to tqkv-server (e.g. --config my.textproto --memory_budget_gib 16).
# Stop it with Ctrl-C (SIGINT): calls in flight finish first.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh
exec build/bin/tqkv-server "$@"
