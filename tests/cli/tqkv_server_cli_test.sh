#!/usr/bin/env bash
# The server-facing CLI subcommands end to end: starts tqkv-server on a free
# loopback port with a small config and bearer-token auth, then runs
# info / append / sequence / attend / score / fork / drop / load through the
# tqkv binary, checking outputs and exit codes; then --help and --version of
# both binaries, a busy port, the bind (loopback by default, a warning when
# open to other hosts without auth), an unreachable server, a server that
# goes away under `tqkv load`, and a prompt exit on SIGINT. Servers are
# killed on exit.
# Usage: tqkv_server_cli_test.sh path/to/tqkv path/to/tqkv-server
set -u
TQKV=$1
SERVER=$2
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
  local pid
  for pid in $SERVER_PID ${OTHER_PIDS:-}; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT
FAILURES=0
fail() { echo "FAIL: $*"; FAILURES=$((FAILURES + 1)); }
# expect CODE cmd... : runs cmd, captures stdout/stderr in $WORK/out, checks the exit code.
expect() {
  local want=$1; shift
  "$@" >"$WORK/out" 2>&1
  local got=$?
  if [[ $got -ne $want ]]; then fail "exit $got (want $want): $*"; cat "$WORK/out"; fi
}
contains() { grep -q -- "$1" "$WORK/out" || { fail "output lacks '$1'"; cat "$WORK/out"; }; }
# json_is EXPR: the JSON in $WORK/out, as j, makes the Python expression EXPR true.
json_is() {
  python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); sys.exit(0 if eval(sys.argv[2]) else 1)' \
    "$WORK/out" "$1" || { fail "JSON output fails $1"; cat "$WORK/out"; }
}

cat >"$WORK/config.txt" <<'CFG'
caches {
  name: "default" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "turboquant_k3v4_nc" boundary_layers: 1 memory_budget_bytes: 8388608
}
CFG
printf '# test token\n\nsecret-token\n' >"$WORK/token"
printf 'wrong-token\n' >"$WORK/bad_token"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 50981
}
PORT=$(free_port)
METRICS_PORT=$(free_port)
# Flags in both spellings: --metrics-port and --auth-token-file are the
# server's --metrics_port and --auth_token_file.
"$SERVER" --host 127.0.0.1 --port "$PORT" --metrics-port "$METRICS_PORT" --threads 1 \
  --config "$WORK/config.txt" --auth-token-file "$WORK/token" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
C=(--target "127.0.0.1:$PORT" --auth-token-file "$WORK/token")
for _ in $(seq 100); do
  "$TQKV" info "${C[@]}" >/dev/null 2>&1 && break
  sleep 0.1
done
# not_found_errors: NOT_FOUND errors the server has counted, over every method.
not_found_errors() {
  curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" |
    awk '/^tqkv_rpc_errors_total\{.*code="NOT_FOUND"/ {n += $2} END {print n + 0}'
}
if [[ ! -e /dev/nvidiactl && ! -e /dev/nvidia0 && ! -e /dev/dxg ]]; then
  grep -q "no GPU found" "$WORK/server.log" || { fail "start-up does not say 'no GPU found'"; cat "$WORK/server.log"; }
fi

expect 0 "$TQKV" info "${C[@]}"; contains "4 layers, 2 kv heads, 4 query heads, head_dim 64"
expect 0 "$TQKV" info "${C[@]}" --json; contains '"backend": "cpu"'
expect 0 "$TQKV" info "${C[@]}" --cache default --json; contains '"name": "default"'
expect 1 "$TQKV" info "${C[@]}" --cache nope; contains "has no cache 'nope'; its caches: 'default'"
# snake_case spellings of the CLI's flags name the same flags.
expect 0 "$TQKV" info --target "127.0.0.1:$PORT" --auth_token_file "$WORK/token"
contains "4 layers, 2 kv heads"
expect 1 "$TQKV" info --target "127.0.0.1:$PORT"; contains "UNAUTHENTICATED"
expect 1 "$TQKV" info --target "127.0.0.1:$PORT" --auth-token-file "$WORK/bad_token"
contains "missing or invalid bearer token"

"$TQKV" synth --shape 4,8,2,64 --seed 1 --out "$WORK/k.npy" || fail "synth keys"
"$TQKV" synth --shape 4,8,2,64 --seed 2 --out "$WORK/v.npy" || fail "synth values"
"$TQKV" synth --shape 4,64 --seed 3 --out "$WORK/q.npy" || fail "synth queries"
"$TQKV" synth --shape 2,4,64 --seed 4 --out "$WORK/q3.npy" || fail "synth queries 3-D"

NOT_FOUND_BEFORE=$(not_found_errors)
expect 0 "$TQKV" append "${C[@]}" --sequence s1 --keys "$WORK/k.npy" --values "$WORK/v.npy"
contains "appended 8 tokens at 0"; contains "layer tokens \[8, 8, 8, 8\]"
# A new sequence without --start: no failed call on the server for it.
[[ "$(not_found_errors)" == "$NOT_FOUND_BEFORE" ]] ||
  fail "append of a new sequence counted NOT_FOUND errors ($NOT_FOUND_BEFORE -> $(not_found_errors))"
expect 0 "$TQKV" append "${C[@]}" --sequence j1 --keys "$WORK/k.npy" --values "$WORK/v.npy" --json
contains '"start": 0'; contains '"tokens": 8'; contains '"stored_bytes_bf16"'
json_is 'j["sequence"]["layer_tokens"] == [8, 8, 8, 8]'
expect 0 "$TQKV" sequence "${C[@]}" --sequence j1 --json; contains '"sequence": "j1"'; contains '"pages": '
expect 0 "$TQKV" fork "${C[@]}" --parent j1 --child j1/b --json; contains '"sequence": "j1/b"'
expect 0 "$TQKV" drop "${C[@]}" --sequence j1/b --json; contains '"dropped": "j1/b"'
expect 0 "$TQKV" drop "${C[@]}" --sequence j1 --json; contains '"dropped": "j1"'
# --start defaults to the current length.
expect 0 "$TQKV" append "${C[@]}" --sequence s1 --keys "$WORK/k.npy" --values "$WORK/v.npy"
contains "appended 8 tokens at 8"
expect 1 "$TQKV" append "${C[@]}" --sequence s1 --keys "$WORK/k.npy" --values "$WORK/v.npy" --start 3
contains "FAILED_PRECONDITION"
expect 1 "$TQKV" append "${C[@]}" --sequence s1 --keys "$WORK/q.npy" --values "$WORK/q.npy"
contains "want \[layers, tokens, kv_heads, head_dim\]"
expect 0 "$TQKV" sequence "${C[@]}" --sequence s1; contains "layer tokens \[16, 16, 16, 16\]"
expect 1 "$TQKV" sequence "${C[@]}" --sequence missing; contains "NOT_FOUND"

expect 0 "$TQKV" attend "${C[@]}" --sequence s1 --layer 2 --queries "$WORK/q.npy" \
  --out "$WORK/o.npy" --lse-out "$WORK/lse.npy"
contains "\[1, 4, 64\]"
[[ -s "$WORK/o.npy" && -s "$WORK/lse.npy" ]] || fail "attend outputs missing"
expect 0 "$TQKV" attend "${C[@]}" --sequence s1 --layer 1 --queries "$WORK/q3.npy" --out "$WORK/o3.npy"
contains "\[2, 4, 64\]"
expect 0 "$TQKV" attend "${C[@]}" --sequence s1 --layer 1 --queries "$WORK/q3.npy" --out "$WORK/o3.npy" --json
json_is 'j["shape"] == [2, 4, 64] and j["lse_out"] is None'
expect 1 "$TQKV" attend "${C[@]}" --sequence s1 --layer 9 --queries "$WORK/q.npy" --out "$WORK/x.npy"
contains "INVALID_ARGUMENT"

expect 0 "$TQKV" score "${C[@]}" --sequence s1 --layer 0 --queries "$WORK/q.npy"
contains "logits \[4, 16\]"
expect 0 "$TQKV" score "${C[@]}" --sequence s1 --layer 0 --queries "$WORK/q.npy" --top-k 3 \
  --json --out "$WORK/top.npy"
contains '"columns": 3'; contains '"positions"'
[[ -s "$WORK/top.npy" ]] || fail "score --out missing"

expect 0 "$TQKV" fork "${C[@]}" --parent s1 --child s2; contains "sequence 's2'"
expect 1 "$TQKV" fork "${C[@]}" --parent s1 --child s2; contains "ALREADY_EXISTS"
expect 0 "$TQKV" drop "${C[@]}" --sequence s1; contains "dropped 's1'"
expect 0 "$TQKV" sequence "${C[@]}" --sequence s2; contains "layer tokens \[16, 16, 16, 16\]"
expect 0 "$TQKV" drop "${C[@]}" --sequence s2
expect 1 "$TQKV" drop "${C[@]}" --sequence s2; contains "NOT_FOUND"

expect 0 "$TQKV" load "${C[@]}" --mode mixed --clients 2 --requests 60 --prefill-tokens 20 \
  --prefill-chunk-tokens 8 --decode-steps 4 --score-every 2 --quiet --json
contains '"errors": 0'; contains '"method": "Attend"'; contains '"attend_kernel_share"'
expect 2 "$TQKV" load "${C[@]}" --mode mixed --duration-seconds 0
# The default mode: the layer-by-layer decode loop, three shapes side by side.
expect 0 "$TQKV" load "${C[@]}" --context 12 --batch 2 --decode-steps 3 --quiet
contains "unary"; contains "fused"; contains "stream"; contains "outside_us/l"
expect 0 "$TQKV" load "${C[@]}" --context 12 --batch 2 --decode-steps 2 --variants stream --quiet --json
contains '"variant": "stream"'; contains '"errors": 0'; contains '"messages_per_step": 4'
expect 2 "$TQKV" load "${C[@]}" --variants bogus
expect 2 "$TQKV" load "${C[@]}" --mode sideways
expect 2 "$TQKV" info --bogus

expect 0 "$TQKV" info "${C[@]}"; contains "0 sequences"

# --help and --version.
expect 0 "$SERVER" --help; contains "--port"; contains "--metrics_port"; contains "gRPC port"
contains "(default: 50051)"
expect 0 "$SERVER" --version; contains "^tqkv-server [0-9][0-9.]* (git [A-Za-z0-9._+-]*)$"
expect 0 "$TQKV" --version; contains "^tqkv [0-9][0-9.]* (git [A-Za-z0-9._+-]*)$"
expect 0 "$TQKV" info "${C[@]}"; contains "tqkv-server [0-9][0-9.]* (git "

# A busy port: one clear line, no gRPC internals.
expect 1 "$SERVER" --host 127.0.0.1 --port "$PORT" --metrics_port -1 --threads 1 --config "$WORK/config.txt"
contains "port $PORT on 127.0.0.1 is already in use"
[[ $(wc -l <"$WORK/out") -le 2 ]] || { fail "a busy port prints $(wc -l <"$WORK/out") lines"; cat "$WORK/out"; }
grep -qv "already in use\|no GPU found" "$WORK/out" && { fail "a busy port prints more than its line"; cat "$WORK/out"; }

# The bind. start_plain NAME ARGS...: a server on a kernel-chosen port with
# ARGS; sets PLAIN_PID and PLAIN_PORT once its start-up line is out (20 s).
start_plain() {
  local name=$1; shift
  "$SERVER" --port 0 --metrics_port -1 --threads 1 --config "$WORK/config.txt" "$@" >"$WORK/$name.log" 2>&1 &
  PLAIN_PID=$!
  OTHER_PIDS="$PLAIN_PID"
  PLAIN_PORT=
  for _ in $(seq 200); do
    PLAIN_PORT=$(sed -nE 's/.*listening on [^ ]*:([0-9]+) .*/\1/p' "$WORK/$name.log")
    [[ -n "$PLAIN_PORT" ]] && return 0
    sleep 0.1
  done
  fail "tqkv-server $* did not start"; cat "$WORK/$name.log"
}
stop_plain() { kill "$PLAIN_PID" 2>/dev/null; wait "$PLAIN_PID" 2>/dev/null; OTHER_PIDS=; }
# Without --host and --auth_token_file: loopback only, and nothing to warn about.
start_plain default
grep -q "listening on 127.0.0.1:$PLAIN_PORT " "$WORK/default.log" ||
  { fail "the default bind is not 127.0.0.1"; cat "$WORK/default.log"; }
if command -v ss >/dev/null; then
  # gRPC binds 127.0.0.1 as a dual-stack socket: [::ffff:127.0.0.1].
  BOUND=$(ss -ltnH "sport = :$PLAIN_PORT" | awk '{print $4}' | sort -u | tr '\n' ' ')
  [[ "$BOUND" =~ ^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]):$PLAIN_PORT\ $ ]] ||
    fail "the default server listens on '$BOUND', want 127.0.0.1:$PLAIN_PORT only"
fi
# A non-loopback address of this machine does not reach it.
OTHER_ADDRESS=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -m1 -E '^[0-9.]+$' | grep -v '^127\.')
if [[ -n "$OTHER_ADDRESS" ]]; then
  expect 1 "$TQKV" info --target "$OTHER_ADDRESS:$PLAIN_PORT"; contains "connection refused"
fi
grep -q "WARNING" "$WORK/default.log" && { fail "a loopback server warns"; cat "$WORK/default.log"; }
stop_plain
# --host 0.0.0.0 without auth: one warning line that says how to turn auth on.
start_plain open --host 0.0.0.0
grep -q "listening on 0.0.0.0:$PLAIN_PORT " "$WORK/open.log" || { fail "--host 0.0.0.0 not taken"; cat "$WORK/open.log"; }
[[ $(grep -c "WARNING: serving 0.0.0.0:$PLAIN_PORT without authentication" "$WORK/open.log") -eq 1 ]] &&
  grep -q "give --auth_token_file FILE" "$WORK/open.log" ||
  { fail "--host 0.0.0.0 without auth: no single warning line"; cat "$WORK/open.log"; }
stop_plain
# With auth and no --host: every interface, and no warning.
start_plain authed --auth_token_file "$WORK/token"
grep -q "listening on 0.0.0.0:$PLAIN_PORT .*bearer-token auth" "$WORK/authed.log" ||
  { fail "with auth, the default bind is not 0.0.0.0"; cat "$WORK/authed.log"; }
grep -q "WARNING" "$WORK/authed.log" && { fail "a server with auth warns"; cat "$WORK/authed.log"; }
stop_plain

# Nobody listening: the CLI says so in one line.
DEAD_PORT=$(free_port)
expect 1 "$TQKV" info --target "127.0.0.1:$DEAD_PORT"
contains "cannot reach 127.0.0.1:$DEAD_PORT (connection refused): is tqkv-server running at 127.0.0.1:$DEAD_PORT?"
[[ $(wc -l <"$WORK/out") -eq 1 ]] || { fail "an unreachable server prints more than one line"; cat "$WORK/out"; }
# (A target without a port goes to 50051: command_util_test.cc.)

# The server goes away under `tqkv load`: it backs off, then stops with a
# clear message instead of firing calls at nothing.
SECOND_PORT=$(free_port)
"$SERVER" --host 127.0.0.1 --port "$SECOND_PORT" --metrics_port -1 --threads 1 --config "$WORK/config.txt" \
  >"$WORK/second.log" 2>&1 &
SECOND_PID=$!
OTHER_PIDS="$SECOND_PID"
for _ in $(seq 100); do "$TQKV" info --target "127.0.0.1:$SECOND_PORT" >/dev/null 2>&1 && break; sleep 0.1; done
"$TQKV" load --target "127.0.0.1:$SECOND_PORT" --mode mixed --clients 2 --duration-seconds 60 \
  --prefill-tokens 8 --decode-steps 2 --give-up-seconds 2 --quiet --json >"$WORK/load.json" 2>"$WORK/load.err" &
LOAD_PID=$!
OTHER_PIDS="$SECOND_PID $LOAD_PID"
sleep 1
kill -KILL "$SECOND_PID"; wait "$SECOND_PID" 2>/dev/null
KILLED_AT=$SECONDS
wait "$LOAD_PID"; LOAD_CODE=$?
OTHER_PIDS=
[[ $LOAD_CODE -eq 1 ]] || fail "tqkv load against a dead server exited $LOAD_CODE, want 1"
[[ $((SECONDS - KILLED_AT)) -le 20 ]] || fail "tqkv load took $((SECONDS - KILLED_AT)) s to give up on a dead server"
grep -q "is tqkv-server running at 127.0.0.1:$SECOND_PORT?" "$WORK/load.err" ||
  { fail "tqkv load does not say the server went away"; cat "$WORK/load.err"; }
grep -q '"server_lost"' "$WORK/load.json" || { fail "the load report lacks server_lost"; cat "$WORK/load.json"; }
# Backing off, the two clients make a few dozen calls in the 2 s, not hundreds.
FAILED=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["errors"])' "$WORK/load.json" 2>/dev/null || echo 9999)
[[ $FAILED -le 60 ]] || fail "tqkv load made $FAILED failed calls at a dead server"

# SIGINT on an idle server: it exits 0, promptly (the drain has nothing to wait for).
kill -INT "$SERVER_PID"
INT_AT=$(date +%s%N)
wait "$SERVER_PID"; INT_CODE=$?
INT_MS=$(( ($(date +%s%N) - INT_AT) / 1000000 ))
SERVER_PID=
[[ $INT_CODE -eq 0 ]] || fail "the server exited $INT_CODE on SIGINT, want 0"
echo "idle server exit on SIGINT: $INT_MS ms"
[[ $INT_MS -le 1500 ]] || fail "the idle server took $INT_MS ms to exit on SIGINT"

if [[ $FAILURES -ne 0 ]]; then echo "$FAILURES failure(s)"; exit 1; fi
echo "all server CLI checks passed"
