#!/usr/bin/env python3
"""docker-compose.yml without a Docker engine: Debian's docker-compose must
accept the file with no profile and with each profile, and the topology each
profile resolves to must hang together:
  * the services each profile starts are the intended ones;
  * no two started services publish the same host port;
  * every host Prometheus scrapes (deploy/prometheus/prometheus.yml) and every
    server the router forwards to (deploy/haproxy/haproxy.cfg, its defaults)
    is a service name or network alias started in the profile that needs it;
  * GPU services reserve an NVIDIA device, CPU services none; the images'
    Dockerfiles exist; every bind-mounted path exists in the repository;
  * Grafana's provisioned dashboard path is where the dashboards are mounted;
  * Prometheus sends alerts to the Alertmanager service, which every profile
    starts with its configuration mounted.
Usage: compose_test.py REPO_ROOT   (exit 77: docker-compose or PyYAML missing)
"""
import os
import re
import shutil
import subprocess
import sys

SKIP = 77
repo = os.path.abspath(sys.argv[1])
if shutil.which("docker-compose") is None:
    print("SKIP: docker-compose not found (scripts/setup.sh installs it)")
    sys.exit(SKIP)
try:
    import yaml
except ImportError:
    # Debian's python3 has python3-yaml (scripts/setup.sh); PATH's may not.
    if os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and \
            os.access("/usr/bin/python3", os.X_OK):
        os.execv("/usr/bin/python3", ["/usr/bin/python3", *sys.argv])
    print("SKIP: PyYAML not found (scripts/setup.sh installs python3-yaml)")
    sys.exit(SKIP)

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what)


def compose_config(profile):
    args = ["docker-compose", "--project-directory", repo, "-f",
            os.path.join(repo, "docker-compose.yml")]
    if profile:
        args += ["--profile", profile]
    # No variables from the caller's environment: the file's defaults.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TQKV_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_"))}
    result = subprocess.run(args + ["config"], capture_output=True, text=True, env=env)
    check(result.returncode == 0,
          f"docker-compose config (profile {profile or 'none'}) failed: {result.stderr.strip()}")
    return yaml.safe_load(result.stdout) if result.returncode == 0 else None


def started(config, profile):
    """Services `up` starts with this profile: those without profiles, and
    those that list it."""
    return {name: s for name, s in config["services"].items()
            if not s.get("profiles") or profile in s.get("profiles", [])}


def names_on_network(services):
    names = set()
    for name, s in services.items():
        names.add(name)
        for net in (s.get("networks") or {}).values():
            names.update((net or {}).get("aliases", []))
    return names


def port_published(port):
    """(host address, host port) of one entry of a service's ports, in the
    long form or the short 'ADDRESS:PUBLISHED:TARGET/tcp' one that
    docker-compose 1.29 prints for a port with an address."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), str(port.get("published"))
    parts = str(port).split("/")[0].rsplit(":", 2)
    return (parts[0] if len(parts) == 3 else ""), parts[-2] if len(parts) >= 2 else parts[0]


def gpu_reservations(service):
    devices = (service.get("deploy", {}).get("resources", {}).get("reservations", {})
               .get("devices", []))
    return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]


prom = yaml.safe_load(open(os.path.join(repo, "deploy/prometheus/prometheus.yml")))
target_groups = [g for job in prom["scrape_configs"] for g in job.get("static_configs", [])]
haproxy_cfg = open(os.path.join(repo, "deploy/haproxy/haproxy.cfg")).read()
shard_hosts = re.findall(r'^\s*server\s+\S+\s+"\$\{TQKV_SHARD_\d+-([^:}]+):\d+\}"', haproxy_cfg, re.M)
check(len(shard_hosts) == 3, f"haproxy.cfg names {len(shard_hosts)} shards, want 3")

# profile -> (services it starts, the Prometheus deployment label it serves)
expected = {
    None: ({"prometheus", "alertmanager", "grafana"}, None),
    "gpu": ({"tqkv", "prometheus", "alertmanager", "grafana"}, "single"),
    "cpu": ({"tqkv-cpu", "prometheus", "alertmanager", "grafana"}, "single"),
    "sharded": ({"tqkv-shard-0", "tqkv-shard-1", "tqkv-shard-2", "router", "prometheus",
                 "alertmanager", "grafana"}, "sharded"),
    "sharded-cpu": ({"tqkv-cpu-shard-0", "tqkv-cpu-shard-1", "tqkv-cpu-shard-2", "router",
                     "prometheus", "alertmanager", "grafana"}, "sharded"),
}
# Where Prometheus sends alerts: a service of every profile, on the port
# the Alertmanager service listens on.
alertmanagers = [t for a in prom.get("alerting", {}).get("alertmanagers", [])
                 for g in a.get("static_configs", []) for t in g["targets"]]
check(alertmanagers == ["alertmanager:9093"],
      f"Prometheus sends alerts to {alertmanagers}, want ['alertmanager:9093']")

for profile, (want_services, deployment) in expected.items():
    config = compose_config(profile)
    if config is None:
        continue
    services = started(config, profile)
    check(set(services) == want_services,
          f"profile {profile}: starts {sorted(services)}, want {sorted(want_services)}")
    published = [port_published(p)[1] for s in services.values() for p in s.get("ports", [])]
    check(len(published) == len(set(published)),
          f"profile {profile}: host ports published twice: {published}")
    on_network = names_on_network(services)
    check(all(t.rsplit(":", 1)[0] in on_network for t in alertmanagers),
          f"profile {profile}: Alertmanager {alertmanagers} not among {sorted(on_network)}")
    if "alertmanager" in services:
        mounts = [v.split(":")[:2] for v in services["alertmanager"].get("volumes", [])
                  if isinstance(v, str)]
        check(any(src.endswith("deploy/alertmanager") and dst == "/etc/alertmanager"
                  for src, dst in mounts),
              f"profile {profile}: deploy/alertmanager is not mounted at /etc/alertmanager: {mounts}")
    if deployment:
        hosts = [t.rsplit(":", 1)[0] for g in target_groups
                 if g.get("labels", {}).get("deployment") == deployment for t in g["targets"]]
        check(hosts and all(h in on_network for h in hosts),
              f"profile {profile}: Prometheus targets {hosts} not all among {sorted(on_network)}")
    if deployment == "sharded":
        check(all(h in on_network for h in shard_hosts),
              f"profile {profile}: router's shards {shard_hosts} not all among {sorted(on_network)}")
    for name, s in services.items():
        dockerfile = s.get("build", {}).get("dockerfile")
        if dockerfile:
            check(os.path.isfile(os.path.join(repo, dockerfile)), f"{name}: {dockerfile} missing")
        if name.startswith("tqkv") or name == "router":
            # The servers run without a token: the host publishes them on its
            # loopback unless TQKV_PUBLISH_ADDRESS says otherwise.
            for port in s.get("ports", []):
                check(port_published(port)[0] == "127.0.0.1",
                      f"{name} publishes {port} beyond the host's loopback by default")
        if name.startswith("tqkv"):
            # The router and Prometheus reach the server over the compose
            # network: it must listen beyond its container's loopback.
            command = s.get("command", [])
            check(any(a == "--host" and b == "0.0.0.0" for a, b in zip(command, command[1:])),
                  f"{name} does not pass --host 0.0.0.0 (the default is loopback): {command}")
            gpus = gpu_reservations(s)
            if "cpu" in name:
                check(not gpus, f"{name} reserves a GPU")
                check("Dockerfile.cpu" in (dockerfile or ""), f"{name} not built from Dockerfile.cpu")
            else:
                check(len(gpus) == 1 and ("count" in gpus[0] or "device_ids" in gpus[0]),
                      f"{name} reserves no NVIDIA GPU: {s.get('deploy')}")
                check("Dockerfile.cuda" in (dockerfile or ""), f"{name} not built from Dockerfile.cuda")
        for volume in s.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("/"):
                check(os.path.exists(source), f"{name}: mounts {source}, which does not exist")

# The shards of the GPU profile sit on distinct GPUs.
config = compose_config("sharded")
if config:
    ids = [tuple(gpu_reservations(s)[0].get("device_ids", [])) for n, s in config["services"].items()
           if n.startswith("tqkv-shard-") and gpu_reservations(s)]
    check(len(ids) == 3 and len(set(ids)) == 3, f"GPU shards' device_ids {ids} are not 3 distinct")

# Grafana: the provider's path is the mount of deploy/grafana/dashboards.
provider = yaml.safe_load(open(os.path.join(repo, "deploy/grafana/provisioning/dashboards/tqkv.yml")))
grafana = compose_config(None)["services"]["grafana"]
mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
path = provider["providers"][0]["options"]["path"]
check(mounts.get(path, "").endswith("deploy/grafana/dashboards"),
      f"Grafana loads dashboards from {path}, mounted from {mounts.get(path)}")

# Dashboards: they name the provisioned datasource, ids are unique, panels
# fit the 24-column grid without overlapping.
datasource = yaml.safe_load(open(os.path.join(
    repo, "deploy/grafana/provisioning/datasources/prometheus.yml")))["datasources"][0]
dash_dir = os.path.join(repo, "deploy/grafana/dashboards")
for file in sorted(os.listdir(dash_dir)):
    import json
    dashboard = json.load(open(os.path.join(dash_dir, file)))
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    check(len(ids) == len(set(ids)), f"{file}: panel ids repeat: {ids}")
    cells = {}
    for p in panels:
        g = p["gridPos"]
        check(g["x"] >= 0 and g["x"] + g["w"] <= 24, f"{file}: panel '{p['title']}' leaves the grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                check((x, y) not in cells,
                      f"{file}: '{p['title']}' overlaps '{cells.get((x, y))}'")
                cells[(x, y)] = p["title"]
        uses = [p.get("datasource")] + [t.get("datasource") for t in p.get("targets", [])]
        for ds in uses:
            if p["type"] != "row" or ds:
                check(ds == {"type": "prometheus", "uid": datasource["uid"]},
                      f"{file}: '{p['title']}' uses datasource {ds}, not uid {datasource['uid']}")

# Dockerfiles: what they COPY from the context exists and survives
# .dockerignore (which must keep the host's build/ and .git/ out: a copied
# CMakeCache.txt would point at the host's paths).
ignored = [l.strip() for l in open(os.path.join(repo, ".dockerignore"))
           if l.strip() and not l.startswith("#")]
check("build" in ignored and ".git" in ignored, f".dockerignore lacks build or .git: {ignored}")
import fnmatch
def dockerignored(path):
    parts = path.split("/")
    return any(fnmatch.fnmatch("/".join(parts[:i]), pat.lstrip("*/").rstrip("/"))
               or fnmatch.fnmatch("/".join(parts[:i]), pat)
               for pat in ignored for i in range(1, len(parts) + 1))
for name in ("Dockerfile.cuda", "Dockerfile.cpu", "Dockerfile.router"):
    text = open(os.path.join(repo, "deploy/docker", name)).read().replace("\\\n", " ")
    for m in re.finditer(r"^COPY\s+(?!--from)(.+)$", text, re.M):
        *sources, _ = m.group(1).split()
        for src in sources:
            if src == ".":
                continue
            check(os.path.exists(os.path.join(repo, src)), f"{name}: COPY {src}: no such path")
            check(not dockerignored(src.rstrip("/")), f"{name}: COPY {src} is excluded by .dockerignore")
    for script in re.findall(r"\b((?:scripts|deploy/docker)/[\w.-]+\.sh)", text):
        path = os.path.join(repo, script)
        check(os.path.isfile(path) and os.access(path, os.X_OK), f"{name}: {script} is not an executable file")
        check(not dockerignored(script), f"{name}: {script} is excluded by .dockerignore")
    if name != "Dockerfile.router":
        check(re.search(r"^USER\s+(?!root)\S+", text, re.M), f"{name}: runs as root")
        check(re.search(r"^HEALTHCHECK\s", text, re.M), f"{name}: no HEALTHCHECK")
        # tqkv-server's default is loopback, which no other container reaches.
        check(re.search(r'^CMD \[.*"--host", "0\.0\.0\.0"', text, re.M),
              f"{name}: CMD does not pass --host 0.0.0.0")
        check(len(re.findall(r"^FROM\s", text, re.M)) == 2, f"{name}: not a two-stage build")
        check("setup.sh --build-only" in text and "scripts/build.sh" in text,
              f"{name}: does not build with scripts/setup.sh and scripts/build.sh")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("docker-compose.yml: every profile accepted and consistent")
