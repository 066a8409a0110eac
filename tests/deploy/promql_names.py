#!/usr/bin/env python3
"""The PromQL the deployment ships: every expression of the Grafana dashboards
(panel targets and template-variable queries) and of the Prometheus rule
files, with the tqkv metric names and the label names each one uses.

  promql_names.py exprs DASHBOARD.json... RULES.yml...   one expression per line (JSON)
  promql_names.py check METRICS.txt DASHBOARD.json... RULES.yml...
      every tqkv_* name used must be a sample name in METRICS.txt (a scrape of
      a live server), and every label an expression filters or groups by must
      be on one of the metrics it uses (or be a label Prometheus adds).
  promql_names.py doc METRICS.txt REPO_ROOT PRESETS.json DOC.md...
      every tqkv_* metric name the documents (README.md and docs/**/*.md in
      metric_names_test.sh) mention is served: names that
      are presets (PRESETS.json: `tqkv presets --json`) or CMake targets of
      REPO_ROOT are not metrics; a name ending in '_' is a prefix that some
      served name must start with; a histogram may be named by its family.
"""
import os
import json
import re
import sys

# Labels Prometheus attaches to every scraped series, from prometheus.yml.
TARGET_LABELS = {"instance", "job", "deployment"}
# Grafana's built-in and dashboard variables, replaced by values that parse.
GRAFANA_VARS = [("$__rate_interval", "1m"), ("$__interval", "1m"), ("$__range", "1h")]


def grafana_exprs(path):
    dashboard = json.load(open(path))
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"{path}: panel '{p.get('title')}'", t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and q:
            out.append((f"{path}: variable '{v['name']}'", q))
    return out


def rule_exprs(path):
    import yaml  # python3-yaml (docker-compose depends on it)
    out = []
    for group in yaml.safe_load(open(path))["groups"]:
        for rule in group["rules"]:
            out.append((f"{path}: {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return out


def all_exprs(paths):
    exprs = []
    for path in paths:
        exprs += grafana_exprs(path) if path.endswith(".json") else rule_exprs(path)
    return exprs


def substitute(expr):
    """A dashboard expression as Prometheus would receive it with every
    server and cache selected."""
    for var, value in GRAFANA_VARS:
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def names_and_labels(expr):
    names = set(re.findall(r"\b(tqkv_[a-zA-Z0-9_]+)", expr))
    labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(l.strip() for l in group.split(",") if l.strip())
    for selector in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    m = re.match(r"\s*label_values\((.*),\s*(\w+)\)\s*$", expr)
    if m:
        labels.add(m.group(2))
    return names, labels


def scraped_series(path):
    """sample name -> label names seen on it, from a /metrics text page."""
    series = {}
    for line in open(path):
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        if not m or line.startswith("#"):
            continue
        series.setdefault(m.group(1), set()).update(re.findall(r"(\w+)=\"", m.group(2) or ""))
    return series


def doc_check(metrics_path, repo, presets_path, docs):
    series = scraped_series(metrics_path)
    families = set(series)
    for name in series:  # histogram and summary samples name their family too
        families.add(re.sub(r"_(bucket|sum|count)$", "", name))
    not_metrics = set()
    for text in [json.dumps(json.load(open(presets_path)))]:
        not_metrics.update(re.findall(r"\b(tqkv_[a-z0-9_]+)", text))
    for root, dirs, files in os.walk(repo):
        dirs[:] = [d for d in dirs if not d.startswith((".", "build"))]
        if "CMakeLists.txt" in files:
            text = open(os.path.join(root, "CMakeLists.txt")).read()
            not_metrics.update(re.findall(r"add_(?:library|executable|custom_target)\((tqkv[\w-]*)", text))
    failures = 0
    checked = set()
    for doc in docs:
        for name in sorted(set(re.findall(r"\b(tqkv_[a-z0-9_]+)", open(doc).read()))):
            if name in not_metrics:
                continue
            checked.add(name)
            served = any(f.startswith(name) for f in families) if name.endswith("_") else name in families
            if not served:
                print(f"FAIL: {doc} names {name}, which the server's /metrics does not serve")
                failures += 1
    print(f"{len(checked)} metric names in {len(docs)} documents checked: {', '.join(sorted(checked))}")
    if len(checked) < 5:
        print("FAIL: suspiciously few metric names found in the documents")
        failures += 1
    return 1 if failures else 0


def main():
    if sys.argv[1] == "doc":
        return doc_check(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    if sys.argv[1] == "exprs":
        for where, expr in all_exprs(sys.argv[2:]):
            print(json.dumps({"where": where, "expr": substitute(expr)}))
        return 0
    series = scraped_series(sys.argv[2])
    failures = 0
    used = set()
    exprs = all_exprs(sys.argv[3:])
    for where, expr in exprs:
        names, labels = names_and_labels(expr)
        used |= names
        for name in sorted(names - set(series)):
            print(f"FAIL: {where}: {name} is not in the server's /metrics")
            failures += 1
        known = set(TARGET_LABELS)
        for name in names & set(series):
            known |= series[name]
        for label in sorted(labels - known):
            print(f"FAIL: {where}: label '{label}' is on none of {sorted(names)}")
            failures += 1
    print(f"{len(exprs)} expressions use {len(used)} tqkv series names: {', '.join(sorted(used))}")
    if len(exprs) < 10 or len(used) < 10:
        print("FAIL: suspiciously few expressions or names parsed")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
