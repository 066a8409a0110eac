# Helpers shared by the tests/deploy/*.sh tests (sourced, not run).
# Every process a test starts goes through start_bg, and cleanup (installed as
# the EXIT trap by deploy_init) kills them all and removes $WORK. Every wait
# is bounded.

SKIP=77  # ctest SKIP_RETURN_CODE of these tests
FAILURES=0
BG_PIDS=()

deploy_init() {
  WORK=$(mktemp -d)
  trap cleanup EXIT
  trap 'exit 1' INT TERM
}

cleanup() {
  local pid
  for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${BG_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [[ -n "${KEEP_WORK:-}" ]] && { echo "work dir kept: $WORK"; return; }
  rm -rf "$WORK"
}

fail() { echo "FAIL: $*"; FAILURES=$((FAILURES + 1)); }

finish() {
  if [[ $FAILURES -ne 0 ]]; then echo "$FAILURES failure(s)"; exit 1; fi
  echo "${1:-all checks passed}"
  exit 0
}

# need TOOL...: skips the whole test when a tool is missing (scripts/setup.sh
# installs them all).
need() {
  local tool
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "SKIP: $tool not found (scripts/setup.sh installs it)"
      exit $SKIP
    fi
  done
}

# yaml_python: prints a python3 that has PyYAML (PATH's, else Debian's
# /usr/bin/python3, which gets python3-yaml from scripts/setup.sh).
yaml_python() {
  local p
  for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import yaml' 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}

# start_bg LOG cmd...: runs cmd in the background, output to LOG; sets BG_PID.
start_bg() {
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  BG_PID=$!
  BG_PIDS+=("$BG_PID")
}

# A loopback TCP port that was free a moment ago.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_until SECONDS cmd...: retries cmd every 0.1 s until it succeeds.
wait_until() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [[ $SECONDS -ge $deadline ]] && return 1
    sleep 0.1
  done
}

# A small cache: 4 layers, 2 KV heads, 4 query heads, head_dim 64, 8-token
# pages, the default server's preset and protected boundary layers.
write_small_config() {
  cat >"$1" <<'CFG'
caches {
  name: "default" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "turboquant_k3v4_nc" boundary_layers: 1 memory_budget_bytes: 8388608
}
CFG
}

# start_server NAME SERVER_BINARY CONFIG [ARGS...]: starts tqkv-server on
# loopback with kernel-chosen ports (and ARGS); sets ${NAME}_PORT and
# ${NAME}_METRICS_PORT from its start-up line. Returns 1 if it did not come
# up within 20 s.
start_server() {
  local name=$1 binary=$2 config=$3 log="$WORK/$1.log" line=
  start_bg "$log" "$binary" --host 127.0.0.1 --port 0 --metrics_port 0 --threads 1 \
    --config "$config" "${@:4}"
  local deadline=$((SECONDS + 20))
  until line=$(grep -m1 'listening on' "$log" 2>/dev/null); do
    if [[ $SECONDS -ge $deadline ]] || ! kill -0 "$BG_PID" 2>/dev/null; then
      echo "tqkv-server $name did not start:"; cat "$log"; return 1
    fi
    sleep 0.1
  done
  # "tqkv-server listening on 127.0.0.1:PORT (metrics MPORT), backend ..."
  local port metrics
  port=$(sed -E 's/.*listening on [^ ]*:([0-9]+) .*/\1/' <<<"$line")
  metrics=$(sed -E 's/.*\(metrics ([0-9]+)\).*/\1/' <<<"$line")
  printf -v "${name}_PORT" '%s' "$port"
  printf -v "${name}_METRICS_PORT" '%s' "$metrics"
}

# One server "S" with the small config, answering; C=(--target ...) for the CLI.
start_small_server() {
  write_small_config "$WORK/config.txt"
  start_server S "$SERVER" "$WORK/config.txt" || exit 1
  C=(--target "127.0.0.1:$S_PORT")
  wait_until 10 "$TQKV" info "${C[@]}" || fail "server does not answer"
}

# metric_value PORT NAME [LABEL=VALUE...]: the sum of the series of one
# metric in a server's /metrics whose labels include all those given (0 when
# none match; empty output when the scrape fails).
metric_value() {
  local port=$1; shift
  curl -sf "http://127.0.0.1:$port/metrics" | python3 -c '
import re, sys
name, want = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
total = 0.0
for line in sys.stdin:
    m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
    if not m or m.group(1) != name:
        continue
    labels = dict(re.findall(r"(\w+)=\"((?:[^\"\\]|\\.)*)\"", m.group(2) or ""))
    if all(labels.get(k) == v for k, v in want.items()):
        total += float(m.group(3))
print(f"{total:g}")' "$@"
}
