#!/usr/bin/env bash
# The monitoring topology without Docker: a tqkv-server and a real Prometheus
# (Debian's) on loopback, Prometheus running deploy/prometheus/prometheus.yml
# and alerts.yml as shipped except for the target addresses (tqkv:9464 ->
# the server's metrics port; the three shard targets -> loopback ports where
# nothing listens), the scrape interval (2 s, timeout 2 s: the rates of the
# dashboard's stat panels need two scrapes in their window) and its storage,
# in a temp dir. Rules are untouched (15 s); every wait is bounded at 60 s
# (90 s for the stat panels).
# Checks: after an append through the CLI, Prometheus's HTTP API reports
# tqkv_cache_bytes_saved equal to what the append said it saved (bf16 bytes
# minus stored bytes); the single target is up and the shard targets down;
# every alert rule evaluates without error; every dashboard and rule
# expression is accepted by Prometheus's query API.
# Usage: prometheus_smoke_test.sh TQKV TQKV_SERVER REPO_ROOT
set -u
TQKV=$1
SERVER=$2
REPO=$3
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
need prometheus curl python3
PY=$(yaml_python) || { echo "SKIP: no python3 with PyYAML (scripts/setup.sh installs python3-yaml)"; exit $SKIP; }
deploy_init

start_small_server

"$TQKV" synth --shape 4,20,2,64 --seed 1 --out "$WORK/k.npy" >/dev/null || fail "synth keys"
"$TQKV" synth --shape 4,20,2,64 --seed 2 --out "$WORK/v.npy" >/dev/null || fail "synth values"
"$TQKV" append "${C[@]}" --sequence smoke --keys "$WORK/k.npy" --values "$WORK/v.npy" \
  >"$WORK/append.txt" 2>&1 || { fail "append"; cat "$WORK/append.txt"; }
# "appended 20 tokens at 0: stored 29440 bytes (81920 as bf16)"
stored=$(sed -nE 's/.*stored ([0-9]+) bytes \(([0-9]+) as bf16\).*/\1/p' "$WORK/append.txt")
bf16=$(sed -nE 's/.*stored ([0-9]+) bytes \(([0-9]+) as bf16\).*/\2/p' "$WORK/append.txt")
[[ -n "$stored" && -n "$bf16" && $bf16 -gt $stored ]] || { fail "append output: $(cat "$WORK/append.txt")"; finish; }
want_saved=$((bf16 - stored))
echo "append stored $stored bytes for $bf16 bf16 bytes: $want_saved saved"

# The shipped configuration, target addresses rewritten.
down_ports=()
for _ in 0 1 2; do down_ports+=("$(free_port)"); done
sed -e "s/^  scrape_interval: 15s/  scrape_interval: 2s/" -e "s/^  scrape_timeout: 10s/  scrape_timeout: 2s/" \
    -e "s/\"tqkv:9464\"/\"127.0.0.1:$S_METRICS_PORT\"/" \
    -e "s/\"tqkv-shard-0:9464\"/\"127.0.0.1:${down_ports[0]}\"/" \
    -e "s/\"tqkv-shard-1:9464\"/\"127.0.0.1:${down_ports[1]}\"/" \
    -e "s/\"tqkv-shard-2:9464\"/\"127.0.0.1:${down_ports[2]}\"/" \
    "$REPO/deploy/prometheus/prometheus.yml" >"$WORK/prometheus.yml"
cp "$REPO/deploy/prometheus/alerts.yml" "$WORK/"
diff "$REPO/deploy/prometheus/prometheus.yml" "$WORK/prometheus.yml" | grep -c '^>' |
  grep -qx 4 || fail "the rewrite did not change exactly the scrape interval, its timeout and the two target lines"

PROM_PORT=$(free_port)
start_bg "$WORK/prometheus.log" prometheus --config.file="$WORK/prometheus.yml" \
  --storage.tsdb.path="$WORK/data" --web.listen-address="127.0.0.1:$PROM_PORT" \
  --log.level=warn
API="http://127.0.0.1:$PROM_PORT/api/v1"

"$PY" - "$API" "$want_saved" "$REPO" "$HERE" "$TQKV" "127.0.0.1:$S_PORT" <<'PY' || fail "Prometheus checks (log: $(tail -5 "$WORK/prometheus.log"))"
import json, subprocess, sys, time, urllib.parse, urllib.request
api, want_saved, repo, here, tqkv, target = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
deadline = time.time() + 60
start = time.time()

def get(path, **params):
    url = f"{api}/{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:   # 400 / 422: a bad query, with its error
        try:
            return json.load(e)
        except ValueError:                # 503 "Service Unavailable" while starting
            return None
    except ValueError:                    # a body that is not JSON yet: starting
        return None
    except OSError:
        return None                       # not listening yet

def query(q):
    r = get("query", query=q)
    return r["data"]["result"] if r and r.get("status") == "success" else None

failures = 0
def fail(msg):
    global failures
    failures += 1
    print("FAIL:", msg)

# 1. bytes saved as Prometheus scraped it.
saved = None
while time.time() < deadline:
    result = query('tqkv_cache_bytes_saved{cache="default", deployment="single"}')
    if result:
        saved = float(result[0]["value"][1])
        if saved == want_saved:
            break
    time.sleep(0.5)
print(f"bytes saved in Prometheus after {time.time() - start:.1f} s: {saved} (want {want_saved:g})")
if saved != want_saved:
    fail(f"tqkv_cache_bytes_saved is {saved}, want {want_saved:g}")

# 2. which targets are up (each shows once it has been scraped, within 15 s).
up = {}
while time.time() < deadline and len(up) < 4:
    up = {r["metric"]["instance"]: (r["metric"].get("deployment"), r["value"][1])
          for r in (query("up{job='tqkv'}") or [])}
    time.sleep(0.5)
singles = [v for d, v in up.values() if d == "single"]
shards = [v for d, v in up.values() if d == "sharded"]
if singles != ["1"] or sorted(shards) != ["0", "0", "0"]:
    fail(f"up by target: {up}")

# 3. the alert rules load and evaluate cleanly (first evaluation within 15 s).
rules = []
while time.time() < deadline:
    r = get("rules")
    rules = [rule for g in (r or {}).get("data", {}).get("groups", []) for rule in g["rules"]]
    if rules and all(rule.get("health") == "ok" for rule in rules):
        break
    time.sleep(0.5)
names = sorted(rule["name"] for rule in rules)
bad = [(rule["name"], rule.get("health"), rule.get("lastError")) for rule in rules
       if rule.get("health") != "ok"]
print(f"rules: {names}")
if len(rules) < 4 or bad:
    fail(f"rules not all evaluated cleanly: {bad or names}")
# TqkvNoServerUp may be pending from an evaluation before the first scrape
# (absent() of an up that is not there yet); anything else is a false alarm.
firing = [a["labels"]["alertname"] for a in (get("alerts") or {}).get("data", {}).get("alerts", [])
          if a.get("state") == "firing" or a["labels"]["alertname"] != "TqkvNoServerUp"]
if firing:
    fail(f"alerts active on an idle, nearly empty server: {firing}")

# 4. every expression the dashboard and the rules ship parses and runs.
exprs = subprocess.run(
    [sys.executable, f"{here}/promql_names.py", "exprs", *__import__("glob").glob(f"{repo}/deploy/grafana/dashboards/*.json"),
     f"{repo}/deploy/prometheus/alerts.yml"], capture_output=True, text=True, check=True).stdout
count = 0
for line in exprs.splitlines():
    e = json.loads(line)
    count += 1
    expr = e["expr"]
    if expr.startswith("label_values("):
        inner, label = expr[len("label_values("):-1].rsplit(",", 1)
        r = get(f"label/{label.strip()}/values", **{"match[]": inner.strip()})
        ok = r and r.get("status") == "success" and r["data"]
    else:
        r = get("query", query=expr)
        ok = r and r.get("status") == "success"
    if not ok:
        fail(f"{e['where']}: Prometheus rejects or returns nothing for {expr}: {r and r.get('error')}")
print(f"{count} dashboard and rule expressions accepted by Prometheus")

# 5. the dashboard's top row of stat panels shows a value for the live
# server (rates need two scrapes in their window: wait for them).
dashboard = json.load(open(f"{repo}/deploy/grafana/dashboards/tqkv.json"))
top = [p for p in dashboard["panels"] if p["type"] == "stat"]
if len(top) < 7:
    fail(f"the dashboard has {len(top)} stat panels, want the 7 of its top row")
by_title = {}
for line in exprs.splitlines():
    e = json.loads(line)
    by_title.setdefault(e["where"].split("panel '", 1)[-1].rstrip("'"), []).append(e["expr"])
def finite(results):
    return results and all(r and all(x["value"][1] not in ("NaN", "+Inf", "-Inf") for x in r) for r in results)
values = {}
while time.time() < deadline + 30:
    # Calls between scrapes: the rates (error rate, p99) have something to show.
    subprocess.run([tqkv, "info", "--target", target], capture_output=True)
    values = {p["title"]: [query(x) for x in by_title.get(p["title"], [])] for p in top}
    if all(finite(v) for v in values.values()):
        break
    time.sleep(1)
for title, results in values.items():
    shown = [[(r["metric"], r["value"][1]) for r in res] if res else res for res in results]
    print(f"stat '{title}': {shown}")
    if not finite(results):
        fail(f"stat panel '{title}' shows no number")
servers = values.get("Servers up") or [[]]
if servers[0] and servers[0][0]["value"][1] != "1":
    fail(f"Servers up shows {servers[0][0]['value'][1]}, want 1")
version = values.get("Version") or [[]]
if version[0] and not version[0][0]["metric"].get("revision"):
    fail(f"Version shows no revision: {version[0]}")
sys.exit(1 if failures else 0)
PY
finish "Prometheus scraped the appended bytes and runs every shipped expression"
