#!/usr/bin/env bash
# Moving a sequence between two servers on loopback, at its compressed size:
# starts two tqkv-servers with the embedded default config (one
# Llama-3.1-8B cache), prefills one sequence of --context tokens on the
# first, and times `tqkv bench move` to the second (export + import relayed
# by the CLI: three processes). Extra arguments go to `tqkv bench move`.
#
#   scripts/move_bench.sh [--context 32768] [--rounds 3] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TQKV_BIN:-build/bin}
log=$(mktemp -d)
trap 'kill $a $b 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$log"' EXIT
"$bin/tqkv-server" --host 127.0.0.1 --port 0 --metrics_port -1 > "$log/a" 2>&1 & a=$!
"$bin/tqkv-server" --host 127.0.0.1 --port 0 --metrics_port -1 > "$log/b" 2>&1 & b=$!
port() {  # the port a server printed once it listens
  for _ in $(seq 100); do
    p=$(sed -n 's/.*listening on [^:]*:\([0-9]*\).*/\1/p' "$1")
    if [ -n "$p" ]; then echo "$p"; return; fi
    sleep 0.1
  done
  echo "move_bench.sh: a server did not start:" >&2; cat "$1" >&2; exit 1
}
pa=$(port "$log/a"); pb=$(port "$log/b")
"$bin/tqkv" bench move --target "127.0.0.1:$pa" --to "127.0.0.1:$pb" "$@"
