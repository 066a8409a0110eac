#!/usr/bin/env bash
# The Kubernetes manifests (deploy/kubernetes/) without a cluster: yamllint
# (strict), kubernetes-validate (PyPI, in the build's venv: the Kubernetes
# JSON schemas ship inside the package, so this runs offline) against the
# oldest and the newest Kubernetes it knows that has gRPC probes (1.27 and its
# default), and the topology: the StatefulSet's headless Service, gRPC health
# probes on the gRPC port, a GPU requested and limited, scrape annotations on
# the metrics port with /metrics on every interface, gRPC on every interface
# with a token file from a Secret (auth on), and a router whose shard
# addresses are exactly the StatefulSet's pods (and haproxy.cfg's servers).
# Usage: kubernetes_test.sh REPO_ROOT VENV_DIR   (exit 77: a tool missing)
set -u
REPO=$1
VENV=$2
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
need yamllint
VALIDATE="$VENV/bin/kubernetes-validate"
if [[ ! -x "$VALIDATE" ]]; then
  echo "SKIP: $VALIDATE not found (scripts/python_env.sh installs kubernetes-validate)"
  exit $SKIP
fi
PY=$(yaml_python) || { echo "SKIP: no python3 with PyYAML (scripts/setup.sh installs python3-yaml)"; exit $SKIP; }
deploy_init
K8S="$REPO/deploy/kubernetes"

yamllint -s "$K8S" || fail "yamllint"
for version in 1.27.0 ""; do
  "$VALIDATE" --strict --quiet ${version:+-k "$version"} "$K8S"/tqkv-*.yaml ||
    fail "kubernetes-validate ${version:-(its default version)}"
done

"$PY" - "$K8S" "$REPO/deploy/haproxy/haproxy.cfg" <<'PY' || fail "topology"
import os, re, sys, yaml
k8s, haproxy_cfg = sys.argv[1], sys.argv[2]
docs = []
for name in sorted(os.listdir(k8s)):
    if name.startswith("tqkv-") and name.endswith(".yaml"):
        docs += [(name, d) for d in yaml.safe_load_all(open(os.path.join(k8s, name))) if d]
kinds = {(d["kind"], d["metadata"]["name"]): d for _, d in docs}
failures = []
def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)

kustomization = yaml.safe_load(open(os.path.join(k8s, "kustomization.yaml")))
check(sorted(kustomization["resources"]) == sorted({n for n, _ in docs}),
      f"kustomization.yaml lists {kustomization['resources']}, not every manifest")

sts = kinds.get(("StatefulSet", "tqkv"))
check(sts is not None, "no StatefulSet tqkv")
svc = kinds.get(("Service", sts["spec"]["serviceName"])) if sts else None
check(svc is not None and svc["spec"].get("clusterIP") == "None",
      "the StatefulSet's serviceName is not a headless Service")
if sts and svc:
    pod = sts["spec"]["template"]
    check(all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()),
          "the headless Service does not select the StatefulSet's pods")
    (server,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    check(ports == {"grpc": 50051, "metrics": 9464}, f"server ports {ports}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = server.get(probe, {})
        check(p.get("grpc", {}).get("port") == 50051, f"{probe} is not a gRPC health probe on 50051: {p}")
    res = server["resources"]
    check(str(res["requests"].get("nvidia.com/gpu")) == "1" and str(res["limits"].get("nvidia.com/gpu")) == "1",
          f"the server does not request and limit one GPU: {res}")
    check("memory" in res["requests"] and "cpu" in res["requests"], f"no cpu/memory requests: {res}")
    notes = pod["metadata"].get("annotations", {})
    check(notes.get("prometheus.io/scrape") == "true" and notes.get("prometheus.io/port") == str(ports["metrics"])
          and notes.get("prometheus.io/path") == "/metrics", f"scrape annotations {notes}")
    args = server.get("args", [])
    check("--metrics_host=0.0.0.0" in args, f"/metrics listens on loopback only: {args}")
    # Reached from other pods (the router, clients): every interface, and so
    # a token file, from a Secret volume.
    check("--host=0.0.0.0" in args, f"gRPC listens on loopback only (the default): {args}")
    tokens = [a.split("=", 1)[1] for a in args if a.startswith("--auth_token_file=")]
    secrets = {v["name"] for v in pod["spec"].get("volumes", []) if "secret" in v}
    secret_dirs = {m["mountPath"] for m in server.get("volumeMounts", []) if m["name"] in secrets}
    check(len(tokens) == 1 and os.path.dirname(tokens[0]) in secret_dirs,
          f"--auth_token_file {tokens} is not on a Secret volume {sorted(secret_dirs)}: gRPC open to the cluster")
    data = [a for a in args if a.startswith("--data_dir=")]
    mounts = {m["name"]: m["mountPath"] for m in server.get("volumeMounts", [])}
    claims = {c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])}
    claimed = {path for name, path in mounts.items() if name in claims}
    check(len(data) == 1 and data[0].split("=", 1)[1] in claimed,
          f"--data_dir {data} is not on a volume claim: mounts {mounts}, claims {claims}")
    grace = [float(a.split("=", 1)[1]) for a in args if a.startswith("--shutdown_grace_seconds=")]
    check(grace and pod["spec"].get("terminationGracePeriodSeconds", 30) > grace[0],
          "terminationGracePeriodSeconds does not outlast --shutdown_grace_seconds")

router = kinds.get(("Deployment", "tqkv-router"))
check(router is not None and ("Service", "tqkv-router") in kinds, "no router Deployment and Service")
if router and sts:
    (proxy,) = router["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in proxy.get("env", [])}
    want = {f"TQKV_SHARD_{i}": f"tqkv-{i}.{sts['spec']['serviceName']}:50051"
            for i in range(sts["spec"]["replicas"])}
    check(env == want, f"router shards {env}, want the StatefulSet's pods {want}")
    cfg_shards = re.findall(r'^\s*server\s+\S+\s+"\$\{(TQKV_SHARD_\d+)-', open(haproxy_cfg).read(), re.M)
    check(sorted(cfg_shards) == sorted(want), f"haproxy.cfg's servers {cfg_shards} are not {sorted(want)}")
    for probe in ("readinessProbe", "livenessProbe"):
        check("tcpSocket" in proxy.get(probe, {}), f"router {probe} is not a TCP check")
sys.exit(1 if failures else 0)
PY
finish "Kubernetes manifests: yamllint, kubernetes-validate (strict) and the topology checks pass"
