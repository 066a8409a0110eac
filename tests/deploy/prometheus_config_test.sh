#!/usr/bin/env bash
# promtool (Debian's prometheus package) on the shipped Prometheus files:
# `check config` on prometheus.yml (which loads alerts.yml), `check rules` on
# alerts.yml, and `test rules` with tests/deploy/alerts_test.yml (the alerts
# fire on tqkv-shaped series, after their `for`, and not on healthy ones,
# and a down server or none at all fires TqkvServerDown / TqkvNoServerUp);
# `amtool check-config` (prometheus-alertmanager) on the compose file's
# Alertmanager configuration.
# Usage: prometheus_config_test.sh REPO_ROOT
set -u
REPO=$1
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
need promtool
need amtool
deploy_init

promtool check config "$REPO/deploy/prometheus/prometheus.yml" || fail "promtool check config"
promtool check rules "$REPO/deploy/prometheus/alerts.yml" || fail "promtool check rules"
# rule_files in the test resolve next to it: put both side by side.
cp "$REPO/deploy/prometheus/alerts.yml" "$HERE/alerts_test.yml" "$WORK/"
promtool test rules "$WORK/alerts_test.yml" || fail "promtool test rules"
amtool check-config "$REPO/deploy/alertmanager/alertmanager.yml" || fail "amtool check-config"
finish "Prometheus and Alertmanager configuration and rules accepted; alert unit tests pass"
