#!/usr/bin/env bash
# The runtime images hold no -dev packages: deploy/docker/bundle-libs.sh copies
# tqkv-server, tqkv and every shared library they load into /opt/tqkv, except
# the C library family, which the runtime base brings. Check that bundle on
# its own: a chroot that holds only the bundle and this machine's C library
# files, as the image's layout does (/opt/tqkv, LD_LIBRARY_PATH=/opt/tqkv/lib),
# must run the server and the CLI; the chrooted server must answer the
# chrooted CLI over loopback and serve /metrics.
# Needs root for chroot (skips otherwise).
# The images' HEALTHCHECK command (from Dockerfile.cpu and Dockerfile.cuda,
# its port pointed at the test server) runs inside that chroot: healthy while
# the server serves, unhealthy once it is gone; ENTRYPOINT names a bundled
# binary.
# Usage: bundle_test.sh TQKV TQKV_SERVER BUNDLE_SCRIPT
set -u
TQKV=$1
SERVER=$2
BUNDLE=$3
DOCKER_DIR=$(cd "$(dirname "$BUNDLE")" && pwd)
source "$(dirname "$0")/lib.sh"
need ldd chroot curl python3
if [[ $(id -u) -ne 0 ]]; then echo "SKIP: chroot needs root"; exit $SKIP; fi
deploy_init
HEALTH=()

ROOT="$WORK/root"
"$BUNDLE" "$ROOT/opt/tqkv" "$TQKV" "$SERVER" || { fail "bundle-libs.sh"; finish; }
# What the runtime base supplies: the dynamic loader and the C library family,
# exactly the files bundle-libs.sh leaves out.
for lib in $(ldd "$TQKV" "$SERVER" | awk '{ for (i = 1; i <= NF; ++i) if ($i ~ /^\//) print $i }' |
             sort -u | grep -E '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux[^/]*)\.so'); do
  mkdir -p "$ROOT$(dirname "$lib")"
  cp -L "$lib" "$ROOT$lib"
done
mkdir -p "$ROOT/tmp" "$ROOT/dev" "$ROOT/etc"
write_small_config "$ROOT/tmp/config.txt"
CHROOT=$(command -v chroot)
IN=(env -i LD_LIBRARY_PATH=/opt/tqkv/lib "$CHROOT" "$ROOT")
"${IN[@]}" /opt/tqkv/bin/tqkv presets >"$WORK/out" 2>&1 || { fail "tqkv in the bundle"; cat "$WORK/out"; }
grep -q turboquant_k3v4_nc "$WORK/out" || fail "tqkv presets printed no presets"
# Without the bundle's libraries nothing runs: the check is not vacuous.
env -i "$CHROOT" "$ROOT" /opt/tqkv/bin/tqkv presets >/dev/null 2>&1 &&
  fail "the chroot runs tqkv without the bundled libraries: it is not isolated"

start_bg "$WORK/server.log" "${IN[@]}" /opt/tqkv/bin/tqkv-server --host 127.0.0.1 --port 0 \
  --metrics_port 0 --threads 1 --config /tmp/config.txt
deadline=$((SECONDS + 20))
until line=$(grep -m1 'listening on' "$WORK/server.log" 2>/dev/null); do
  if [[ $SECONDS -ge $deadline ]] || ! kill -0 "$BG_PID" 2>/dev/null; then
    fail "the bundled tqkv-server did not start"; cat "$WORK/server.log"; finish
  fi
  sleep 0.1
done
port=$(sed -E 's/.*listening on [^ ]*:([0-9]+) .*/\1/' <<<"$line")
metrics=$(sed -E 's/.*\(metrics ([0-9]+)\).*/\1/' <<<"$line")
"${IN[@]}" /opt/tqkv/bin/tqkv info --target "127.0.0.1:$port" >"$WORK/out" 2>&1 ||
  { fail "the bundled CLI against the bundled server"; cat "$WORK/out"; }
grep -q "head_dim 64" "$WORK/out" || { fail "info output"; cat "$WORK/out"; }
curl -sf "http://127.0.0.1:$metrics/metrics" | grep -q '^tqkv_cache_pages_total' ||
  fail "the bundled server serves no tqkv metrics"

# The images' HEALTHCHECK and ENTRYPOINT, with the image's PATH.
IMAGE=(env -i LD_LIBRARY_PATH=/opt/tqkv/lib PATH=/opt/tqkv/bin:/usr/bin:/bin "$CHROOT" "$ROOT")
for dockerfile in "$DOCKER_DIR/Dockerfile.cpu" "$DOCKER_DIR/Dockerfile.cuda"; do
  name=$(basename "$dockerfile")
  entrypoint=$(python3 -c 'import json, re, sys
print(json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])", open(sys.argv[1]).read(), re.M).group(1))[0])' "$dockerfile") ||
    { fail "$name: no JSON-form ENTRYPOINT"; continue; }
  [[ -x "$ROOT/opt/tqkv/bin/$entrypoint" ]] || fail "$name: ENTRYPOINT $entrypoint is not in the bundle"
  mapfile -t health < <(python3 -c 'import json, re, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
cmd = json.loads(re.search(r"^HEALTHCHECK\s.*?\bCMD\s+(\[.*\])", text, re.M).group(1))
print("\n".join(a.replace("127.0.0.1:50051", "127.0.0.1:" + sys.argv[2]) for a in cmd))' "$dockerfile" "$port") ||
    { fail "$name: no JSON-form HEALTHCHECK CMD"; continue; }
  [[ "${health[*]}" == *"127.0.0.1:$port"* ]] || fail "$name: HEALTHCHECK does not probe 127.0.0.1:50051"
  "${IMAGE[@]}" "${health[@]}" >"$WORK/out" 2>&1 ||
    { fail "$name: HEALTHCHECK '${health[*]}' fails against a serving server"; cat "$WORK/out"; }
  HEALTH=("${health[@]}")
done
kill "$BG_PID"; wait "$BG_PID" 2>/dev/null
if [[ ${#HEALTH[@]} -gt 0 ]] && "${IMAGE[@]}" "${HEALTH[@]}" >/dev/null 2>&1; then
  fail "HEALTHCHECK passes with the server gone"
fi
echo "bundle: $(ls "$ROOT/opt/tqkv/lib" | wc -l) libraries, $(du -sh "$ROOT/opt/tqkv" | cut -f1)"
finish "the bundle runs on nothing but the C library"
