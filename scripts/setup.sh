#!/usr/bin/env bash
# Installs every Debian package tqkv needs to build and test (python3 and
# python3-venv for the Python client's venv, openssl for the TLS tests), skipping those
# already present. Safe to run again. Needs root (or sudo) only when something
# is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev
  libgtest-dev libgmock-dev
  libbenchmark-dev
  python3 python3-venv openssl
)

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
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
