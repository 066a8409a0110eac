#!/usr/bin/env bash
# The server-facing CLI subcommands end to end: starts tqkv-server on a free
# loopback port with a small config and bearer-token auth, then runs
# info / append / sequence / attend / score / fork / drop / load through the
# tqkv binary, checking outputs and exit codes. The server is killed on exit.
# Usage: tqkv_server_cli_test.sh path/to/tqkv path/to/tqkv-server
set -u
TQKV=$1
SERVER=$2
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
  if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
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

cat >"$WORK/config.txt" <<'CFG'
caches {
  name: "default" num_layers: 4 num_kv_heads: 2 num_query_heads: 4 head_dim: 64
  page_tokens: 8 preset: "turboquant_k3v4_nc" boundary_layers: 1 memory_budget_bytes: 8388608
}
CFG
printf '# test token\n\nsecret-token\n' >"$WORK/token"
printf 'wrong-token\n' >"$WORK/bad_token"

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 50981)
"$SERVER" --host 127.0.0.1 --port "$PORT" --metrics_port -1 --threads 1 \
  --config "$WORK/config.txt" --auth_token_file "$WORK/token" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
C=(--target "127.0.0.1:$PORT" --auth-token-file "$WORK/token")
for _ in $(seq 50); do
  "$TQKV" info "${C[@]}" >/dev/null 2>&1 && break
  sleep 0.1
done

expect 0 "$TQKV" info "${C[@]}"; contains "4 layers, 2 kv heads, 4 query heads, head_dim 64"
expect 0 "$TQKV" info "${C[@]}" --json; contains '"backend": "cpu"'
expect 1 "$TQKV" info --target "127.0.0.1:$PORT"; contains "UNAUTHENTICATED"
expect 1 "$TQKV" info --target "127.0.0.1:$PORT" --auth-token-file "$WORK/bad_token"
contains "missing or invalid bearer token"

"$TQKV" synth --shape 4,8,2,64 --seed 1 --out "$WORK/k.npy" || fail "synth keys"
"$TQKV" synth --shape 4,8,2,64 --seed 2 --out "$WORK/v.npy" || fail "synth values"
"$TQKV" synth --shape 4,64 --seed 3 --out "$WORK/q.npy" || fail "synth queries"
"$TQKV" synth --shape 2,4,64 --seed 4 --out "$WORK/q3.npy" || fail "synth queries 3-D"

expect 0 "$TQKV" append "${C[@]}" --sequence s1 --keys "$WORK/k.npy" --values "$WORK/v.npy"
contains "appended 8 tokens at 0"; contains "layer tokens \[8, 8, 8, 8\]"
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

if [[ $FAILURES -ne 0 ]]; then echo "$FAILURES failure(s)"; exit 1; fi
echo "all server CLI checks passed"
