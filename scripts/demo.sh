#!/usr/bin/env bash
# Offline demo (no server): sets up, builds, then shows the codebook
# distortion table and every preset's attention quality on synthetic keys with
# outlier channels.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/build.sh
tqkv=build/bin/tqkv
demo=$(mktemp -d)
trap 'rm -rf "$demo"' EXIT
"$tqkv" synth --kind outlier-keys --rows 4096 --head-dim 128 --seed 1 --out "$demo/keys.npy"
"$tqkv" synth --kind gaussian --rows 4096 --head-dim 128 --seed 2 --out "$demo/values.npy"
"$tqkv" synth --kind gaussian --rows 64 --head-dim 128 --seed 3 --out "$demo/queries.npy"
echo
"$tqkv" distortion --head-dim 128
echo
"$tqkv" eval --preset all --keys "$demo/keys.npy" --queries "$demo/queries.npy" --values "$demo/values.npy"
