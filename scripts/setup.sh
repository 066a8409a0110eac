#!/usr/bin/env bash
# Installs every Debian package tqkv needs to build and test (python3 and
# python3-venv for the Python client's venv, openssl for the TLS tests),
# skipping those already present. Safe to run again. Needs root (or sudo) only when something
# is missing.
#
#   scripts/setup.sh               build and test: what scripts/test.sh needs
#   scripts/setup.sh --build-only  only what building the binaries needs (with
#                                  -DTQKV_BUILD_TESTS=OFF -DTQKV_BUILD_BENCHMARKS=OFF;
#                                  the Docker images, deploy/docker/)
set -euo pipefail

build_only=0
case "${1:-}" in
  "") ;;
  --build-only) build_only=1 ;;
  *) echo "usage: scripts/setup.sh [--build-only]" >&2; exit 2 ;;
esac

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev
  # The tqkv CLI's flags (CLI11) and --json output (nlohmann-json); header-only.
  libcli11-dev nlohmann-json3-dev
)
if [ "$build_only" -eq 0 ]; then
  packages+=(
    libgtest-dev libgmock-dev
    libbenchmark-dev
    # tests/deploy: compose and Prometheus config checks, a real Prometheus
    # and haproxy on loopback, curl and python3 to drive them; amtool
    # (prometheus-alertmanager) checks the Alertmanager config, yamllint the
    # Kubernetes manifests.
    docker-compose prometheus prometheus-alertmanager haproxy curl python3 python3-yaml yamllint
    # The Python client's venv and tests; openssl for the TLS tests.
    python3-venv openssl
    # Lint.ClangFormat: the tree follows .clang-format.
    clang-format
  )
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install packages" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
# prometheus and haproxy ship services that would start on install; the tests
# run their own instances on loopback ports. Where no policy says otherwise,
# keep services from starting for the length of the install.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# scripts/setup.sh: no service starts while it installs.\nexit 101\n' |
    "${sudo_cmd[@]}" tee "$policy" >/dev/null
  "${sudo_cmd[@]}" chmod 755 "$policy"
  own_policy=1
fi
remove_policy() { if [ "$own_policy" -eq 1 ]; then "${sudo_cmd[@]}" rm -f "$policy"; fi; }
trap remove_policy EXIT
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
