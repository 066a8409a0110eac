#!/usr/bin/env bash
# Every metric name (and label) that the Grafana dashboard and the Prometheus
# alert rules use is exported by a live tqkv-server: start one on loopback,
# make it store, fork (copy-on-write), attend, score and fail a call through
# the CLI so that every series exists, scrape /metrics, compare
# (promql_names.py check).
# Usage: metric_names_test.sh TQKV TQKV_SERVER REPO_ROOT
set -u
TQKV=$1
SERVER=$2
REPO=$3
source "$(dirname "$0")/lib.sh"
need curl python3
PY=$(yaml_python) || { echo "SKIP: no python3 with PyYAML (scripts/setup.sh installs python3-yaml)"; exit $SKIP; }
deploy_init

start_small_server

"$TQKV" synth --shape 4,5,2,64 --seed 1 --out "$WORK/k.npy" >/dev/null || fail "synth keys"
"$TQKV" synth --shape 4,5,2,64 --seed 2 --out "$WORK/v.npy" >/dev/null || fail "synth values"
"$TQKV" synth --shape 4,64 --seed 3 --out "$WORK/q.npy" >/dev/null || fail "synth queries"
KV=(--keys "$WORK/k.npy" --values "$WORK/v.npy")
run() { "$@" >"$WORK/out" 2>&1 || { fail "$*"; cat "$WORK/out"; }; }
run "$TQKV" append "${C[@]}" --sequence m "${KV[@]}"
run "$TQKV" fork "${C[@]}" --parent m --child m/b
# 5 tokens in 8-token pages: the child's append copies the shared partial page.
run "$TQKV" append "${C[@]}" --sequence m/b "${KV[@]}"
run "$TQKV" attend "${C[@]}" --sequence m --layer 1 --queries "$WORK/q.npy" --out "$WORK/o.npy"
run "$TQKV" score "${C[@]}" --sequence m --layer 1 --queries "$WORK/q.npy"
# A failed call: tqkv_rpc_errors_total has a series only once one failed.
"$TQKV" append "${C[@]}" --sequence m "${KV[@]}" --start 1 >/dev/null 2>&1 &&
  fail "an append at the wrong start position succeeded"

curl -sf "http://127.0.0.1:$S_METRICS_PORT/metrics" >"$WORK/metrics.txt" || fail "scrape /metrics"
"$PY" "$(dirname "$0")/promql_names.py" check "$WORK/metrics.txt" \
  "$REPO"/deploy/grafana/dashboards/*.json "$REPO"/deploy/prometheus/alerts.yml || fail "names"
finish "every metric name the dashboard and the rules use is exported"
