#!/usr/bin/env bash
# Rebalancing behind the real haproxy, on loopback: four tqkv-servers, the
# router first on three of them (deploy/haproxy/haproxy.cfg as is), 40
# sequences (and forks) appended and attended through it. Then a fourth shard
# joins the router's config, `tqkv rebalance` moves every sequence whose key
# the router now sends elsewhere, and every sequence must answer through the
# router with exactly the attention it gave before (byte-identical .npy), none
# lost. Then shard 1 is drained: removed from the router, rebalanced away
# (--from), and left empty, every sequence still answering the same.
# Usage: rebalance_test.sh TQKV TQKV_SERVER HAPROXY_CFG
set -u
TQKV=$1
SERVER=$2
HAPROXY_CFG=$3
source "$(dirname "$0")/lib.sh"
need haproxy python3
deploy_init

N=40
FORKS=4
write_small_config "$WORK/config.txt"
for s in 0 1 2 3; do start_server "S$s" "$SERVER" "$WORK/config.txt" || exit 1; done
PORTS=("$S0_PORT" "$S1_PORT" "$S2_PORT" "$S3_PORT")
ALL="127.0.0.1:${PORTS[0]},127.0.0.1:${PORTS[1]},127.0.0.1:${PORTS[2]},127.0.0.1:${PORTS[3]}"

ROUTER_PORT=$(free_port)
R=(--target "127.0.0.1:$ROUTER_PORT")
HAPROXY_PID=
# router CFG SHARD_INDICES...: (re)starts haproxy on CFG with those shards
# as TQKV_SHARD_0.. (a 4th server line is added to the config for a 4th).
router() {
  local cfg=$1; shift
  [[ -n "$HAPROXY_PID" ]] && { kill "$HAPROXY_PID"; wait "$HAPROXY_PID" 2>/dev/null; }
  export TQKV_ROUTER_BIND="127.0.0.1:$ROUTER_PORT"
  local i=0 s
  for s in "$@"; do export "TQKV_SHARD_$i=127.0.0.1:${PORTS[$s]}"; i=$((i + 1)); done
  haproxy -c -f "$cfg" >"$WORK/haproxy-check.txt" 2>&1 || { fail "haproxy -c rejects $cfg"; cat "$WORK/haproxy-check.txt"; finish; }
  start_bg "$WORK/haproxy.log" haproxy -db -f "$cfg"
  HAPROXY_PID=$BG_PID
  wait_until 20 "$TQKV" info "${R[@]}" || { echo "router did not answer"; cat "$WORK/haproxy.log"; exit 1; }
  # Every server must be up in haproxy's view before keys are asked about.
  sleep 2.5
}
# The deploy config with a fourth shard, as an operator adds one: a new
# server line with a new id (the ids of the others unchanged).
sed 's/^  server tqkv-shard-2 .*$/&\n  server tqkv-shard-3 "${TQKV_SHARD_3-tqkv-shard-3:50051}" id 4/' "$HAPROXY_CFG" >"$WORK/haproxy4.cfg"
grep -q tqkv-shard-3 "$WORK/haproxy4.cfg" || { fail "could not add a fourth shard to $HAPROXY_CFG"; finish; }

router "$HAPROXY_CFG" 0 1 2
"$TQKV" synth --shape 4,8,2,64 --seed 1 --out "$WORK/k.npy" >/dev/null || fail "synth keys"
"$TQKV" synth --shape 4,8,2,64 --seed 2 --out "$WORK/v.npy" >/dev/null || fail "synth values"
"$TQKV" synth --shape 4,64 --seed 3 --out "$WORK/q.npy" >/dev/null || fail "synth queries"
KV=(--keys "$WORK/k.npy" --values "$WORK/v.npy")
run() { "$@" >"$WORK/out" 2>&1 || { fail "$*"; cat "$WORK/out"; }; }
IDS=()
for i in $(seq 1 $N); do
  run "$TQKV" append "${R[@]}" --sequence "chat-$i" "${KV[@]}" --start 0
  run "$TQKV" append "${R[@]}" --sequence "chat-$i" "${KV[@]}" --start 8
  IDS+=("chat-$i")
done
for i in $(seq 1 $FORKS); do
  run "$TQKV" fork "${R[@]}" --parent "chat-$i" --child "chat-$i/beam"
  run "$TQKV" append "${R[@]}" --sequence "chat-$i/beam" "${KV[@]}" --start 16
  IDS+=("chat-$i/beam")
done
# attend_all DIR: every sequence's attention through the router, one .npy each.
attend_all() {
  mkdir -p "$1"
  local id
  for id in "${IDS[@]}"; do
    run "$TQKV" attend "${R[@]}" --sequence "$id" --layer 2 --queries "$WORK/q.npy" --out "$1/${id//\//_}.npy"
  done
}
# held S: sequences server S holds, asked directly.
held() {
  "$TQKV" info --target "127.0.0.1:${PORTS[$1]}" --json |
    python3 -c 'import json,sys; print(sum(int(c.get("sequences", 0)) for c in json.load(sys.stdin)["caches"]))'
}
# same_as_before DIR: every sequence answered, identically.
same_as_before() {
  local id
  for id in "${IDS[@]}"; do
    cmp -s "$WORK/before/${id//\//_}.npy" "$1/${id//\//_}.npy" || fail "$id answers differently after ${2}"
  done
}
attend_all "$WORK/before"
[[ $(held 3) -eq 0 ]] || fail "shard 3 holds sequences before it joined"

# A fourth shard joins.
router "$WORK/haproxy4.cfg" 0 1 2 3
"$TQKV" rebalance --router "127.0.0.1:$ROUTER_PORT" --servers "$ALL" --dry-run --json >"$WORK/dry.json" ||
  { fail "rebalance --dry-run"; cat "$WORK/dry.json"; }
"$TQKV" rebalance --router "127.0.0.1:$ROUTER_PORT" --servers "$ALL" --json >"$WORK/rebalance.json" ||
  { fail "rebalance"; cat "$WORK/rebalance.json"; }
python3 - "$WORK/dry.json" "$WORK/rebalance.json" <<'PY' || fail "rebalance moved nothing, or not what its dry run said"
import json, sys
dry, done = (json.load(open(p)) for p in sys.argv[1:])
print(f"rebalance: {done['moved']} moved, {done['kept']} already home, {done['bytes']} bytes")
sys.exit(0 if done["moved"] > 0 and done["moved"] == dry["moved"] and done["moves"] == dry["moves"] else 1)
PY
total=0
for s in 0 1 2 3; do total=$((total + $(held $s))); done
[[ $total -eq ${#IDS[@]} ]] || fail "the shards hold $total sequences after rebalancing, want ${#IDS[@]}"
[[ $(held 3) -gt 0 ]] || fail "the new shard holds no sequence"
attend_all "$WORK/after-add"
same_as_before "$WORK/after-add" "adding a shard"
"$TQKV" rebalance --router "127.0.0.1:$ROUTER_PORT" --servers "$ALL" --json >"$WORK/again.json" || fail "rebalance again"
grep -q '"moved": 0' "$WORK/again.json" || fail "a second rebalance still moved sequences"

# Drain shard 1: its line leaves the router's config first (the others keep
# their ids, so their keys stay), then its sequences go.
sed '/server tqkv-shard-1 /d' "$WORK/haproxy4.cfg" >"$WORK/haproxy-drain.cfg"
router "$WORK/haproxy-drain.cfg" 0 1 2 3
"$TQKV" rebalance --router "127.0.0.1:$ROUTER_PORT" --servers "$ALL" --from "127.0.0.1:${PORTS[1]}" --json \
  >"$WORK/drain.json" || { fail "drain"; cat "$WORK/drain.json"; }
[[ $(held 1) -eq 0 ]] || fail "shard 1 still holds $(held 1) sequences after the drain"
total=0
for s in 0 2 3; do total=$((total + $(held $s))); done
[[ $total -eq ${#IDS[@]} ]] || fail "the shards hold $total sequences after the drain, want ${#IDS[@]}"
attend_all "$WORK/after-drain"
same_as_before "$WORK/after-drain" "draining shard 1"
finish "rebalance: a shard added and one drained behind haproxy, no sequence lost or changed"
