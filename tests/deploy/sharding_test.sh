#!/usr/bin/env bash
# Sharded deployment without Docker: three tqkv-servers on loopback behind
# haproxy running deploy/haproxy/haproxy.cfg itself (only the addresses come
# from the environment, as the file provides). Through the router:
#  * 60 sequences are appended twice (the second append states its start
#    position, so it fails unless it reaches the server holding the first) and
#    attended (NOT_FOUND unless routed to that server);
#  * 6 of them are forked to `parent/beam` children, which must land on the
#    parent's server (the fork fails anywhere else), then appended and attended;
#  * one `tqkv load` client, one HTTP/2 connection, runs many sequences: no
#    call may fail, and every server must take part (per-request routing, not
#    per-connection).
# Then each server is asked directly: sequences held, Append and Attend calls
# counted in its /metrics (each must equal what its sequences account for),
# and the spread (each server holds at least 15% of the sequences). haproxy's
# log must map every route key to exactly one server.
# Usage: sharding_test.sh TQKV TQKV_SERVER HAPROXY_CFG
set -u
TQKV=$1
SERVER=$2
HAPROXY_CFG=$3
source "$(dirname "$0")/lib.sh"
need haproxy curl python3
deploy_init

N=60
FORKS=6
write_small_config "$WORK/config.txt"
for s in 0 1 2; do start_server "S$s" "$SERVER" "$WORK/config.txt" || exit 1; done
PORTS=("$S0_PORT" "$S1_PORT" "$S2_PORT")
MPORTS=("$S0_METRICS_PORT" "$S1_METRICS_PORT" "$S2_METRICS_PORT")

ROUTER_PORT=$(free_port)
export TQKV_ROUTER_BIND="127.0.0.1:$ROUTER_PORT" TQKV_SHARD_0="127.0.0.1:${PORTS[0]}" \
  TQKV_SHARD_1="127.0.0.1:${PORTS[1]}" TQKV_SHARD_2="127.0.0.1:${PORTS[2]}"
haproxy -c -f "$HAPROXY_CFG" >"$WORK/haproxy-check.txt" 2>&1 ||
  { fail "haproxy -c rejects $HAPROXY_CFG"; cat "$WORK/haproxy-check.txt"; finish; }
start_bg "$WORK/haproxy.log" haproxy -db -f "$HAPROXY_CFG"
R=(--target "127.0.0.1:$ROUTER_PORT")
if ! wait_until 20 "$TQKV" info "${R[@]}"; then
  echo "router did not answer GetServerInfo:"; cat "$WORK/haproxy.log"; exit 1
fi

"$TQKV" synth --shape 4,8,2,64 --seed 1 --out "$WORK/k.npy" >/dev/null || fail "synth keys"
"$TQKV" synth --shape 4,8,2,64 --seed 2 --out "$WORK/v.npy" >/dev/null || fail "synth values"
"$TQKV" synth --shape 4,64 --seed 3 --out "$WORK/q.npy" >/dev/null || fail "synth queries"
KV=(--keys "$WORK/k.npy" --values "$WORK/v.npy")

# run cmd...: runs a CLI call, reports it with its output when it fails.
run() { "$@" >"$WORK/out" 2>&1 || { fail "$*"; cat "$WORK/out"; }; }

start=$SECONDS
for i in $(seq 1 $N); do
  run "$TQKV" append "${R[@]}" --sequence "chat-$i" "${KV[@]}" --start 0
  run "$TQKV" append "${R[@]}" --sequence "chat-$i" "${KV[@]}" --start 8
  run "$TQKV" attend "${R[@]}" --sequence "chat-$i" --layer 2 --queries "$WORK/q.npy" \
    --out "$WORK/o.npy"
done
for i in $(seq 1 $FORKS); do
  run "$TQKV" fork "${R[@]}" --parent "chat-$i" --child "chat-$i/beam"
  run "$TQKV" append "${R[@]}" --sequence "chat-$i/beam" "${KV[@]}" --start 16
  run "$TQKV" attend "${R[@]}" --sequence "chat-$i/beam" --layer 1 --queries "$WORK/q.npy" \
    --out "$WORK/o.npy"
done
echo "$((3 * (N + FORKS))) calls through the router in $((SECONDS - start)) s"

# Each server, asked directly.
total=0
for s in 0 1 2; do
  info=$("$TQKV" info --target "127.0.0.1:${PORTS[$s]}" --json) || { fail "info on shard $s"; continue; }
  seqs=$(python3 -c 'import json,sys; print(sum(int(c.get("sequences", 0)) for c in json.load(sys.stdin)["caches"]))' <<<"$info")
  children=0
  for i in $(seq 1 $FORKS); do
    if "$TQKV" sequence --target "127.0.0.1:${PORTS[$s]}" --sequence "chat-$i/beam" >/dev/null 2>&1; then
      children=$((children + 1))
      "$TQKV" sequence --target "127.0.0.1:${PORTS[$s]}" --sequence "chat-$i" >/dev/null 2>&1 ||
        fail "chat-$i/beam is on shard $s but its parent chat-$i is not"
    fi
  done
  parents=$((seqs - children))
  appends=$(metric_value "${MPORTS[$s]}" tqkv_rpc_requests_total method=Append code=OK)
  attends=$(metric_value "${MPORTS[$s]}" tqkv_rpc_requests_total method=Attend code=OK)
  echo "shard $s: $seqs sequences ($children forked children), Append OK ${appends:-none}, Attend OK ${attends:-none}"
  # Two appends and one attend per sequence, one append and one attend per child.
  python3 -c "import sys; sys.exit(0 if float('${appends:-0}') == 2 * $parents + $children else 1)" ||
    fail "shard $s: $appends Appends for $parents sequences and $children children"
  python3 -c "import sys; sys.exit(0 if float('${attends:-0}') == $parents + $children else 1)" ||
    fail "shard $s: $attends Attends for $parents sequences and $children children"
  [[ $((parents * 100)) -ge $((N * 15)) ]] ||
    fail "shard $s holds $parents of $N sequences, under 15%"
  total=$((total + seqs))
done
[[ $total -eq $((N + FORKS)) ]] || fail "the shards hold $total sequences, want $((N + FORKS))"

# haproxy's log: "... /tqkv.v1.KvCache/Append route-key=chat-7 -> tqkv/tqkv-shard-1 ..."
python3 - "$WORK/haproxy.log" <<'PY' || fail "haproxy log: a route key went to more than one server"
import re, sys
servers = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"route-key=(\S+) -> \S+/(\S+)", line)
    if m and m.group(1) != "-":
        servers.setdefault(m.group(1), set()).add(m.group(2))
split = {k: v for k, v in servers.items() if len(v) > 1}
print(f"haproxy log: {len(servers)} route keys, {len(split)} on more than one server")
sys.exit(1 if split or len(servers) < 60 else 0)
PY

# One client, one connection, many sequences: per-request routing.
declare -A before
for s in 0 1 2; do
  before[$s]=$(metric_value "${MPORTS[$s]}" tqkv_rpc_requests_total method=Append code=OK)
done
"$TQKV" load "${R[@]}" --mode mixed --clients 1 --requests 120 --prefill-tokens 12 --prefill-chunk-tokens 4 --decode-steps 3 \
  --score-every 2 --quiet --json >"$WORK/load.json" 2>&1 || { fail "tqkv load through the router"; cat "$WORK/load.json"; }
grep -q '"errors": 0' "$WORK/load.json" || { fail "tqkv load had errors"; cat "$WORK/load.json"; }
for s in 0 1 2; do
  after=$(metric_value "${MPORTS[$s]}" tqkv_rpc_requests_total method=Append code=OK)
  python3 -c "import sys; sys.exit(0 if float('${after:-0}') > float('${before[$s]:-0}') else 1)" ||
    fail "shard $s took no Append from the single load client (per-connection routing?)"
  echo "shard $s: $(python3 -c "print(int(float('${after:-0}') - float('${before[$s]:-0}')))") Appends from the load client"
done

grep -q "\"method\": \"AppendStream\"" "$WORK/load.json" || fail "the load run sent no AppendStream"
finish "sharding: every sequence on one shard, forks with their parents, spread even"
