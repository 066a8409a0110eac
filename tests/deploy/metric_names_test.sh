#!/usr/bin/env bash
# Every metric name (and label) that the Grafana dashboard and the Prometheus
# alert rules use, and every metric name README.md and the pages under docs/
# mention (the metrics list is in docs/deploy.md), is exported by
# a live tqkv-server: start one on loopback with an admin and a tenant token,
# make it store, fork (copy-on-write), attend, score and fail a call through
# the CLI so that every series exists, scrape /metrics, compare
# (promql_names.py check, promql_names.py doc); tqkv_build_info names the
# version, revision and backend the server reports, the token counters count
# what was stored and attended, and the process_* families are there.
# Usage: metric_names_test.sh TQKV TQKV_SERVER REPO_ROOT
set -u
TQKV=$1
SERVER=$2
REPO=$3
source "$(dirname "$0")/lib.sh"
need curl python3
PY=$(yaml_python) || { echo "SKIP: no python3 with PyYAML (scripts/setup.sh installs python3-yaml)"; exit $SKIP; }
deploy_init

write_small_config "$WORK/config.txt"
printf 'admin-token\nteam-token tenant=team max_sequences=100\n' >"$WORK/tokens"
echo admin-token >"$WORK/admin"
echo team-token >"$WORK/team"
start_server S "$SERVER" "$WORK/config.txt" --auth_token_file "$WORK/tokens" || exit 1
C=(--target "127.0.0.1:$S_PORT" --auth-token-file "$WORK/admin")
wait_until 10 "$TQKV" info "${C[@]}" || fail "server does not answer"
# A tenant's call: the tqkv_tenant_* series exist once the tenant has one.
"$TQKV" info --target "127.0.0.1:$S_PORT" --auth-token-file "$WORK/team" >/dev/null || fail "tenant info"

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
# The documents whose metric names must be served: README.md and every page
# under docs/ (docs/deploy.md carries the metrics list).
mapfile -t DOCS < <(find "$REPO/docs" -name '*.md' | sort)
[[ ${#DOCS[@]} -gt 0 ]] || fail "no pages under $REPO/docs"
"$PY" "$(dirname "$0")/promql_names.py" check "$WORK/metrics.txt" \
  "$REPO"/deploy/grafana/dashboards/*.json "$REPO"/deploy/prometheus/alerts.yml || fail "names"
# Tokens: two 5-token appends over all 4 layers store 10; one query token
# attended in one of the 4 layers counts 1/4. Nothing in flight at rest.
stored=$(metric_value "$S_METRICS_PORT" tqkv_tokens_stored_total cache=default)
attended=$(metric_value "$S_METRICS_PORT" tqkv_tokens_attended_total cache=default)
[[ "$stored" == 10 ]] || fail "tqkv_tokens_stored_total is '$stored', want 10"
[[ "$attended" == 0.25 ]] || fail "tqkv_tokens_attended_total is '$attended', want 0.25"
in_flight=$(metric_value "$S_METRICS_PORT" tqkv_rpc_in_flight)
[[ "$in_flight" == 0 ]] || fail "tqkv_rpc_in_flight sums to '$in_flight' on an idle server, want 0"
grep -q '^process_resident_memory_bytes [1-9]' "$WORK/metrics.txt" || fail "no process_resident_memory_bytes"
grep -q '^process_cpu_seconds_total ' "$WORK/metrics.txt" || fail "no process_cpu_seconds_total"
"$TQKV" presets --json >"$WORK/presets.json" || fail "tqkv presets --json"
"$PY" "$(dirname "$0")/promql_names.py" doc "$WORK/metrics.txt" "$REPO" "$WORK/presets.json" \
  "$REPO/README.md" "${DOCS[@]}" || fail "documented metric names"
# tqkv_build_info{version,revision,backend} 1, as GetServerInfo says.
"$TQKV" info "${C[@]}" --json >"$WORK/info.json" || fail "info --json"
"$PY" - "$WORK/metrics.txt" "$WORK/info.json" <<'PY' || fail "tqkv_build_info"
import json, re, sys
info = json.load(open(sys.argv[2]))
lines = [l for l in open(sys.argv[1]) if l.startswith("tqkv_build_info{")]
assert len(lines) == 1, f"want one tqkv_build_info series, got {lines}"
labels = dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))
assert lines[0].rstrip().endswith(" 1"), lines[0]
assert labels["backend"] == info["backend"], (labels, info["backend"])
assert info["version"] == f'{labels["version"]} (git {labels["revision"]})', (labels, info["version"])
print("tqkv_build_info:", labels)
PY
finish "every metric name the dashboard, the rules, the README and docs/ use is exported; tqkv_build_info matches"
